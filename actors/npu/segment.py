"""The NPU actor's kernels: a segment (a run of consecutive tasks of a step program) compiled into
ONE static-shape OpenVINO graph per shape bucket, run over the pool's arena with zero copies.

NPU rules (DESIGN.md §1): every shape is static — B rows (the bucket), kv_len rows of the KV cache
(a KV-length bucket, policies/buckets.kv_bucket) — and the runtime values N and pos0 are graph
inputs, never shapes. A segment that reads the KV cache is compiled once per KV-length bucket it
meets, on first use (Transformer-Lite §2.1), so its attention costs O(pos0 + B), not O(capacity). Semantics are those of
actors/cpu/kernels.py op by op, computed for B rows: rows N..B are padding, zeroed where they
enter the graph (the arena may hold any bytes there) so every output stays finite, and written back
like the rest. So every slot the segment touches, and every KV cache from row pos0, must have room
for B rows.

Zero copies: weights are Parameters bound to arena views (u4 over the planar Q4_1 bytes,
dequantized in the graph), so no compiled model holds a copy of them, and segments that differ
only in their layer share one compiled graph. Only the lm-head table is a Constant (see
Graph.w8_const). Slots read before being written are Parameters over arena views; slots in
`live_out` and all KV writes are Results whose output tensors are arena views, so OpenVINO writes
straight into the pool. KV rows go to rows pos0..pos0+B of the cache, rebound each run
(Transformer-Lite §2.3: in place, no concatenation); a paged step's go to its rows' KV rows: a
prefill chunk's through a stage, copied a run of blocks at a time, a decode batch's a row at a
time in place (per_row).
"""
from __future__ import annotations

import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from socllm.policies.buckets import kv_bucket

from socllm.actors.npu.graph import F32, Graph
from socllm.actors.npu.ops import BUILDERS, kv_from_cache


def pick_device(core: ov.Core) -> str:
    """The real NPU when there is one; else OpenVINO's CPU, kept under the same NPU rules."""
    return "NPU" if "NPU" in core.available_devices else "CPU"


def signature(tasks, live_out, const_weights=False) -> tuple:
    """What a segment's compiled graph depends on: its ops, sizes and slot pattern — not which
    weights or which layer's KV cache it reads (those are inputs bound per segment)."""
    names: dict = {}

    inputs = ("kv", "w8", "wf", "wt") if const_weights else ("kv", "w4", "wq", "wt", "w8", "wf")

    def ab(v):
        if isinstance(v, tuple) and v[0] in inputs:      # a block format's graph is its own
            return names.setdefault(v, (*v[:2 if v[0] in ("wq", "wt") else 1], len(names)))
        return v
    sig = tuple((op, tuple(sorted((k, ab(v)) for k, v in args.items()))) for op, args in tasks)
    live = tuple(sorted(str(ab(("kv", o))) if ("kv", o) in names else str(o) for o in live_out))
    return sig, live


