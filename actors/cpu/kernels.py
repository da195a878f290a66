"""The CPU actor's kernels: numpy over the pool's arena. They are also the executable
specification every other backend (OpenCL, OpenVINO) is tested against, op by op.

All kernels share one signature style: byte offsets into the arena (a flat uint8 array), static
sizes, and the two runtime values N (rows this step) and pos0 (tokens already in the KV cache).
"""
from __future__ import annotations

import numpy as np

from socllm.graph.ops import visible
from socllm.memory.arena import strided_rows

from socllm.models.oracle import route
from socllm.models.quant import FLOAT_TYPES, FORMATS, QK, dequant, dequant_float, dequant_q8_0


# byte -> (low nibble, high nibble) as float32: [256, 2]
_NIBBLES = np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=1).astype(np.float32)


KV_NUMPY = {"f32": np.float32, "f16": np.float16}    # memory/layout.KV_DTYPES as numpy types



def tree_keys(pos: int, entry) -> np.ndarray:
    """The keys a decode row sees: 0 .. pos (a chain's row); a draft tree's row (entry: L, base,
    mask low, mask high, its mask not 0; actors/gpu/cl/paged.cl tree_row): 0 .. L-1 and base + b
    for each bit b of the mask."""
    mask = (int(entry[2]) & 0xFFFFFFFF) | ((int(entry[3]) & 0xFFFFFFFF) << 32)
    if not mask:
        return np.arange(pos + 1)
    return np.concatenate([np.arange(int(entry[0])),
                           [int(entry[1]) + b for b in range(64) if mask >> b & 1]]).astype(np.int64)

