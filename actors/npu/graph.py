"""Building an OpenVINO graph from socllm tasks: SSA over arena offsets (`Graph`): the
activations a segment reads and writes, and the KV cache it reads (whole, or a paged step's rows
through its block tables); its weights come from the Weights mixin (npu/weights.py), the op
builders from npu/ops.py. OVSegment (npu/segment.py) compiles and runs what these build.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from socllm.actors.npu.weights import F32, Weights, f32
from socllm.memory.arena import strided_rows


class Graph(Weights):
    """SSA over arena offsets while a segment is built: a slot may be written several times (slots
    are reused across layers), so `vals` holds the latest in-graph value of each offset."""

    def __init__(self, arena: np.ndarray, B: int, kv_len: int, const_weights: bool = False,
                 pool: dict | None = None, per_row: bool = False, split_min: bool = False):
        """split_min: Q4_1 constants as Weights.linear splits them (a graph compiled with dynamic
        quantization). pool: {"kv_dtype", "kv_rows", "max_seqs"}, the KV region's element type, its rows per
        layer and the block tables' rows: a paged step's attention gathers its rows from the
        whole region through its sequence's block table. per_row: a paged decode batch, every
        row of its own sequence at its own position (kv_batch), not a chunk of one sequence."""
        self.arena, self.B, self.kv_len = arena, B, kv_len
        self.const_weights, self.per_row, self.split_min = const_weights, per_row, split_min
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


# 2^(e - 25) for an f16 exponent field e (a table: exact, where a pow kernel may round)
_HALF_SCALE = (2.0 ** (np.arange(32) - 25)).astype(F32)


def half_bits(raw: ov.Output, cols: int) -> ov.Node:
    """f16 values from their little-endian bytes u8 [T, 2 cols] -> f32 [T, cols], exactly, for
    finite values: (-1)^s (1024 + m) 2^(e - 25), or m 2^-24 where e = 0 (subnormal). In float
    arithmetic: the CPU plugin's integer bitwise ops are slow (measured 2-3x the attention). The
    bytes become one value u = lo + 256 hi through two Gathers of the pair, not a Split (which
    this plugin runs in its reference kernel); the rest is elementwise, one fused graph."""
    pairs = ops.convert(ops.reshape(raw, np.array([-1, cols, 2], np.int64), False), F32)
    lo, hi = (ops.gather(pairs, ops.constant(np.int32(i)), 2) for i in (0, 1))     # [T, cols]
    u = ops.add(lo, ops.multiply(hi, f32(256.0)))
    neg = ops.greater_equal(u, f32(32768.0))
    h = ops.select(neg, ops.subtract(u, f32(32768.0)), u)                 # e * 1024 + m
    e = ops.floor(ops.multiply(h, f32(1.0 / 1024)))
    m = ops.subtract(h, ops.multiply(e, f32(1024.0)))
    scale = ops.gather(ops.constant(_HALF_SCALE), ops.convert(e, np.int32), 0)
    mag = ops.select(ops.equal(e, f32(0.0)), ops.multiply(m, f32(2.0 ** -24)),
                     ops.multiply(ops.add(m, f32(1024.0)), scale))
    return ops.select(neg, ops.negative(mag), mag)