class OVSegment:
    """One segment compiled for one bucket of B rows; `run(N, pos0)` infers in place over the arena.

    tasks        [(op, args)] in execution order, args as in graph/program.py
    live_out     arena offsets another processor or a later segment reads: only these slots
                 (their latest value) are written back; KV writes always are
    kv_cap_rows  rows of every KV cache in the pool: the largest KV-length bucket
    last_row     the segment is row-wise ops ending in the lm-head: compile it for one row and run
                 it on row N-1 (one compiled lm-head serves every bucket)
    const_weights  Q4_1 weights as Constants (compressed FullyConnected) instead of graph inputs:
                 faster for one-row decode steps, at a weight copy per compiled graph
    shared       a dict key -> compiled graph, kept by the caller: segments with the same
                 signature, bucket and KV length (the layers of a prefill) reuse one compiled
                 graph, each with its own bound tensors (its weights, its layer's cache)
    per_row      a paged decode batch (graph/build.py all_rows): row i of sequence seq[i] at
                 position pos[i], its K/V written to KV row rows[i] alone, its attention over
                 its own sequence's rows; the KV-length bucket is that of the step's largest
                 position (read from the pool's row metadata at run time, not pos0)

    A segment without attention has one compiled graph. One with attention compiles the
    KV-length bucket of pos0 = 0 here, ahead of use, and every other one the first time a step
    needs it (`compile_s` counts both; CACHE_DIR makes a later process import instead): a fixed
    set would be (capacity / KV_STEP) graphs per bucket and signature, most never used.
    """

    def __init__(self, core: ov.Core, tasks, arena: np.ndarray, bucket: int, live_out: set[int],
                 kv_cap_rows: int, precision: str = "f32", config: dict | None = None,
                 cache_dir: str | None = None, shared: dict | None = None, last_row: bool = False,
                 const_weights: bool = False, pool: dict | None = None, per_row: bool = False):
        self.last_row = last_row
        if last_row:
            if [op for op, _ in tasks][-1] != "lm_head" or any(op not in ("rmsnorm", "add", "lm_head") for op, _ in tasks):
                raise ValueError("last_row segments hold row-wise ops ending in the lm-head")
            bucket = 1
        self.arena, self.bucket, self.kv_cap = arena, bucket, kv_cap_rows
        self.tasks, self.live_out, self.const = tasks, live_out, const_weights
        self.core, self.precision, self.config, self.cache_dir = core, precision, config, cache_dir
        self.shared_graphs = {} if shared is None else shared
        self._uses_kv = any(op == "attention" for op, _ in tasks)
        # pool: {"kv_dtype", "kv_rows", "max_seqs", "block_rows"} (ov_build.Graph). A paged step
        # (a serving prefill chunk or decode batch: rows through block tables) reads at most its
        # real rows' positions, and writes its K/V rows block by block, or row by row (_Variant.run)
        self.pool = pool
        self._paged = any("btab" in args or "rows" in args for _, args in tasks)
        # a chunk's K/V rows go a block at a time, a batch's row by row (_Variant)
        if self._paged and (pool is None or bucket % pool["block_rows"] and not per_row):
            raise ValueError("a paged NPU graph needs the pool's blocks and a bucket of whole blocks")
        self.per_row = per_row = per_row and self._paged    # a graph without KV rows: as any
        # a batch's attention: the io offset of its rows' positions (the KV-length bucket, run)
        self._pos_off = next((args["pos"][1] for op, args in tasks if op == "attention"), None) \
            if per_row else None
        self._tm_off = next((args["tmask"][1] for op, args in tasks if op == "attention"
                             and args.get("tmask")), None) if per_row else None
        self._step_rows = kv_from_cache(tasks)   # the step's own K/V rows are read from the cache
        self.variants: dict = {}                 # kv_len -> _Variant (None: no attention)
        self.compile_s = 0.0
        first = self._variant(0, 1 if per_row else None) if self._uses_kv else self._build(None)
        self.shared, self.compiled = first.shared, first.compiled

    later_chunk = False     # a chunk's per-layer segment past a prompt's start (npu/backend.py)

    def prepare(self, pos0: int) -> bool:
        """The graph a step at pos0 reads, compiled now if it is not yet (a later chunk's
        KV-length bucket, at start rather than inside a request). True where one was."""
        if not self._uses_kv or self.kv_len(pos0) in self.variants:
            return False
        self._variant(pos0)
        return True

    def kv_len(self, pos0: int) -> int:
        """The KV-length bucket a step at pos0 reads: the pos0 earlier rows, plus this step's B
        rows when they come from the cache."""
        rows = pos0 + (self.bucket if self._step_rows else 0)
        return kv_bucket(min(rows, self.kv_cap) if self._paged else rows, self.kv_cap)

    def _variant(self, pos0: int, rows: int | None = None) -> "_Variant":
        """rows: a batch's KV rows (its largest position + 1), instead of those of pos0."""
        kv_len = self.kv_len(pos0) if rows is None else kv_bucket(rows, self.kv_cap)
        v = self.variants.get(kv_len)
        return v if v is not None else self._build(kv_len)

    def _build(self, kv_len: int | None) -> "_Variant":
        g = Graph(self.arena, self.bucket, kv_len or 0, self.const, self.pool, self.per_row,
                  split_min=bool((self.config or {}).get("DYNAMIC_QUANTIZATION_GROUP_SIZE")))
        for i, (op, args) in enumerate(self.tasks):
            g.begin(i)
            BUILDERS[op](g, args)
        v = _Variant(self, g, kv_len)
        self.variants[kv_len] = v
        self.compiled = v.compiled
        return v

    def run(self, N: int, pos0: int):
        if self.last_row:
            return self.variants[None].run_last_row(N, pos0)
        B = self.bucket
        rows = self._batch_rows(N) if self._pos_off is not None and 0 < N <= B else None
        need = pos0 + (N if self._paged else B) if rows is None else rows
        if not 0 < N <= B or (self._uses_kv and need > self.kv_cap):
            raise ValueError(f"N={N}, pos0={pos0} do not fit bucket {B}, KV capacity {self.kv_cap}")
        v = self._variant(pos0, rows) if self._uses_kv else self.variants[None]
        v.run(N, pos0)

    def _batch_rows(self, N: int) -> int:
        """The KV rows a decode batch's attention reads: its largest position + 1 (the runner's
        pos0 is 0 for a batch of several rows: it is not the rows' own), or past a draft tree
        row's highest key (its entry's base + the mask's highest bit)."""
        top = int(self.arena[self._pos_off: self._pos_off + 4 * N].view(np.int32).max()) + 1
        if self._tm_off is not None:
            tm = self.arena[self._tm_off: self._tm_off + 16 * N].view(np.int32).reshape(N, 4)
            for L, base, lo, hi in tm[(tm[:, 2] != 0) | (tm[:, 3] != 0)].tolist():   # tree rows
                mask = (lo & 0xFFFFFFFF) | (hi & 0xFFFFFFFF) << 32
                top = max(top, L, base + mask.bit_length())
        return top