class NumpyKernels:
    def __init__(self, arena: np.ndarray, kv_dtype: str = "f32"):
        self.arena = arena  # uint8 [bytes]
        self.kv_type = KV_NUMPY[kv_dtype]   # f16 KV rows: stored rounded to nearest even

    # -- views ---------------------------------------------------------------------------------
    def f32(self, off: int, rows: int, cols: int) -> np.ndarray:
        return self.arena[off: off + rows * cols * 4].view(np.float32).reshape(rows, cols)

    def _arr(self, off, shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.arena[off: off + n].view(dtype).reshape(shape)

    def out_rows(self, a, N, pos0, cols):
        """An op's output -> a writable [N, cols] view of rows a["ld"] wide (a row-cut half: its
        columns of the whole output); KV refs start at row pos0 (in place), or, paged, row n is
        KV row rows[n] (a fancy-indexed _Scatter view)."""
        ref, ld = a["out"], a.get("ld") or cols
        if "rows" in a:
            rows = self.i32(a["rows"], N)
            return _Scatter(self._arr(ref[1], (1 + int(rows.max()), cols), self.kv_type), rows)
        if ref[0] == "kv" and self.kv_type != np.float32:
            raise ValueError("an f16 KV cache is written through row maps only (paged programs)")
        off = ref[1] + (pos0 * ld * 4 if ref[0] == "kv" else 0)
        return strided_rows(self.arena, off, N, cols, ld, np.float32)

    def _kv(self, ref, rows, cols: int) -> np.ndarray:
        """KV rows `rows` (a count from row 0, or an index array) of a "kv" ref in f32: [rows,
        cols]; f16 rows are converted after they are picked, never the whole cache."""
        n = rows if isinstance(rows, int) else int(rows.max()) + 1
        cache = self._arr(ref[1], (n, cols), self.kv_type)
        return (cache if isinstance(rows, int) else cache[rows]).astype(np.float32, copy=False)

    def i32(self, ref, n: int) -> np.ndarray:
        return self._arr(ref[1], (n,), np.int32)

    def w4(self, ref, M, K):
        _, qs, d, m = ref
        return (self._arr(qs, (M, K // 2), np.uint8), self._arr(d, (M, K // QK), np.float16),
                self._arr(m, (M, K // QK), np.float16))

    def w8(self, ref, V, D):
        _, qs, d = ref
        return self._arr(qs, (V, D), np.int8), self._arr(d, (V, D // QK), np.float16)

    def matrix(self, ref, M, K, rows=None) -> np.ndarray:
        """Weight ref of any matrix kind -> f32 [M, K], or only its rows `rows` (an index
        array): dequantized per call, one matrix at a time, never the model."""
        kind = ref[0]
        if kind == "w8":
            qs, d = self.w8(ref, M, K)
            return dequant_q8_0(qs, d) if rows is None else dequant_q8_0(qs[rows], d[rows])
        if kind == "wt":
            w = self._arr(ref[2], (M, K), FLOAT_TYPES[ref[1]])
            return dequant_float(ref[1], w if rows is None else w[rows])
        if kind == "w4":
            qs, d, m = self.w4(ref, M, K)
            if rows is None:    # the hot path of the CPU actor: a byte -> two floats table lookup
                q = _NIBBLES[qs].reshape(M, K // QK, QK)
                w = q * d.astype(np.float32)[:, :, None] + m.astype(np.float32)[:, :, None]
                return w.reshape(M, K)
            fmt, qh = "Q4_1", None
            dm = np.stack([d, m], axis=-1)
        else:
            fmt = ref[1]
            f = FORMATS[fmt]
            sdt = np.float16 if f.scale == "f16" else np.float32
            qs = self._arr(ref[2], (M, K // 2), np.uint8)
            dm = self._arr(ref[3], (M, K // f.group, 2), sdt)
            qh = self._arr(ref[4], (M, K // QK * f.hb), np.uint8) if f.hb else None
        if rows is not None:
            qs, dm, qh = qs[rows], dm[rows], (qh[rows] if qh is not None else None)
        return dequant(fmt, qs, dm, qh)

    # -- dispatch ------------------------------------------------------------------------------
    def run(self, op: str, a: dict, N: int, pos0: int):
        getattr(self, op)(a, N, pos0)

    # -- ops -----------------------------------------------------------------------------------
    def embed(self, a, N, pos0):
        """ids int32 [N], table [V, D] (any matrix kind) -> out [N, D] (times a["scale"]: Gemma)"""
        ids = self._arr(a["ids"][1], (N,), np.int32)
        rows = self.matrix(a["table"], a["V"], a["D"], ids)
        self.f32(a["out"][1], N, a["D"])[:] = rows * np.float32(a["scale"]) if "scale" in a else rows

    def rmsnorm(self, a, N, pos0):
        """x [N, D], w [D] -> out [N, D] = x / sqrt(mean(x^2) + eps) * w (heads: x [N, heads*D],
        each head's D values normalized alone: Qwen3's Q/K norms)"""
        D, N = a["D"], N * a.get("heads", 1)
        x = self.f32(a["x"][1], N, D)
        w = self.f32(a["w"][1], 1, D)[0]
        r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + np.float32(a["eps"]))
        self.f32(a["out"][1], N, D)[:] = x * r * w

    def linear(self, a, N, pos0):
        """x [N, K], W [M, K] (any matrix kind) -> out [N, M] = x @ W.T (+ b [M] if given; out
        may be a KV ref)."""
        K, M = a["K"], a["M"]
        x = self.f32(a["x"][1], N, K)
        y = x @ self.matrix(a["w"], M, K).T
        if "b" in a:
            y += self.f32(a["b"][1], 1, M)[0]
        self.out_rows(a, N, pos0, M)[:] = y

    def rope(self, a, N, pos0):
        """x [N, heads*hd] -> out (may be a KV ref): rotate pairs (2i, 2i+1) by pos * theta^(-2i/hd)
        (GGML's NORM rope, which the GGUF's permuted Q/K weights expect), or with neox pairs
        (i, i + hd/2) (Qwen2); f [hd/2]: each pair's frequency divided by f[i] (Llama 3.1)."""
        H, hd = a["heads"], a["head_dim"]
        x = self.f32(a["x"][1], N, H * hd).reshape(N, H, hd // 2, 2)
        if a.get("neox"):
            x = self.f32(a["x"][1], N, H * hd).reshape(N, H, 2, hd // 2).transpose(0, 1, 3, 2)
        inv = np.float32(a["theta"]) ** (-np.arange(0, hd, 2, dtype=np.float32) / hd)
        if "f" in a:
            inv = inv / self.f32(a["f"][1], 1, hd // 2)[0]
        pos = self.i32(a["pos"], N).astype(np.float32) if "pos" in a else \
            np.arange(pos0, pos0 + N, dtype=np.float32)           # paged: rows at own positions
        ang = pos[:, None] * inv[None, :]                                            # [N, hd/2]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0], x[..., 1]
        y = np.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
        y = (y.transpose(0, 1, 3, 2) if a.get("neox") else y).reshape(N, H * hd)
        self.out_rows(a, N, pos0, H * hd)[:] = y

    def attention(self, a, N, pos0):
        """q [N, H*hd], K/V cache [pos0+N, KVH*hd] (rows pos0.. already written) -> out [N, H*hd];
        causal: row n sees keys 0 .. pos0+n (a["window"]: only the last `window` of them);
        GQA: head h reads kv head h // (H/KVH)."""
        H, KVH, hd = a["heads"], a["kv_heads"], a["head_dim"]
        if "btab" in a:
            return self.attention_paged(a, N)
        L = pos0 + N
        q = self.f32(a["q"][1], N, H * hd).reshape(N, H, hd)
        k = self._kv(a["k"], L, KVH * hd).reshape(L, KVH, hd)
        v = self._kv(a["v"], L, KVH * hd).reshape(L, KVH, hd)
        g = H // KVH
        qh = q.reshape(N, KVH, g, hd).transpose(1, 2, 0, 3)            # [KVH, g, N, hd]
        s = np.einsum("kgnd,lkd->kgnl", qh, k) / np.float32(np.sqrt(hd))
        mask = ~visible(pos0 + np.arange(N), L, a.get("window", 0))    # [N, L]
        s = np.where(mask, np.float32(-np.inf), s)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        p = s / s.sum(axis=-1, keepdims=True)
        o = np.einsum("kgnl,lkd->nkgd", p, v).reshape(N, H * hd)
        self.f32(a["out"][1], N, H * hd)[:] = o

    def attention_paged(self, a, N):
        """Row n of sequence seq[n] at position pos[n] sees that sequence's keys 0 .. pos[n] (a
        window: the last `window` of them); key l is KV row btab[seq[n], l // block_rows] * block_rows + l % block_rows.
        A draft tree's row sees the keys of its tree entry instead (tmask, tree_keys)."""
        H, KVH, hd, br = a["heads"], a["kv_heads"], a["head_dim"], a["block_rows"]
        pos, seq = self.i32(a["pos"], N), self.i32(a["seq"], N)
        btab = self._arr(a["btab"][1], (int(seq.max()) + 1, a["max_blocks"]), np.int32)
        q = self.f32(a["q"][1], N, H * hd)
        out = self.f32(a["out"][1], N, H * hd)
        tm = self.i32(a["tmask"], 4 * N).reshape(N, 4) if "tmask" in a else np.zeros((N, 4), np.int32)
        if "part" in a:
            return self._attention_part(a, N, q, pos, seq, btab, tm)
        for n in range(N):
            ls = tree_keys(int(pos[n]), tm[n])
            L = len(ls)
            phys = btab[seq[n], ls // br] * br + ls % br
            k = self._kv(a["k"], phys, KVH * hd).reshape(L, KVH, hd)
            v = self._kv(a["v"], phys, KVH * hd).reshape(L, KVH, hd)
            qh = q[n].reshape(KVH, H // KVH, hd)
            s = np.einsum("kgd,lkd->kgl", qh, k) / np.float32(np.sqrt(hd))
            if a.get("window", 0):
                s = np.where(int(pos[n]) - ls < a["window"], s, np.float32(-np.inf))
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            p = s / s.sum(axis=-1, keepdims=True)
            out[n] = np.einsum("kgl,lkd->kgd", p, v).reshape(H * hd)

    def _attention_part(self, a, N, q, pos, seq, btab, tm):
        """HCMP (graph/hcmp.py): one part of each row's keys (dense: 0 .. L-1 of its tree entry,
        from the window's start; sparse: the entry's tree keys) -> out [N, cols]: the heads'
        outputs over those keys alone [H*hd], then each head's log-sum-exp [H] (-inf: none)."""
        H, KVH, hd, br = a["heads"], a["kv_heads"], a["head_dim"], a["block_rows"]
        out = self.f32(a["out"][1], N, a["cols"])
        out[:, :H * hd], out[:, H * hd:H * hd + H] = 0.0, -np.inf
        if a["part"] == "sparse":
            return self._sparse_part(a, N, q, seq, btab, tm, out)
        for n in range(N):
            p, e = int(pos[n]), tm[n]
            tree = tree_keys(p, e) if (int(e[2]) | int(e[3])) else np.arange(0)
            L = int(e[0]) if len(tree) else p + 1
            lo = max(0, p + 1 - a["window"]) if a.get("window", 0) else 0
            ls = np.arange(lo, L) if a["part"] == "dense" else tree[L:]
            if not len(ls):
                continue
            phys = btab[seq[n], ls // br] * br + ls % br
            k = self._kv(a["k"], phys, KVH * hd).reshape(len(ls), KVH, hd)
            v = self._kv(a["v"], phys, KVH * hd).reshape(len(ls), KVH, hd)
            s = np.einsum("kgd,lkd->kgl", q[n].reshape(KVH, H // KVH, hd), k) / np.float32(np.sqrt(hd))
            m = s.max(axis=-1, keepdims=True)
            w = np.exp(s - m)
            z = w.sum(axis=-1, keepdims=True)
            out[n, :H * hd] = (np.einsum("kgl,lkd->kgd", w, v) / z).reshape(H * hd)
            out[n, H * hd:H * hd + H] = (m + np.log(z)).reshape(H)

    def _sparse_part(self, a, N, q, seq, btab, tm, out):
        """HCMP's sparse part for all rows at once (Ghidorah §III-B3's CPU optimization: the
        tree keys as an index list, gathered, one vectorized product a layer, not a loop a row):
        row n's keys base + b for each bit b of its entry's mask."""
        H, KVH, hd, br = a["heads"], a["kv_heads"], a["head_dim"], a["block_rows"]
        t = tm.astype(np.int64)
        mask = (t[:, 2] & 0xFFFFFFFF) | ((t[:, 3] & 0xFFFFFFFF) << 32)                  # [N]
        bits = ((mask[:, None] >> np.arange(64)) & 1).astype(bool)                    # [N, 64]
        live = np.flatnonzero(bits.any(axis=1))
        if not len(live):
            return
        K = int(bits[live].sum(axis=1).max())
        order = np.argsort(~bits[live], axis=1, kind="stable")[:, :K]   # the set bits, in order
        valid = np.take_along_axis(bits[live], order, axis=1)                         # [R, K]
        keys = t[live, 1:2] + np.where(valid, order, 0)                                  # [R, K]
        phys = btab[seq[live, None], keys // br] * br + keys % br
        k = self._kv(a["k"], phys.ravel(), KVH * hd).reshape(len(live), K, KVH, hd)
        v = self._kv(a["v"], phys.ravel(), KVH * hd).reshape(len(live), K, KVH, hd)
        qh = q[live].reshape(len(live), KVH, H // KVH, hd)
        s = (qh @ k.transpose(0, 2, 3, 1)) / np.float32(np.sqrt(hd))                  # [R, KVH, g, K]
        s = np.where(valid[:, None, None, :], s, np.float32(-np.inf))
        m = s.max(axis=-1, keepdims=True)
        w = np.exp(s - m)
        z = w.sum(axis=-1, keepdims=True)
        out[live, :H * hd] = ((w @ v.transpose(0, 2, 1, 3)) / z).reshape(len(live), H * hd)
        out[live, H * hd:H * hd + H] = (m + np.log(z)).reshape(len(live), H)

    def attn_merge(self, a, N, pos0):
        """HCMP: the dense and sparse parts' rows a, b [N, cols] -> out [N, H*hd], each part's
        outputs weighted by its share of the softmax's sum (its e^lse over both)."""
        H, hd, cols = a["heads"], a["head_dim"], a["cols"]
        pa, pb = self.f32(a["a"][1], N, cols), self.f32(a["b"][1], N, cols)
        la, lb = pa[:, H * hd:H * hd + H], pb[:, H * hd:H * hd + H]                # [N, H]
        m = np.maximum(la, lb)
        wa, wb = np.exp(la - m)[..., None], np.exp(lb - m)[..., None]
        oa, ob = pa[:, :H * hd].reshape(N, H, hd), pb[:, :H * hd].reshape(N, H, hd)
        self.f32(a["out"][1], N, H * hd)[:] = ((oa * wa + ob * wb) / (wa + wb)).reshape(N, H * hd)

    def silu_mul(self, a, N, pos0):
        """g, u [N, F] -> out = silu(g) * u"""
        F = a["F"]
        g, u = self.f32(a["g"][1], N, F), self.f32(a["u"][1], N, F)
        self.f32(a["out"][1], N, F)[:] = g / (1.0 + np.exp(-g)) * u

    def gelu_mul(self, a, N, pos0):
        """g, u [N, F] -> out = gelu(g) * u, GELU's tanh form (Gemma's GeGLU)"""
        F = a["F"]
        g, u = self.f32(a["g"][1], N, F), self.f32(a["u"][1], N, F)
        c = np.float32(np.sqrt(2 / np.pi))
        self.f32(a["out"][1], N, F)[:] = 0.5 * g * (1 + np.tanh(c * (g + np.float32(0.044715) * g ** 3))) * u

    def add(self, a, N, pos0):
        """a, b [N, D] -> out = a + b"""
        D = a["D"]
        self.f32(a["out"][1], N, D)[:] = self.f32(a["a"][1], N, D) + self.f32(a["b"][1], N, D)

    def moe_route(self, a, N, pos0):
        """x [N, E] router logits, sal [N, D] -> out [N, 2k+1]: each row's k experts (ids as
        floats, the most probable first, ties to the lower id), their softmax weights
        (renormalized: norm), and the L2 norm of its sal row (its saliency)"""
        E, k = a["E"], a["k"]
        sel, w = route(self.f32(a["x"][1], N, E), k, bool(a.get("norm", 1)))
        out = self.f32(a["out"][1], N, 2 * k + 1)
        out[:, :k], out[:, k:2 * k] = sel, w
        out[:, 2 * k] = np.linalg.norm(self.f32(a["sal"][1], N, a["D"]), axis=1)

    def moe_linear(self, a, N, pos0):
        """x [N, K] (per_slot: [N, k*K], one input a slot), route [N, 2k+1], W [E*M, K] (expert e:
        rows e*M ..) -> out [N, k*M]: y[n, j] = x[n(, j)] @ W_{e[n, j]}.T; combine: out [N, M] =
        sum over j in rank order of w[n, j] * y[n, j]. The rows of one expert in one matmul."""
        K, M, E, k = a["K"], a["M"], a["E"], a["k"]
        rt = self.f32(a["route"][1], N, 2 * k + 1)
        sel, w = rt[:, :k].astype(np.int64), rt[:, k:2 * k]
        x = self.f32(a["x"][1], N, K * (k if a["per_slot"] else 1)).reshape(N, -1, K)
        y = np.zeros((N, k, M), np.float32)
        for e in np.unique(sel):
            n, j = np.nonzero(sel == e)
            We = self.matrix(a["w"], E * M, K, np.arange(e * M, (e + 1) * M))      # [M, K]
            y[n, j] = x[n, j if a["per_slot"] else 0] @ We.T
        if not a["combine"]:
            self.f32(a["out"][1], N, k * M)[:] = y.reshape(N, k * M)
            return
        out = w[:, 0, None] * y[:, 0]
        for j in range(1, k):
            out = out + w[:, j, None] * y[:, j]
        self.f32(a["out"][1], N, M)[:] = out

    def lm_head(self, a, N, pos0):
        """x [N, D] (last row used), table [V, D] -> out [V] logits of row N-1"""
        D, V = a["D"], a["V"]
        if a.get("all_rows"):           # a batch: every row's logits [N, V]
            out = self.f32(a["out"][1], N, V)
            for n in range(N):
                self.lm_head({**a, "all_rows": False, "x": ("a", a["x"][1] + n * D * 4),
                              "out": ("a", a["out"][1] + n * V * 4)}, 1, pos0)
            return out
        x = self.f32(a["x"][1], N, D)[N - 1]
        out = self.f32(a["out"][1], 1, V)[0]
        if a["table"][0] != "w8":       # another format: dequantized 4096 rows at a time
            for lo in range(0, V, 4096):
                out[lo:lo + 4096] = self.matrix(a["table"], V, D, np.arange(lo, min(V, lo + 4096))) @ x
            return
        # per block: sum_j x_j q_j scaled by d, in row chunks: never a [V, D] f32 copy of the table
        qs, d = self.w8(a["table"], V, D)
        xb = x.reshape(D // QK, QK)
        for lo in range(0, V, 4096):
            hi = min(V, lo + 4096)
            dots = np.einsum("vbj,bj->vb", qs[lo:hi].reshape(hi - lo, D // QK, QK).astype(np.float32), xb)
            out[lo:hi] = (dots * d[lo:hi].astype(np.float32)).sum(axis=1)


class _Scatter:
    """`view[:] = y` writes y's row n to row idx[n] of `base` (paged KV rows)."""

    def __init__(self, base: np.ndarray, idx: np.ndarray):
        self.base, self.idx = base, idx

    def __setitem__(self, key, value):
        if key != slice(None):
            raise IndexError("a scattered output is written whole")
        self.base[self.idx] = value
