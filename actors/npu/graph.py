"""Building an OpenVINO graph from socllm tasks: SSA over arena offsets (`Graph`) and one small
builder per op (`BUILDERS`), with the semantics of actors/cpu/kernels.py. OVSegment
(npu/segment.py) compiles and runs what these build.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset15 as ops15

from socllm.models.quant import FORMATS, QK, codes

from socllm.graph.ops import visible
from socllm.actors.npu.moe import MOE_BUILDERS
from socllm.memory.arena import strided_rows

F32 = np.float32


def f32(x) -> ov.Node:
    return ops.constant(np.asarray(x, F32))


class Graph:
    """SSA over arena offsets while a segment is built: a slot may be written several times (slots
    are reused across layers), so `vals` holds the latest in-graph value of each offset."""

    def __init__(self, arena: np.ndarray, B: int, kv_len: int, const_weights: bool = False,
                 pool: dict | None = None, per_row: bool = False):
        """pool: {"kv_dtype", "kv_rows", "max_seqs"}, the KV region's element type, its rows per
        layer and the block tables' rows: a paged step's attention gathers its rows from the
        whole region through its sequence's block table. per_row: a paged decode batch, every
        row of its own sequence at its own position (kv_batch), not a chunk of one sequence."""
        self.arena, self.B, self.kv_len = arena, B, kv_len
        self.const_weights, self.per_row = const_weights, per_row
        self.pool = pool or {"kv_dtype": "f32", "kv_rows": 0, "max_seqs": 1}
        self.kv_type = np.float16 if self.pool["kv_dtype"] == "f16" else F32
        self.phys = None            # a paged step's physical KV rows [kv_len] ([B, kv_len]: per_row)
        self.pos0 = ops.parameter([1], np.int64, name="pos0")   # tokens already in the KV cache
        self.n = ops.parameter([1], np.int64, name="n")         # real rows, <= B
        self.rows = ops.constant(np.arange(B, dtype=np.int64))  # [B]
        self.valid = ops.less(self.rows, self.n)                # [B] row < N
        self.params = [self.pos0, self.n]
        self.inputs = [None, None]  # arena view bound to each parameter (pos0, n: set per run)
        self.vals = {}              # off -> (value [B, cols], deps, is_input)
        self.kv_caches = {}         # off -> Parameter [kv_len, cols]: the cache's first kv_len rows
        self.kv_new = {}            # off -> (value [B, cols] = cache rows pos0.., deps)
        self.kv_at_rows = {}        # off -> io offset of the step's KV rows [B] (paged: the
        #                             value's rows go to those rows of the region, ov_segment)
        self.input_readers = {}     # off -> {task}: tasks that read the arena's version of a slot
        self.task, self.deps = 0, set()
        self.act_inputs = []        # (parameter index, off, cols, dtype) of slots read from the pool
        self.masks = {}             # key -> a mask Constant every layer shares (one copy, not L)
        self.ld = {}                # off -> row width of the output a row-cut half writes into

    def mask(self, key, make) -> ov.Node:
        if key not in self.masks:
            self.masks[key] = ops.constant(make())
        return self.masks[key]

    def view(self, off: int, shape, dtype, ld: int | None = None) -> np.ndarray:
        """shape at off; with ld, [rows, cols] whose rows are ld elements apart (a row-cut half)."""
        if ld is not None:
            return strided_rows(self.arena, off, *shape, ld, dtype)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.arena[off: off + n].view(dtype).reshape(shape)

    def begin(self, task: int):
        self.task, self.deps = task, set()

    # -- activations ---------------------------------------------------------------------------
    def param(self, name, view: np.ndarray) -> ov.Node:
        p = ops.parameter(list(view.shape), view.dtype, name=name)
        self.params.append(p)
        self.inputs.append(view)
        return p

    def read(self, ref, cols: int | None, dtype=F32) -> ov.Output:
        """An "a" ref -> its latest value [B, cols] ([B] when cols is None)."""
        off = ref[1]
        if off not in self.vals:
            shape = (self.B,) if cols is None else (self.B, cols)
            p = self.param(f"a{off}", self.view(off, shape, dtype))
            self.act_inputs.append((len(self.params) - 1, off, cols, dtype))
            keep = self.valid if cols is None else ops.unsqueeze(self.valid, 1)
            self.vals[off] = (ops.select(keep, p, np.zeros((), dtype)).output(0), frozenset(), True)
        val, deps, is_input = self.vals[off]
        want = [self.B] if cols is None else [self.B, cols]
        if list(val.get_shape()) != want:
            raise ValueError(f"slot {off} holds {val.get_shape()}, task {self.task} reads {want}")
        if is_input:
            self.input_readers.setdefault(off, set()).add(self.task)
        self.deps |= deps
        return val

    def kv(self, ref, cols: int):
        """A "kv" ref -> (cache [kv_len, cols] or None when kv_len is 0, this step's rows [B, cols]
        from the task that wrote them in this segment, or None: another segment or processor wrote
        them into the cache, rows pos0..pos0+B, which kv_len then covers)."""
        off = ref[1]
        if self.kv_len and off not in self.kv_caches:
            self.kv_caches[off] = self.param(f"kv{off}", self.view(off, (self.kv_len, cols), F32))
        new, deps = self.kv_new.get(off, (None, frozenset()))
        self.deps |= deps
        return self.kv_caches.get(off), new

    def kv_paged(self, ref, cols: int, a) -> ov.Output:
        """A paged step's cache rows 0 .. kv_len-1 of sequence seq[0] (a prefill chunk: one
        sequence), gathered from the layer's whole KV region through its block table ->
        [kv_len, cols] f32. Table entries past the sequence's blocks may hold any block id: the
        rows they give are masked (clamped, so the gather stays in the region)."""
        if self.phys is None:
            btab = self._btab(a)
            seq0 = ops.gather(self.read(a["seq"], None, np.int32), np.array([0], np.int64), 0)
            table = ops.reshape(ops.gather(btab, seq0, 0), np.array([a["max_blocks"]], np.int64),
                                False)                                                   # [mb]
            self.phys = self._phys(table, 0, a)                                          # [T]
        return self._region_rows(ref[1], cols, self.phys)

    def kv_batch(self, ref, cols: int, a) -> ov.Output:
        """A decode batch's cache rows 0 .. kv_len-1 of every row's own sequence seq[i], each
        through its block table -> [B, kv_len, cols] f32 (the keys past pos[i] are the caller's
        to mask, as kv_paged's)."""
        if self.phys is None:
            btab = self._btab(a)
            tables = ops.gather(btab, self.read(a["seq"], None, np.int32), 0)          # [B, mb]
            self.phys = self._phys(tables, 1, a)                                         # [B, T]
        got = self._region_rows(ref[1], cols, self.phys)              # [B, T, cols] or [B*T, cols]
        return ops.reshape(got, np.array([self.B, self.kv_len, cols], np.int64), False).output(0)

    def _btab(self, a) -> ov.Node:
        """The block tables [max_seqs, max_blocks] (the pool's io rows) as a graph input."""
        mb = a["max_blocks"]
        return self.param(f"btab{a['btab'][1]}",
                          self.view(a["btab"][1], (self.pool["max_seqs"], mb), np.int32))

    def _phys(self, tables, axis: int, a) -> ov.Node:
        """Block tables (their block ids on `axis`) -> the physical KV rows of keys 0 .. kv_len-1
        on that axis, clamped into the region."""
        br, mb, T = a["block_rows"], a["max_blocks"], self.kv_len
        if T > mb * br:
            raise ValueError(f"{T} KV rows exceed a block table of {mb} blocks")
        j = np.arange(T)
        blocks = ops.gather(tables, ops.constant((j // br).astype(np.int32)), axis)
        phys = ops.add(ops.multiply(blocks, np.int32(br)), ops.constant((j % br).astype(np.int32)))
        return ops.clamp(phys, 0, self.pool["kv_rows"] - 1)

    def _region_rows(self, off: int, cols: int, phys) -> ov.Output:
        """Rows `phys` of the layer's KV region at `off` -> [*phys, cols] f32 (f16 region:
        [rows of phys, cols])."""
        rows = self.pool["kv_rows"]
        # The region enters with its row count left dynamic: a static [rows, cols] input makes
        # the CPU plugin allocate a region-sized buffer per compiled graph (measured: ~110 MB per
        # KV-length bucket at 512 MB of K/V), and f16 inputs are converted whole at every run, so
        # an f16 region enters as its bytes and only the gathered rows are decoded (half_bits).
        half = self.kv_type == np.float16
        view = self.view(off, (rows, cols * 2), np.uint8) if half else self.view(off, (rows, cols), F32)
        region = ops.parameter([-1, view.shape[1]], view.dtype, name=f"kv{off}")
        self.params.append(region)
        self.inputs.append(view)
        got = ops.gather(region, phys, 0)                          # [*phys, cols (x2 bytes)]
        return (half_bits(got, cols) if half else got).output(0)   # f16: [rows of phys, cols]

    def write(self, ref, value, rows=None):
        """rows: a paged K/V write's ref of the step's KV rows (ov_segment binds them)."""
        deps = frozenset(self.deps | {self.task})
        if ref[0] == "kv":
            self.kv_new[ref[1]] = (value.output(0), deps)
            if rows is not None:
                self.kv_at_rows[ref[1]] = rows[1]
        else:
            self.vals[ref[1]] = (value.output(0), deps, False)

    # -- weights: Parameters bound to the pool ---------------------------------------------
    # Weights enter the graph as inputs over the arena, not as Constants: OpenVINO then keeps no
    # copy of them (measured: a compiled model repacks its Constants, ~2.4 bytes per Q4_1 weight,
    # per bucket), and segments that differ only in which layer's weights they read (every layer
    # of a hetero prefill) share one compiled graph. The lm-head table is the exception (below).
    def weight(self, name, view: np.ndarray, ov_type=None, shape=None) -> ov.Node:
        if ov_type is None:
            p = ops.parameter(list(view.shape), view.dtype, name=name)
            tensor = ov.Tensor(view, shared_memory=True)
        else:
            p = ops.parameter(shape, ov_type, name=name)
            tensor = ov.Tensor(view, shape, ov_type)      # shares the arena bytes (u4 packed)
        self.params.append(p)
        self.inputs.append(tensor)
        return p

    def wf(self, ref, D: int) -> ov.Node:
        return self.weight(f"wf{ref[1]}", self.view(ref[1], (D,), F32))

    def w4(self, ref, M: int, K: int) -> ov.Node:
        """Q4_1 [M, K]: w = d*q + m per 32-block, dequantized inside the graph (W4A16)."""
        if self.const_weights:
            return self.w4_const(ref, M, K)
        _, qs, d, m = ref
        nb = K // QK
        q = self.weight(f"q{qs}", self.view(qs, (M * K // 2,), np.uint8), ov.Type.u4, [M, nb, QK])
        dd = ops.convert(self.weight(f"d{d}", self.view(d, (M, nb, 1), np.float16)), F32)
        mm = ops.convert(self.weight(f"m{m}", self.view(m, (M, nb, 1), np.float16)), F32)
        w = ops.add(ops.multiply(ops.convert(q, F32), dd), mm)
        return ops.reshape(w, np.array([M, K], np.int64), False)

    def w4_const(self, ref, M: int, K: int) -> ov.Node:
        """Q4_1 [M, K] as Constants over the arena in the pattern the CPU plugin runs as a
        compressed FullyConnected: u4 -> Convert -> Subtract(zp) -> Multiply(d) -> Reshape,
        w = d*q + m = (q - zp)*d. The plugin keeps its own ~1 byte/weight copy per compiled graph,
        but runs a one-row step 3-4x faster than dequantizing inputs in the graph (measured)."""
        _, qs, d, m = ref
        nb = K // QK
        q = ov.op.Constant(ov.Tensor(self.view(qs, (M * K // 2,), np.uint8), [M, nb, QK], ov.Type.u4),
                           shared_memory=True)
        d32 = self.view(d, (M, nb, 1), np.float16).astype(F32)
        m32 = self.view(m, (M, nb, 1), np.float16).astype(F32)
        # d == 0 (w = m for the whole block): a tiny scale and a zero point of -+2^15 give
        # w = m * (1 + q/2^15), within 5e-4 of m.
        scale = np.where(d32 != 0, d32, np.abs(m32) * F32(2.0 ** -15))
        zp = np.divide(-m32, scale, out=np.zeros_like(m32), where=scale != 0)
        w = ops.multiply(ops.subtract(ops.convert(q, F32), f32(zp)), f32(scale))
        return ops.reshape(w, np.array([M, K], np.int64), False)

    def matrix(self, ref, M: int, K: int) -> ov.Node:
        """A weight [M, K] of any block format: Q4_1 / Q4_0 as w4; the others (models/quant.py)
        w = d * (lo + 16 hi) + m per group, as graph inputs over the arena (wq_rows), or,
        const_weights, as Constants in the compressed-FullyConnected pattern: u8 codes ->
        Convert -> Subtract(zp) -> Multiply(d)."""
        if ref[0] == "w4":
            return self.w4(ref, M, K)
        if ref[0] == "wt":
            return self.wt_rows(ref, M, K, None)
        if ref[0] != "wq":
            raise ValueError(f"the NPU graphs do not read {ref[0]} weights")
        if not self.const_weights:
            return self.wq_rows(ref, M, K, None)
        _, fmt, qs, dm, qh = ref
        f = FORMATS[fmt]
        g = f.group
        qh_view = self.view(qh, (M, K // QK * f.hb), np.uint8) if f.hb else None
        q = codes(fmt, self.view(qs, (M, K // 2), np.uint8), qh_view)   # the plugin copies them anyway
        pairs = self.view(dm, (M, K // g, 2), np.float16 if f.scale == "f16" else F32).astype(F32)
        d32, m32 = pairs[:, :, 0:1], pairs[:, :, 1:2]
        scale = np.where(d32 != 0, d32, np.abs(m32) * F32(2.0 ** -15))       # as w4_const
        zp = np.divide(-m32, scale, out=np.zeros_like(m32), where=scale != 0)
        w = ops.multiply(ops.subtract(ops.convert(ops.constant(q.reshape(M, K // g, g)), F32),
                                      f32(zp)), f32(scale))
        return ops.reshape(w, np.array([M, K], np.int64), False)

    def wt_rows(self, ref, M: int, K: int, ids) -> ov.Node:
        """A float weight [M, K] (F32, F16, BF16 as in the file) as a graph input over the arena;
        ids [B]: only those rows -> [B, K] f32."""
        _, kind, off = ref
        if kind == "BF16":
            w = self.weight(f"t{off}", self.view(off, (M * K,), np.uint16), ov.Type.bf16, [M, K])
        else:
            w = self.weight(f"t{off}", self.view(off, (M, K), np.float16 if kind == "F16" else F32))
        if ids is not None:
            w = ops.gather(w, ids, 0)
        return ops.convert(w, F32)

    def wq_rows(self, ref, M: int, K: int, ids) -> ov.Node:
        """A block-format weight [M, K] as graph inputs over the arena, dequantized in the graph;
        ids [B]: only those rows (an embedding's gather before the dequantization) -> [B, K]."""
        _, fmt, qs, dm, qh = ref
        f = FORMATS[fmt]
        nb, g, words = K // QK, f.group, max(0, f.bits - 4)
        parts = [self.weight(f"q{qs}", self.view(qs, (M * K // 2,), np.uint8), ov.Type.u4, [M, nb, QK]),
                 self.weight(f"d{dm}", self.view(dm, (M, K // g, 2), np.float16 if f.scale == "f16" else F32))]
        if f.bits == 8:            # the high nibbles, sequential like the low ones
            parts.append(self.weight(f"h{qh}", self.view(qh, (M * K // 2,), np.uint8), ov.Type.u4, [M, nb, QK]))
        elif f.hb:                 # one u32 of bits per block and bit, lane j's at bit j
            parts.append(self.weight(f"h{qh}", self.view(qh, (M, nb, words, 4, 1), np.uint8)))
        rows = M
        if ids is not None:
            parts, rows = [ops.gather(p, ids, 0) for p in parts], self.B
        q, pairs = ops.convert(parts[0], F32), ops.convert(parts[1], F32)
        if f.bits == 8:
            q = ops.add(q, ops.multiply(ops.convert(parts[2], F32), f32(16.0)))
        elif f.hb:
            bits = ops15.bitwise_and(ops15.bitwise_right_shift(
                parts[2], ops.constant(np.arange(8, dtype=np.uint8).reshape(1, 1, 1, 1, 8))),
                ops.constant(np.uint8(1)))                                      # [rows, nb, words, 4, 8]
            bits = ops.convert(ops.reshape(bits, np.array([rows, nb, words, QK], np.int64), False), F32)
            lanes = ops.reduce_sum(ops.multiply(bits, f32((2.0 ** np.arange(words)).reshape(1, 1, words, 1))),
                                   np.array([2], np.int64), False)             # [rows, nb, 32] lanes
            high = ops.transpose(ops.reshape(lanes, np.array([rows, nb, 2, 16], np.int64), False),
                                 np.array([0, 1, 3, 2], np.int64))             # lane -> weight order
            q = ops.add(q, ops.multiply(ops.reshape(high, np.array([rows, nb, QK], np.int64), False), f32(16.0)))
        q = ops.reshape(q, np.array([rows, K // g, g], np.int64), False)
        dd = ops.gather(pairs, np.array([0], np.int64), 2)
        mm = ops.gather(pairs, np.array([1], np.int64), 2)
        return ops.reshape(ops.add(ops.multiply(q, dd), mm), np.array([rows, K], np.int64), False)

    def w8_rows(self, ref, V: int, D: int):
        """Q8_0 [V, D] as inputs (qs i8 [V, D/32, 32], d f16 [V, D/32, 1]), for row gathers."""
        _, qs, d = ref
        return (self.weight(f"q{qs}", self.view(qs, (V, D // QK, QK), np.int8)),
                self.weight(f"d{d}", self.view(d, (V, D // QK, 1), np.float16)))

    def w8_const(self, ref, V: int, D: int):
        """Q8_0 [V, D] as Constants over the arena: the lm-head multiplies the whole table each
        step, and only the compressed-FullyConnected pattern keeps that from materialising a
        float table per run (so this one weight is copied into its compiled graph, ~65 MB)."""
        _, qs, d = ref
        q = ov.op.Constant(ov.Tensor(self.view(qs, (V, D // QK, QK), np.int8)), shared_memory=True)
        s = ov.op.Constant(ov.Tensor(self.view(d, (V, D // QK, 1), np.float16)), shared_memory=True)
        return q, s


# 2^(e - 25) for an f16 exponent field e (a table: exact, where a pow kernel may round)
_HALF_SCALE = (2.0 ** (np.arange(32) - 25)).astype(F32)


def half_bits(raw: ov.Output, cols: int) -> ov.Node:
    """f16 values from their little-endian bytes u8 [T, 2 cols] -> f32 [T, cols], exactly, for
    finite values: (-1)^s (1024 + m) 2^(e - 25), or m 2^-24 where e = 0 (subnormal). In float
    arithmetic: the CPU plugin's integer bitwise ops are slow (measured 2-3x the attention)."""
    lo, hi = (ops.reshape(x, np.array([-1, cols], np.int64), False) for x in ops.split(
        ops.convert(ops.reshape(raw, np.array([-1, cols, 2], np.int64), False), F32),
        np.int64(2), 2).outputs())
    neg = ops.greater_equal(hi, f32(128.0))
    h = ops.select(neg, ops.subtract(hi, f32(128.0)), hi)                  # e * 4 + m's top 2 bits
    e = ops.floor(ops.multiply(h, f32(0.25)))
    m = ops.add(ops.multiply(ops.subtract(h, ops.multiply(e, f32(4.0))), f32(256.0)), lo)
    scale = ops.gather(ops.constant(_HALF_SCALE), ops.convert(e, np.int32), 0)
    mag = ops.select(ops.equal(e, f32(0.0)), ops.multiply(m, f32(2.0 ** -24)),
                     ops.multiply(ops.add(m, f32(1024.0)), scale))
    return ops.select(neg, ops.negative(mag), mag)


# -- ops: one builder per op, (graph, task args) -> writes its output -----------------------------
def _embed(g: Graph, a):
    ids = g.read(a["ids"], None, np.int32)                                  # [B]
    if a["table"][0] != "w8":          # a block format: the B rows' blocks, dequantized
        rows = (g.wt_rows if a["table"][0] == "wt" else g.wq_rows)(a["table"], a["V"], a["D"], ids)
    else:
        q, d = g.w8_rows(a["table"], a["V"], a["D"])
        rows = ops.multiply(ops.convert(ops.gather(q, ids, 0), F32),
                            ops.convert(ops.gather(d, ids, 0), F32))       # only the B rows
    rows = ops.reshape(rows, np.array([g.B, a["D"]], np.int64), False)
    g.write(a["out"], ops.multiply(rows, f32(a["scale"])) if "scale" in a else rows)


def _rmsnorm(g: Graph, a):
    heads, D = a.get("heads", 1), a["D"]
    x = g.read(a["x"], heads * D)
    if heads > 1:                       # per-head norms (Qwen3's Q/K): [B, heads, D]
        x = ops.reshape(x, np.array([g.B, heads, D], np.int64), False)
    ms = ops.reduce_mean(ops.multiply(x, x), np.array([-1], np.int64), True)
    r = ops.divide(f32(1.0), ops.sqrt(ops.add(ms, f32(a["eps"]))))
    y = ops.multiply(ops.multiply(x, r), g.wf(a["w"], D))
    if heads > 1:
        y = ops.reshape(y, np.array([g.B, heads * D], np.int64), False)
    g.write(a["out"], y)


def _linear(g: Graph, a):
    x = g.read(a["x"], a["K"])
    if a.get("ld", a["M"]) != a["M"]:      # a row-cut half: its columns of rows ld wide
        if a["out"][0] != "a":
            raise ValueError("a row-cut linear writes an activation slot, not the KV cache")
        g.ld[a["out"][1]] = a["ld"]
    y = ops.matmul(x, g.matrix(a["w"], a["M"], a["K"]), False, True)
    if "b" in a:                           # a bias [M] (Qwen2's q, k, v)
        y = ops.add(y, g.wf(a["b"], a["M"]))
    g.write(a["out"], y, a.get("rows"))    # rows: V of a paged step, to its KV rows


def _rope(g: Graph, a):
    """Interleaved pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s) as x*[c, c] + swap(x)*[-s, s]:
    the swap is a Gather on the pair axis, so no [B, H*hd] Concat runs (the CPU plugin's Concat
    here is a reference kernel: measured 3-5 ms of a 10 ms layer head at 512 rows)."""
    H, hd, B = a["heads"], a["head_dim"], g.B
    # NORM pairs (2i, 2i+1) on the last axis of [B, H, hd/2, 2]; NEOX pairs (i, i + hd/2) on
    # axis 2 of [B, H, 2, hd/2]
    pair, shape = (2, [B, H, 2, hd // 2]) if a.get("neox") else (3, [B, H, hd // 2, 2])
    x = ops.reshape(g.read(a["x"], H * hd), np.array(shape, np.int64), False)
    inv = F32(a["theta"]) ** (-np.arange(0, hd, 2, dtype=F32) / F32(hd))         # [hd/2]
    if "f" in a:                        # Llama 3.1's divisors: read-only weights, so constants
        inv = inv / g.view(a["f"][1], (hd // 2,), F32)
    if "pos" in a:                      # a paged step: each row's own position
        pos = ops.convert(g.read(a["pos"], None, np.int32), F32)
    else:
        pos = ops.convert(ops.add(g.rows, g.pos0), F32)                          # [B]
    ang = ops.unsqueeze(ops.multiply(ops.unsqueeze(pos, 1), f32(inv[None])),
                        np.array([1, pair], np.int64))                            # [B, 1, ., .]
    c, s = ops.cos(ang), ops.sin(ang)
    cc, ss = ops.concat([c, c], pair), ops.concat([ops.negative(s), s], pair)
    swap = ops.gather(x, np.array([1, 0], np.int64), pair)                      # (x1, x0)
    y = ops.add(ops.multiply(x, cc), ops.multiply(swap, ss))
    g.write(a["out"], ops.reshape(y, np.array([B, H * hd], np.int64), False), a.get("rows"))


def kv_from_cache(tasks) -> bool:
    """Does an attention in `tasks` read this step's K or V rows from the cache (written by another
    segment or processor) rather than from the task that computes them in the same graph? Then its
    graph must read the cache up to row pos0+B, not only the pos0 rows before the step."""
    written = set()
    for op, a in tasks:
        if op == "attention" and not {tuple(a["k"]), tuple(a["v"])} <= written:
            return True
        written.add(tuple(a["out"]))
    return False


def _attention(g: Graph, a):
    """Causal GQA attention over the first kv_len rows of the cache (a KV-length bucket,
    Transformer-Lite §2.1: rows past pos0+i are masked, so the padding costs compute, not results).
    Two forms, one softmax each, no concatenated cache (Transformer-Lite §2.3):
      fused   this step's K/V come from the graph: keys 0..pos0 from the cache masked j < pos0
              (absent when kv_len is 0), this step's keys from the graph, causal within the step;
      cached  this step's K/V were written to the cache before: keys 0..kv_len masked j <= pos0+i.
    A sliding-window layer (window w) also masks the keys j <= pos0+i-w."""
    H, KVH, hd, B, T = a["heads"], a["kv_heads"], a["head_dim"], g.B, g.kv_len
    win = a.get("window", 0)
    grp = H // KVH
    q = ops.multiply(g.read(a["q"], H * hd), f32(1.0 / np.sqrt(hd)))
    if g.per_row:        # paged, a decode batch: every row its own sequence and position
        return _attention_rows(g, a, q)
    if "btab" in a and T == 0 and a["k"][1] in g.kv_new and a["v"][1] in g.kv_new:
        # paged, a prompt's first chunk as one graph (npu.py whole_graph): no key before it, its
        # own K/V from the graph (fused; their blocks are written as results, ov_segment.py)
        (k_cache, k_new), (v_cache, v_new) = g.kv(a["k"], KVH * hd), g.kv(a["v"], KVH * hd)
    elif "btab" in a:    # paged (a prefill chunk of one sequence): rows through its block table
        if T == 0 or a["k"][1] in g.kv_new or a["v"][1] in g.kv_new:
            raise ValueError("a paged attention reads this step's K/V from the cache")
        (k_cache, k_new), (v_cache, v_new) = [(g.kv_paged(a[x], KVH * hd, a), None) for x in "kv"]
    else:
        k_cache, k_new = g.kv(a["k"], KVH * hd)
        v_cache, v_new = g.kv(a["v"], KVH * hd)
    # q [B, H*hd] -> [KVH, grp*B, hd]: head h reads kv head h // grp (GQA); row r = g*B + i
    qh = ops.reshape(ops.transpose(ops.reshape(q, np.array([B, KVH, grp, hd], np.int64), False),
                                   np.array([1, 2, 0, 3], np.int64)),
                     np.array([KVH, grp * B, hd], np.int64), False)

    def heads(x, rows):  # [rows, KVH*hd] -> [KVH, rows, hd]
        return ops.transpose(ops.reshape(x, np.array([rows, KVH, hd], np.int64), False),
                             np.array([1, 0, 2], np.int64))

    neg = f32(-np.inf)
    cols = ops.constant(np.arange(T, dtype=np.int64))                                   # [T]
    if k_new is None and v_new is None:                                                   # cached
        last = ops.add(ops.constant(np.tile(np.arange(B, dtype=np.int64), grp)), g.pos0)  # [grp*B]
        mask = ops.less_equal(cols, ops.unsqueeze(last, 1))                               # [grp*B, T]
        if win:
            mask = ops.logical_and(mask, ops.greater(cols, ops.unsqueeze(ops.subtract(last, np.int64(win)), 1)))
        s = ops.select(mask, ops.matmul(qh, heads(k_cache, T), False, True), neg)
        o = ops.matmul(ops.softmax(s, 2), heads(v_cache, T), False, False)     # [KVH, grp*B, hd]
    else:                                                                                  # fused
        at_step = ops.add(g.rows, g.pos0)
        k_new = k_new if k_new is not None else ops.gather(k_cache, at_step, 0).output(0)
        v_new = v_new if v_new is not None else ops.gather(v_cache, at_step, 0).output(0)
        causal = g.mask(("causal", B, grp, win), lambda: np.tile(visible(np.arange(B), B, win), (grp, 1)))
        if T == 0 and B >= 2 * CAUSAL_BLOCK:
            o = _causal_blocks(g, qh, heads(k_new, B), heads(v_new, B), KVH, grp, B, hd, win)
        elif T == 0:
            s_new = ops.select(causal, ops.matmul(qh, heads(k_new, B), False, True), neg)
            o = ops.matmul(ops.softmax(s_new, 2), heads(v_new, B), False, False)
        else:
            s_new = ops.select(causal, ops.matmul(qh, heads(k_new, B), False, True), neg)
            past = ops.less(cols, g.pos0)                                                  # [T]
            if win:                                          # [grp*B, T]: j > pos0 + i - win
                first = ops.add(ops.constant(np.tile(np.arange(B, dtype=np.int64) - win, grp)), g.pos0)
                past = ops.logical_and(past, ops.greater(cols, ops.unsqueeze(first, 1)))
            s_past = ops.select(past, ops.matmul(qh, heads(k_cache, T), False, True), neg)
            p = ops.softmax(ops.concat([s_past, s_new], 2), 2)                 # [KVH, grp*B, T+B]
            p_past, p_new = ops.variadic_split(p, np.int64(2), np.array([T, B], np.int64)).outputs()
            o = ops.add(ops.matmul(p_past, heads(v_cache, T), False, False),
                        ops.matmul(p_new, heads(v_new, B), False, False))      # [KVH, grp*B, hd]
    o = ops.transpose(ops.reshape(o, np.array([KVH, grp, B, hd], np.int64), False),
                      np.array([2, 0, 1, 3], np.int64))
    g.write(a["out"], ops.reshape(o, np.array([B, H * hd], np.int64), False))


def _attention_rows(g: Graph, a, q):
    """A paged decode batch: row i (sequence seq[i] at position pos[i]) attends to its own
    sequence's keys 0 .. pos[i] (a window: the last `window` of them), gathered through its block
    table, kv_len keys per row (the bucket of the step's largest position, npu/segment.py).
    q [B, H*hd], scaled. Padding rows (pos, seq zeroed where they enter) see key 0 of sequence
    0, and their output is zeroed: finite whatever the region holds."""
    H, KVH, hd, B, T = a["heads"], a["kv_heads"], a["head_dim"], g.B, g.kv_len
    win, grp = a.get("window", 0), H // KVH
    if T == 0 or a["k"][1] in g.kv_new or a["v"][1] in g.kv_new:
        raise ValueError("a paged attention reads this step's K/V from the cache")

    def heads(x):        # [B, T, KVH*hd] -> [B, KVH, T, hd]
        return ops.transpose(ops.reshape(x, np.array([B, T, KVH, hd], np.int64), False),
                             np.array([0, 2, 1, 3], np.int64))
    k, v = (heads(g.kv_batch(a[x], KVH * hd, a)) for x in "kv")
    qh = ops.reshape(q, np.array([B, KVH, grp, hd], np.int64), False)     # head h: kv head h // grp
    pos = ops.unsqueeze(ops.convert(g.read(a["pos"], None, np.int32), np.int64), 1)     # [B, 1]
    cols = ops.constant(np.arange(T, dtype=np.int64)[None])                              # [1, T]
    mask = ops.less_equal(cols, pos)                                                     # [B, T]
    if win:
        mask = ops.logical_and(mask, ops.greater(cols, ops.subtract(pos, np.int64(win))))
    mask = ops.reshape(mask, np.array([B, 1, 1, T], np.int64), False)
    s = ops.select(mask, ops.matmul(qh, k, False, True), f32(-np.inf))          # [B, KVH, grp, T]
    o = ops.matmul(ops.softmax(s, 3), v, False, False)                          # [B, KVH, grp, hd]
    o = ops.reshape(o, np.array([B, H * hd], np.int64), False)
    g.write(a["out"], ops.select(ops.unsqueeze(g.valid, 1), o, f32(0.0)))


CAUSAL_BLOCK = 128   # query rows per block of a prompt's first chunk (_causal_blocks)


def _causal_blocks(g: Graph, qh, kh, vh, KVH: int, grp: int, B: int, hd: int, win: int = 0):
    """Causal attention of a chunk at pos0 = 0, query rows in blocks of CAUSAL_BLOCK: block i
    attends to keys 0..(i+1)*CAUSAL_BLOCK only, so the masked upper triangle is mostly never
    computed (4 blocks: 10/16 of the work; 8: 36/64).
    qh [KVH, grp*B, hd] (row g*B + i), kh, vh [KVH, B, hd] -> [KVH, grp*B, hd]."""
    c = CAUSAL_BLOCK
    q4 = ops.reshape(qh, np.array([KVH, grp, B, hd], np.int64), False)

    def rows(x, axis, lo, hi):
        return ops.slice(x, np.array([lo], np.int64), np.array([hi], np.int64),
                         np.array([1], np.int64), np.array([axis], np.int64))
    outs = []
    for i in range(B // c):
        keys = (i + 1) * c
        qb = ops.reshape(rows(q4, 2, i * c, keys), np.array([KVH, grp * c, hd], np.int64), False)
        mask = g.mask(("block", c, i, grp, win), lambda: np.tile(                  # [grp*c, keys]
            visible(np.arange(i * c, keys), keys, win), (grp, 1)))
        s = ops.select(mask,
                       ops.matmul(qb, rows(kh, 1, 0, keys), False, True), f32(-np.inf))
        ob = ops.matmul(ops.softmax(s, 2), rows(vh, 1, 0, keys), False, False)     # [KVH, grp*c, hd]
        outs.append(ops.reshape(ob, np.array([KVH, grp, c, hd], np.int64), False))
    return ops.reshape(ops.concat(outs, 2), np.array([KVH, grp * B, hd], np.int64), False)


def _silu_mul(g: Graph, a):
    g.write(a["out"], ops.multiply(ops.swish(g.read(a["g"], a["F"])), g.read(a["u"], a["F"])))


def _gelu_mul(g: Graph, a):
    gelu = ops.gelu(g.read(a["g"], a["F"]), approximation_mode="tanh")
    g.write(a["out"], ops.multiply(gelu, g.read(a["u"], a["F"])))


def _add(g: Graph, a):
    g.write(a["out"], ops.add(g.read(a["a"], a["D"]), g.read(a["b"], a["D"])))


def _lm_head(g: Graph, a):
    """A chunk's logits [1, V] of row N-1; all_rows (a decode batch): every row's [B, V]."""
    D, V = a["D"], a["V"]
    last = g.read(a["x"], D)                                                 # [B, D]
    if not a.get("all_rows"):
        last = ops.gather(last, ops.subtract(g.n, np.int64(1)), 0)          # [1, D] row N-1
    if a["table"][0] != "w8":
        g.write(a["out"], ops.matmul(last, g.matrix(a["table"], V, D), False, True))
        return
    q, d = g.w8_const(a["table"], V, D)
    w = ops.multiply(ops.convert(q, F32), ops.convert(d, F32))   # compressed-FC pattern, i8
    w = ops.reshape(w, np.array([V, D], np.int64), False)
    g.write(a["out"], ops.matmul(last, w, False, True))                     # [1 or B, V]


BUILDERS = {"embed": _embed, "rmsnorm": _rmsnorm, "linear": _linear, "rope": _rope,
            "attention": _attention, "silu_mul": _silu_mul, "gelu_mul": _gelu_mul, "add": _add,
            "lm_head": _lm_head, **MOE_BUILDERS}