class _Variant:
    """A segment's graph for one KV length: compiled (or shared), with this segment's pool tensors."""

    def __init__(self, seg: OVSegment, g: Graph, kv_len: int | None):
        self.arena, self.bucket = seg.arena, g.B
        self._at, self._copies, self._kv_outs = [], [], []  # (result index, view | off, cols)
        results = []
        for off, (val, deps, is_input) in g.vals.items():
            if off in seg.live_out and not is_input:
                # A reader of the slot's arena version that the final writer does not wait for may
                # run after OpenVINO wrote the result in place (measured: it does): copy it after.
                racy = bool(g.input_readers.get(off, set()) - deps)
                view = g.view(off, tuple(val.get_shape()), F32, g.ld.get(off))
                racy |= not view.flags.c_contiguous      # OpenVINO writes dense tensors only
                (self._copies if racy else self._at).append((len(results), view))
                results.append(ops.result(val))
        self._kv_pieces = []      # paged K/V writes: (first result, off, cols, rows' io offset)
        # a chunk's K/V is one result (staged, then copied to its blocks); a batch's, one result
        # per row (each of its own sequence), bound to its KV row
        self.per_row = seg.per_row
        self.block_rows = 1 if seg.per_row else (seg.pool or {}).get("block_rows")
        for off, (val, _) in g.kv_new.items():
            cols = val.get_shape()[1]
            if off in g.kv_at_rows:
                val = ops.convert(val, g.kv_type) if g.kv_type != F32 else val
                self._kv_pieces.append((len(results), off, cols, g.kv_at_rows[off]))
                if self.per_row:
                    results += [ops.result(p) for p in ops.split(val, np.int64(0), g.B).outputs()]
                else:         # a chunk's rows: staged whole, then copied to their blocks (run)
                    results.append(ops.result(val))
                continue
            self._kv_outs.append((len(results), off, cols))
            results.append(ops.result(val))
        if self._kv_pieces:
            self.kv_esize, self.kv_rows = np.dtype(g.kv_type).itemsize, seg.pool["kv_rows"]
            self._spare = {c: np.empty((1, c), g.kv_type)          # where a batch's padding
                           for _, _, c, _ in self._kv_pieces}       # rows' K/V goes
        config = tuple(sorted((seg.config or {}).items()))
        # a batch's graph and a chunk's of one bucket have the same tasks, not the same graph
        key = (signature(seg.tasks, seg.live_out, seg.const), g.B, kv_len, seg.precision, config,
               seg.per_row)
        self.shared = key in seg.shared_graphs
        if not self.shared:
            model = ov.Model(results, g.params, "segment")
            for i, node in enumerate(model.get_ordered_ops()):  # stable names: CACHE_DIR hashes them
                node.set_friendly_name(f"n{i}")
            for i, r in enumerate(results):
                r.output(0).get_tensor().set_names({f"out{i}"})
            compiled, seconds = _compile(seg.core, model, seg.precision, seg.config, seg.cache_dir)
            seg.compile_s += seconds
            # one infer request per compiled graph: a request owns the graph's intermediate memory,
            # so segments sharing a graph share it too (measured: a request per layer cost ~25 MB each)
            seg.shared_graphs[key] = {"compiled": compiled, "req": compiled.create_infer_request(),
                                      "owner": None}
        self._slot = seg.shared_graphs[key]
        self.compiled, self._req = self._slot["compiled"], self._slot["req"]
        self._pos0, self._n = np.zeros(1, np.int64), np.zeros(1, np.int64)  # read at each infer
        self._act_inputs = g.act_inputs
        self._inputs = [view if isinstance(view, ov.Tensor) else ov.Tensor(view, shared_memory=True)
                        for view in [self._pos0, self._n] + g.inputs[2:]]
        self._outputs = [(i, ov.Tensor(view, shared_memory=True)) for i, view in self._at]
        if self._kv_pieces and not self.per_row:
            # a chunk's K/V rows [B, cols] land in a stage every segment of the graph shares (they
            # run one at a time); 1,920 results bound block by block cost ~35 ms a 512-row chunk
            self._stage = self._slot.setdefault("stage", {
                first: np.empty((g.B, cols), g.kv_type) for first, _, cols, _ in self._kv_pieces})
            self._outputs += [(first, ov.Tensor(a, shared_memory=True))
                              for first, a in self._stage.items()]

    def _own_request(self):
        """Bind this segment's pool tensors to the shared request (skipped when already bound)."""
        if self._slot["owner"] is self:
            return
        for i, t in enumerate(self._inputs):
            self._req.set_input_tensor(i, t)
        for i, t in self._outputs:
            self._req.set_output_tensor(i, t)
        self._slot["owner"] = self

    def run(self, N: int, pos0: int):
        B = self.bucket
        self._own_request()
        self._pos0[0], self._n[0] = pos0, N
        for i, off, cols in self._kv_outs:  # this step's rows of the cache, in place
            view = self.arena[off + pos0 * cols * 4: off + (pos0 + B) * cols * 4].view(F32)
            self._req.set_output_tensor(i, ov.Tensor(view.reshape(B, cols), shared_memory=True))
        if self._kv_pieces and self.per_row:
            self._bind_rows(N)
        self._req.infer()
        if self._kv_pieces and not self.per_row:
            self._scatter_blocks(N)
        for i, dst in self._copies:
            np.copyto(dst, self._req.get_output_tensor(i).data)

    def _scatter_blocks(self, N: int):
        """A paged chunk's K/V rows, staged whole by the graph, go to their blocks: one copy per
        run of consecutive KV rows (a fresh sequence's blocks are mostly consecutive). Padding
        rows stay in the stage, so they never touch a real sequence's cache."""
        esize, runs = self.kv_esize, None
        for first, off, cols, rows_off in self._kv_pieces:
            if runs is None:                       # every layer's rows are the step's rows
                runs = _block_runs(self.arena[rows_off: rows_off + 4 * N].view(np.int32),
                                   self.block_rows, self.kv_rows)
            stage = self._stage[first]
            for lo, start, n in runs:
                dst = self.arena[off + start * cols * esize: off + (start + n) * cols * esize]
                np.copyto(dst.view(stage.dtype).reshape(n, cols), stage[lo: lo + n])

    def _bind_rows(self, N: int):
        """A decode batch's K/V rows go to their KV rows in place: result piece i (row i, of its
        own sequence) to KV row rows[i]; padding rows' pieces only go to a spare row, so they
        never touch a real sequence's cache."""
        esize = self.kv_esize
        for first, off, cols, rows_off in self._kv_pieces:
            rows, dtype = self.arena[rows_off: rows_off + 4 * N].view(np.int32), self._spare[cols].dtype
            for i in range(self.bucket):
                if i >= N:
                    view = self._spare[cols]
                elif not 0 <= rows[i] < self.kv_rows:
                    raise ValueError(f"KV row {rows[i]} is outside the region's {self.kv_rows}")
                else:
                    at = off + int(rows[i]) * cols * esize
                    view = self.arena[at: at + cols * esize].view(dtype).reshape(1, cols)
                self._req.set_output_tensor(first + i, ov.Tensor(view, shared_memory=True))

    def run_last_row(self, N: int, pos0: int):
        """A row-wise tail ending in the lm-head (final norm, logits) needs row N-1 only: it is
        compiled for one row and reads that row of its inputs, whatever the step's bucket."""
        self._own_request()
        for i, off, cols, dtype in self._act_inputs:
            size = np.dtype(dtype).itemsize * cols
            view = self.arena[off + (N - 1) * size: off + N * size].view(dtype).reshape(1, cols)
            self._req.set_input_tensor(i, ov.Tensor(view, shared_memory=True))
        self._slot["owner"] = None          # the inputs above are this run's only
        self._pos0[0], self._n[0] = pos0 + N - 1, 1
        self._req.infer()
        for i, dst in self._copies:
            np.copyto(dst, self._req.get_output_tensor(i).data)


