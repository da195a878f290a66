"""One OpenVINO builder per op, (graph, task args) -> writes its output (`BUILDERS`), with
the semantics of actors/cpu/kernels.py; the MoE ops' builders are npu/moe.py's.
"""
from __future__ import annotations

import numpy as np
import openvino.opset13 as ops

from socllm.graph.ops import visible
from socllm.actors.npu.graph import F32, Graph, f32
from socllm.actors.npu.moe import MOE_BUILDERS


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
    y = g.linear(x, a["w"], a["M"], a["K"])
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
    if a.get("tmask"):               # a verifying step: draft tree rows see their entry's keys
        mask = ops.select(*_tree_keys(g, a, cols, win), mask)
    mask = ops.reshape(mask, np.array([B, 1, 1, T], np.int64), False)
    s = ops.select(mask, ops.matmul(qh, k, False, True), f32(-np.inf))          # [B, KVH, grp, T]
    o = ops.matmul(ops.softmax(s, 3), v, False, False)                          # [B, KVH, grp, hd]
    o = ops.reshape(o, np.array([B, H * hd], np.int64), False)
    g.write(a["out"], ops.select(ops.unsqueeze(g.valid, 1), o, f32(0.0)))


def _tree_keys(g: Graph, a, cols, win: int) -> tuple:
    """Draft tree rows (policies/drafting.py Tree; paged.cl tree_row, the GPU's form): a row's
    tree entry [L, base, mask_lo, mask_hi] makes it see keys 0 .. L-1 (a window: the last `win`
    of them) and key base + j for each bit j of the 64-bit mask (its ancestors and itself); a row
    whose mask is 0 is a plain decode row. -> ([B, 1] has an entry, [B, T] its keys). The bits
    are taken by integer division and remainder (the CPU plugin's bitwise ops are slow here)."""
    tm = ops.convert(g.read(a["tmask"], 4, np.int32), np.int64)                         # [B, 4]
    L, base, lo, hi = (ops.gather(tm, np.array([i], np.int64), 1) for i in range(4))    # [B, 1]
    lo, hi = (ops.select(ops.less(w, np.int64(0)), ops.add(w, np.int64(1 << 32)), w) for w in (lo, hi))
    has = ops.logical_or(ops.not_equal(lo, np.int64(0)), ops.not_equal(hi, np.int64(0)))
    dense = ops.less(cols, L)
    if win:
        dense = ops.logical_and(dense, ops.greater_equal(cols, ops.subtract(L, np.int64(win))))
    rel = ops.subtract(cols, base)                                                       # [B, T]
    pow2 = ops.constant(np.array([1 << j for j in range(32)], np.int64))

    def bit(word, lo_j):    # bit (rel - lo_j) of word where lo_j <= rel < lo_j + 32, else False
        j = ops.subtract(rel, np.int64(lo_j))
        inside = ops.logical_and(ops.greater_equal(j, np.int64(0)), ops.less(j, np.int64(32)))
        p = ops.gather(pow2, ops.clamp(j, 0, 31), 0)
        one = ops.equal(ops.floor_mod(ops.divide(word, p), np.int64(2)), np.int64(1))
        return ops.logical_and(inside, one)
    return has, ops.logical_or(dense, ops.logical_or(bit(lo, 0), bit(hi, 32)))


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