def _compile_props(core, precision, config) -> dict:
    """The compile properties of a graph at this precision (config: the backend's knobs), those
    the device supports."""
    supported = core.get_property(pick_device(core), "SUPPORTED_PROPERTIES")
    props = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
             "NUM_STREAMS": 1, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, **(config or {})}
    return {k: v for k, v in props.items() if k in supported}


def _compile(core, model, precision, config, cache_dir) -> tuple:
    """-> (compiled model, seconds). Dynamic quantization (int8 activations per group) only when
    the caller's config asks for it (a q8 whole-model prefill graph: policies/buckets.py
    NPU_PREFILL_ACT)."""
    device = pick_device(core)
    props = _compile_props(core, precision, config)
    if cache_dir:
        props["CACHE_DIR"] = cache_dir
    t = time.perf_counter()
    compiled = core.compile_model(model, device, props)
    return compiled, time.perf_counter() - t


def _block_runs(rows: np.ndarray, block_rows: int, kv_rows: int) -> list:
    """A chunk's KV rows [N] -> [[first row of the chunk, first KV row, rows]], one per run of
    consecutive KV rows. Every block must start at a block boundary and run on within it."""
    N = len(rows)
    runs = []
    for lo in range(0, N, block_rows):
        start, n = int(rows[lo]), min(block_rows, N - lo)
        if start % block_rows or rows[lo + n - 1] != start + n - 1:
            raise ValueError("an NPU chunk's rows must start a block and fill it in order")
        if not 0 <= start <= kv_rows - n:
            raise ValueError(f"KV rows {start}..{start + n} are outside the region's {kv_rows}")
        if runs and runs[-1][1] + runs[-1][2] == start:
            runs[-1][2] += n
        else:
            runs.append([lo, start, n])
    return runs
