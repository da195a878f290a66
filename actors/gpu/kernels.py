"""The GPU actor's kernels: OpenCL (pyopencl) over the pool's arena, with exactly the semantics of
kernels_numpy.NumpyKernels (their specification and test oracle), op for op. Source: cl/kernels.cl.

The whole arena is one cl.Buffer; kernels get byte offsets into it (DESIGN.md §3). Where the device
shares host memory (an iGPU, PoCL on the CPU) the buffer wraps the arena with CL_MEM_USE_HOST_PTR:
zero-copy, kernels read the weights and write the slots and the KV cache in the pool itself. A
discrete GPU gets a COPY_HOST_PTR buffer instead: one upload when it is wrapped, and then the caller
must copy outputs back (cl.enqueue_copy of the live-out byte ranges) before another processor
reads them, and copy in what other processors wrote.

Layout rules the kernels rely on (they load aligned vectors): the arena starts 64-byte aligned,
f32 tensors read as vectors start at multiples of 32 bytes (the pool's 64 is fine), quantized
weights at multiples of 16 (any row of one), K and D are multiples of 32 and head_dim of 8.
run() checks them and raises rather than fault.

Decode runs fused kernels instead (cl/decode.cl, launched by gpu/fused.py), whose GEMVs take the
activation row in f32, int16 or int8 (the f32, q16 and q8 precisions); those kernels are built into
the same program, once per activation format.

Threads: PoCL reads POCL_MAX_PTHREAD_COUNT when pyopencl first lists platforms; the actor sets it
from the machine's thread budget (DESIGN.md §6) before importing this module. Nothing here sets it.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from socllm.actors.gpu.device import Mirror, cl, discrete, tuning
from socllm.actors.gpu.launches import Replay
from socllm.actors.gpu.moe import MOE_SCALARS, MoELaunches
from socllm.graph.hcmp import PARTS
# a program's tensor refs as kernel arguments (re-exported: gpu/fused.py, gpu/e0m4.py import them here)
from socllm.actors.gpu.refs import (check_aligned, out_offset, prepared_row_bytes,  # noqa: F401
                                    round_up, weight_build)

from socllm.models.quant import QK

SRC = Path(__file__).parent / "cl" / "kernels.cl"
# appended to kernels.cl: the fused decode kernels, and the paged (serving) variants
DECODE_SRC = [SRC.with_name(f) for f in ("decode.cl", "epilogue.cl", "paged.cl", "batch.cl", "moe.cl")]
# A decode batch's (and a prefill chunk's) linears over prepared rows (q16, q8): Q4_1 / Q4_0 weights ("w4") with M a
# multiple of 8 and no bias run in weight tiles (linear_tile, cl/batch.cl), int8 at q8 and int16
# at q16, for any N > 1 (q16: while its rows, padded to whole tiles, fit the scratch). The 210
# linears of a SmolLM2-135M step (weights streaming from memory), 2 Zen 5 cores with AVX-512 VNNI,
# kernel ms, min of 7 (scripts/gpu_rows.py has whole steps):
#   rows                                   2      4      8     16
#   q16 int16 tiles                      2.86   3.38   4.85   7.91
#   q16 before them (int16 rows to 2,
#       then f32 GEMM)                   4.86   8.28  10.12  18.25
#   q16 int16 rows (linear_rows_act)     4.85   8.55  14.59  27.12
#   q8 int8 tiles                        4.55   3.87   7.15  10.59
#   (q8 on AVX512-VNNI: tiles of 16 weight rows, linear_tile16; measured in cl/batch.cl)
# Other weight formats, a bias or M not a multiple of 8 keep q16's paths from before the tiles:
# up to INT_ROWS_MAX rows in int16 (linear_rows_act), more in f32, whose dequantized weight block
# serves GEMM_TN rows: measured through the service on 2 cores (tok/s, integers vs f32): 2 rows
# 132 vs 94, 4 rows 141 vs 158, 8 rows 169 vs 192.
INT_ROWS_MAX = 2
TILE_ROWS = (4, 8, 16)      # activation rows a q8 linear_tile work-item may take (cl/batch.cl)
# every tn of cl/batch.cl's linear_tile_n<tn> kernels (LINEAR_TILES there): _tile_rows' choices
TILE_NS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
# q16 tiles: up to TILE16_MAX rows dealt evenly over the fewest tiles of at most TILE16_MAX
# (CLKernels._tile_rows); on a CPU, 9-15 rows in one tile of 12 or 16 (the rest padded: a tile's
# weights cost more than its rows), TILE16_WIDE rows or more (prefill chunks) in whole tiles of
# TILE16_WIDE, the last padded. One build per K holds a kernel per tn of TILE_NS; each kernel PoCL
# compiles costs the GPU actor memory once it runs (a tn for each of 9-15 rows: +8.8 MB PSS, 12
# and 16 only: +1.4 MB, warm kernel cache, Xeon VM). Measured there (gpu_rows --kernels, q16, one
# sequence): linears of 15 rows 27.6 ms in two tiles of 8 against 20.3 in one of 15; 8 rows in
# one tile 14.7-16.3, 12 rows 16.2-16.5, 16 rows 20.2 (the step of 15 rows: 38.8 -> 31.3 ms).
# Earlier, on 2 Zen 5 cores (AVX-512): 128-row prefill chunks 58.5-61.1 ms of kernels against
# 62.6-65.7 in tiles of 8. A GPU keeps tiles of at most 8 (not measured there). Those figures
# predate FMAV in the tiles (no call spilling the registers, cl/kernels.cl); after it, 90 streamed
# linears: 4 rows 6.0-6.9 ms, 8 rows in one tile 6.9-7.1, 12 rows 9.4-9.6, 16 rows 11.3-11.5, so
# one tile still beats two at every count measured.
TILE16_MAX = 8
TILE16_WIDE = 16
# a prefill chunk of ATT_TILE_FROM rows or more takes attention_paged_gt (cl/paged.cl): tiles of
# ATT_TILE_ROWS rows (its ATT_R) a work-item. 512 rows at q8 on 2 Zen 4 cores: attention 116 ->
# 71 ms of the chunk (attention_paged_g's row a work-item against it)
ATT_TILE_FROM = 32
ATT_TILE_ROWS = 8

u64, i32, f32 = np.uint64, np.int32, np.float32
_SCALARS = {  # kernel -> dtypes of its scalar args after the arena buffer
    "embed": [u64] * 4 + [i32, f32],
    "embed_w": [u64] * 5 + [i32, f32],
    "rmsnorm": [u64] * 3 + [i32, f32, i32],
    "linear_gemv": [u64] * 5 + [i32, i32, u64, u64],
    "linear_gemm": [u64] * 5 + [i32, i32, i32, i32, u64, u64],
    "rope": [u64] * 2 + [i32, i32, f32, i32, i32, u64],
    "attention": [u64] * 4 + [i32, i32, i32, i32],
    "silu_mul": [u64] * 3 + [i32],
    "gelu_mul": [u64] * 3 + [i32],
    "add": [u64] * 3 + [i32],
    "lm_head": [u64] * 4 + [i32, i32, i32],
    # decode.cl
    "prep": [u64] * 2 + [i32],
    "norm_prep": [u64] * 4 + [i32, f32, i32, i32],
    "lm_head_act": [u64] * 4 + [i32, i32],
    "attention_split": [u64] * 4 + [i32, i32, i32] + [u64, u64, i32, i32, i32],
    "merge_prep": [u64] * 3 + [i32, i32],
    "linear_act_norm": [u64] * 6 + [i32, i32, i32] + [u64, u64, f32, i32, i32, u64],
    "gate_up_silu_prep": [u64] * 8 + [i32, i32, u64],
    "attention_merge": [u64] * 4 + [i32, i32, i32, u64, u64, i32, u64] + [u64, u64, i32, i32, i32, u64],
    "rope_table": [u64] + [i32, f32, i32, u64, u64],
    "linear_act": [u64] * 6 + [i32, i32, i32, u64],
    "qkv_rope": [u64] * 14 + [i32] * 4 + [u64],
    "gate_up_silu": [u64] * 8 + [i32, i32],
    # paged.cl
    "rope_rows": [u64] * 4 + [i32, i32, f32, u64, i32, u64],
    "rope_rows_table": [u64] * 2 + [i32, f32, u64],
    "attention_paged": [u64] * 7 + [i32] * 5 + [u64],
    "attention_paged_g": [u64] * 7 + [i32] * 5 + [u64],     # builds with ATT_G (GQA) only
    "attention_paged_gt": [u64] * 7 + [i32] * 5 + [u64, i32],
    "attention_hcmp": [u64] * 7 + [i32] * 5 + [u64, i32, i32],
    "attention_merge_parts": [u64] * 3 + [i32, i32],
    "lm_head_rows": [u64] * 4 + [i32, i32, i32],
    "lm_head_rows2": [u64] * 4 + [i32, i32, i32],    # AVX-512 builds only
    "prep_rows": [u64] * 2 + [i32, i32, i32],
    "prep_rows_nat": [u64] * 2 + [i32, i32, i32],
    "linear_rows_act": [u64] * 5 + [i32, i32, i32, i32, u64, i32, u64],
    # batch.cl (ACT_BITS 8 and 16 builds only)
    # batch.cl, a build per K (TILE_K) of ACT_BITS 8 or 16: a kernel per rows a work-item takes
    **{f"linear_tile_n{tn}": [u64] * 5 + [i32, i32, i32, i32, u64, i32] for tn in TILE_NS},
    **{f"linear_tile16_n{tn}": [u64] * 5 + [i32, i32, i32, i32, u64, i32]    # int8, AVX512-VNNI
       for tn in TILE_NS},
    **{f"lm_head_tile_n{tn}": [u64] * 4 + [i32, i32] for tn in TILE_NS},   # q16 / q8, x86
    **MOE_SCALARS,
}
class CLKernels(MoELaunches):
    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, arena_buf: cl.Buffer,
                 build_options: str = "", kv_dtype: str = "f32", mirror: "Mirror | None" = None,
                 forced_discrete: bool | None = None):
        """Builds kernels.cl once (PoCL and pyopencl cache the binaries on disk; PoCL compiles each
        kernel again per work-group size at its first launch, also cached). build_options may
        override the tuning macros LIN_T, LIN_R, GEMM_TN; launches follow them. kv_dtype: the
        pool's KV elements (f16: every kernel built with KV_HALF). mirror: the host arena of a
        discrete buffer, kept whole in step with it (the kernel tests' harness), shared by the
        kernels of every build over that buffer. forced_discrete: discrete()'s forced (as
        wrap_arena was given for arena_buf)."""
        self.ctx, self.queue, self.buf = ctx, queue, arena_buf
        self.mirror, self.copies = mirror, discrete(ctx, forced_discrete)
        self.kv_half = kv_dtype == "f16"
        knobs, self.options = tuning(queue.device, build_options + " -DKV_HALF" * self.kv_half)
        self.on_cpu = not queue.device.type & cl.device_type.GPU      # an OpenCL CPU device (PoCL)
        self.lin_t, self.lin_r, self.gemm_tn = knobs["LIN_T"], knobs["LIN_R"], knobs["GEMM_TN"]
        self.att_wg = knobs["ATT_WG"]
        self.att_group = True         # paged attention a KV head at a time (GQA; ATT_WG 1 only)
        self.group = 64               # work-group size of the element-wise kernels
        self._by_head_dim = {}        # (head_dim, act_bits) -> kernels: attention is compiled per
        self.k = self._kernels(64)    # head size, decode.cl per prepared-activation format
        self.profile = bool(queue.properties & cl.command_queue_properties.PROFILING_ENABLE)
        self.events: list = []        # (kernel name, event) while profiling
        self._recording = None        # bind(): launches collected instead of enqueued
        self.rows_act = None          # (offset, bytes, bits): prepared rows for a batch's linears
        self._prepared = None         # the input those rows hold (while recording a replay)
        self.rope_rows = None         # (offset, bytes): a step's table of its rows' cos and sin
        self._rope_table = None       # the positions that table holds (while recording a replay)
        self._one_step = False        # replay() walks one step's tasks: they share a rope table
        # (offset, bytes) of the scratch moe_linear prepares its rows in (the pool's act_rows,
        # shared with rows_act: set by the GPU backend), and their format outside a replay that
        # gives one (a one-row decode unit: its precision's; gpu/backend.py _fused_units)
        self.moe_scratch: tuple | None = None
        self.moe_bits = 32
        self.tile_max = 8             # rows a q16 MoE weight tile takes (moe_tile; not re-measured)
        self.tile16 = True            # q8 tiles of 16 weight rows where built (linear_tile16)

    def _kernels(self, head_dim: int, act_bits: int = 32, gemm_tn: int | None = None,
                 extra: str = "") -> dict:
        """The program built for a head size and activation format (and a GEMM_TN other than
        the device's: a batch of fewer rows than GEMM_TN would compute the missing ones; extra:
        more -D options, e.g. linear_tile's rows and K)."""
        key = (head_dim, act_bits, gemm_tn, extra)
        if key not in self._by_head_dim:
            if head_dim % 8:
                raise ValueError(f"head_dim {head_dim} is not a multiple of 8")
            options = self.options if gemm_tn is None else re.sub(
                r"-DGEMM_TN=\d+", f"-DGEMM_TN={gemm_tn}", self.options)
            prg = cl.Program(self.ctx, "".join(p.read_text() for p in [SRC, *DECODE_SRC])).build(
                options=f"{options} -DHEAD_DIM={head_dim} -DACT_BITS={act_bits} {extra}")
            ks, built = {}, set(prg.kernel_names.split(";"))
            for name, scalars in _SCALARS.items():
                if name not in built:       # linear_tile: int8 / int16 builds; lm_head_rows2: AVX-512
                    continue
                ks[name] = cl.Kernel(prg, name)
                ks[name].set_scalar_arg_dtypes([None] + scalars)
            self._by_head_dim[key] = ks
        return self._by_head_dim[key]

    def _tn(self, n: int, wopts: str = "") -> tuple:
        """(rows a GEMM work-item takes, its kernels) for a launch of n rows: the device's
        GEMM_TN, or the smallest power of two >= n below it (small decode batches). wopts: the
        weight format's build options (weight_build)."""
        tn = min(self.gemm_tn, 1 << max(0, n - 1).bit_length())
        if tn == self.gemm_tn and not wopts:
            return tn, self.k
        return tn, self._kernels(64, 32, None if tn == self.gemm_tn else tn, wopts)

    def _go(self, name, gsize, lsize, *args, ks=None):
        if self._recording is not None:
            self._recording.append((name, gsize, lsize, args, ks or self.k))
            return
        knl = (ks or self.k)[name]
        knl.set_args(self.buf, *args)
        if self.mirror is not None:
            self.upload()
        ev = cl.enqueue_nd_range_kernel(self.queue, knl, gsize, lsize)
        if self.profile:
            self.events.append((name, ev))

    def bind(self, launch):
        """A one-row (decode) unit as pre-bound kernels: `launch(pos0)` enqueues some kernels
        through _go; it is recorded at pos0 = 0 and 1, each kernel gets its own cl.Kernel with its
        arguments set once, and per step only the arguments that move with pos0 (KV row offsets,
        pos0 itself: affine in pos0) are set again. Saves ~1.2 us of a ~4 us launch on PoCL.
        Returns run(pos0)."""
        recs = []
        for pos0 in (0, 1):
            # both passes start from the same state: a launch that one pass skips (a rope table or
            # prepared rows already made) would pair the others' arguments with the wrong kernels
            self._recording, self._rope_table, self._prepared = [], None, None
            try:
                launch(pos0)
            finally:
                recs.append(self._recording)
                self._recording, self._rope_table, self._prepared = None, None, None
        bound = []
        for (name, gsize, lsize, a0, ks), (_, _, _, a1, _) in zip(*recs):
            knl = self.clone(ks, name, a0)
            moving = [(i + 1, _SCALARS[name][i], v0, v1 - v0)
                      for i, (v0, v1) in enumerate(zip(a0, a1)) if v0 != v1]
            bound.append((name, knl, gsize, lsize, moving))
        queue, events, profile, mirror = self.queue, self.events, self.profile, self.mirror

        def run(pos0):
            if mirror is not None:              # the kernel tests' harness only
                self.upload()
            for name, knl, gsize, lsize, moving in bound:
                for i, dtype, v0, dv in moving:
                    knl.set_arg(i, dtype(v0 + dv * pos0))
                ev = cl.enqueue_nd_range_kernel(queue, knl, gsize, lsize)
                if profile:
                    events.append((name, ev))
        return run

    def clone(self, ks, name: str, args) -> "cl.Kernel":
        """A kernel of its own for one recorded launch, its arguments set once. Arguments go
        one by one as numpy scalars: set_scalar_arg_dtypes on every clone generated pyopencl's
        invoker anew through its on-disk cache (~0.2 ms a launch, most of a recording's cost)."""
        knl = ks[name].clone()
        knl.set_arg(0, self.buf)
        for i, (dtype, v) in enumerate(zip(_SCALARS[name], args), 1):
            knl.set_arg(i, dtype(v))
        return knl

    def replay(self, tasks: list, rows_act: tuple | None = None, keep: int | None = None,
               rope_rows: tuple | None = None, stages: list | None = None):
        """A paged program's tasks as run(n, pos0=0, span=None): their launches for n rows
        recorded once and replayed (gpu/launches.py Replay, which says what the arguments do)."""
        return Replay(self, tasks, rows_act, keep, rope_rows, stages)

    def kernel_times(self) -> dict:
        """kernel name -> (launches, seconds inside the kernel) over the events recorded so far."""
        out: dict = {}
        for name, ev in self.events:
            n, t = out.get(name, (0, 0.0))
            out[name] = (n + 1, t + (ev.profile.end - ev.profile.start) * 1e-9)
        return out

    def run(self, op: str, a: dict, N: int, pos0: int):
        """Enqueue one op (args and semantics of NumpyKernels.run); does not wait."""
        if N > 0:
            getattr(self, "_" + op)(a, N, pos0)

    def finish(self):
        self.queue.finish()
        if self.mirror is not None:              # the device's arena back into the host's
            cl.enqueue_copy(self.queue, self.mirror.host, self.buf)
            self.mirror.stale = True

    def to_device(self, host: np.ndarray, lo: int, hi: int):
        """A discrete buffer: host arena bytes lo..hi into it (what another processor or the host
        wrote there); nothing on unified memory, where the buffer is the arena."""
        if self.copies:
            cl.enqueue_copy(self.queue, self.buf, host[lo:hi], dst_offset=lo, is_blocking=False)

    def to_host(self, host: np.ndarray, lo: int, hi: int):
        """A discrete buffer: its bytes lo..hi into the host arena (after the kernels that write
        them; blocking)."""
        if self.copies:
            cl.enqueue_copy(self.queue, host[lo:hi], self.buf, src_offset=lo)

    def upload(self):
        """A mirrored discrete buffer: the host arena into it, once after each finish()."""
        if self.mirror is not None and self.mirror.stale:
            cl.enqueue_copy(self.queue, self.buf, self.mirror.host)
            self.mirror.stale = False

    # -- ops (shapes as in kernels_numpy) ------------------------------------------------------
    def _embed(self, a, N, pos0):
        """ids int32 [N], table [V, D] (Q8_0 in natural order, or a block format) -> out [N, D]
        (times a["scale"]: Gemma's embeddings)"""
        D, scale = a["D"], a.get("scale", 1.0)
        if a["table"][0] != "w8":
            (qs, d, m), wopts = weight_build(a["table"])
            self._go("embed_w", (round_up(D, self.group), N), (self.group, 1), a["ids"][1], qs, d, m,
                     a["out"][1], D, scale, ks=self._kernels(64, 32, None, wopts))
            return
        _, qs, d = a["table"]
        self._go("embed", (round_up(D, self.group), N), (self.group, 1), a["ids"][1], qs, d, a["out"][1], D,
                 scale)

    def _rmsnorm(self, a, N, pos0):
        """x [N, D], w [D] -> out [N, D]"""
        D = a["D"]
        if D % 8:
            raise ValueError(f"rmsnorm: D={D} is not a multiple of 8")
        check_aligned("rmsnorm", a["x"][1], a["w"][1], a["out"][1])
        N *= a.get("heads", 1)          # per-head norms: every head's row alone
        gsize, lsize = ((self.lin_t, N), (self.lin_t, 1)) if self.lin_t > 1 else ((N,), None)
        self._go("rmsnorm", gsize, lsize, a["x"][1], a["w"][1], a["out"][1], D, a["eps"], N)

    def _linear(self, a, N, pos0):
        """x [N, K], W Q4_1 [M, K] -> out [N, M] (out may be a KV ref): GEMV for decode, GEMM
        (GEMM_TN tokens per dequantized block) for prefill."""
        K, M = a["K"], a["M"]
        if K % QK:
            raise ValueError(f"linear: K={K} is not a multiple of {QK}")
        (qs, d, m), wopts = weight_build(a["w"])
        check_aligned("linear", a["x"][1])
        check_aligned("linear", qs, to=16)             # a row-cut weight starts at any row: K/2 = 16k
        ld = a.get("ld", M)                       # a row-cut half: its columns of rows ld wide
        rows = a["rows"][1] if "rows" in a else 0          # paged KV: row n at rows[n]
        out = a["out"][1] if rows else out_offset(a["out"], pos0, ld, self.kv_half)
        b = a["b"][1] if "b" in a else 0                   # a bias [M] (Qwen2's q, k, v)
        if N > 1 and self.rows_act is not None and a["w"][0] != "wt":   # floats: f32 GEMM
            if M % 8 == 0 and not wopts and not b and self._tile_rows(K, N) is not None:
                return self._linear_tile(a, N, out, ld, rows)
            if N <= INT_ROWS_MAX or wopts or b:
                return self._linear_rows(a, N, out, ld, rows)
        if N == 1:
            self._go("linear_gemv", (self.lin_t, round_up(M, self.lin_r)), (self.lin_t, self.lin_r),
                     a["x"][1], qs, d, m, out, K, M, rows, b, ks=self._kernels(64, 32, None, wopts))
        else:
            tn, ks = self._tn(N, wopts)
            self._go("linear_gemm", (round_up(M, self.lin_r), -(-N // tn)), (self.lin_r, 1),
                     a["x"][1], qs, d, m, out, K, M, N, ld, rows, b, ks=ks)

    def _linear_rows(self, a, N, out, ld, rows):
        """A decode batch's linear in integers: its N input rows prepared once (prep_rows; the
        linears after it that read the same rows reuse them), then linear_rows_act."""
        K, M = a["K"], a["M"]
        (qs, d, m), wopts = weight_build(a["w"])
        off, _, bits = self.rows_act
        row_bytes = prepared_row_bytes(bits, K)
        tn, _ = self._tn(N)
        ks = self._kernels(64, bits, tn, wopts)
        self._prep_rows(a["x"][1], K, N, N, row_bytes, ks)
        self._go("linear_rows_act", (round_up(M, self.lin_r), -(-N // tn)), (self.lin_r, 1), off, qs, d,
                 m, out, K, M, N, ld, rows, row_bytes, a["b"][1] if "b" in a else 0, ks=ks)

    def _prep_rows(self, x, K, N, rows, row_bytes, ks, natural: bool = False):
        """x [N, K] prepared into `rows` rows of the scratch (rows past N repeat row N-1), unless
        the linear before read the same x (q, k and v; gate and up). natural: each block's values
        in their own order (lm_head_tile's), which no linear reads."""
        off, nbytes, _ = self.rows_act
        if rows * row_bytes > nbytes:
            raise ValueError(f"linear: {rows} prepared rows of {K} need {rows * row_bytes} bytes, "
                             f"the scratch has {nbytes}")
        if natural or self._prepared != (x, rows):
            self._go("prep_rows_nat" if natural else "prep_rows", (round_up(K // QK, 8), rows), (8, 1),
                     x, off, K, row_bytes, N, ks=ks)
            self._prepared = None if natural else (x, rows)

    def _tile_rows(self, K, N):
        """(rows a linear_tile work-item takes, prepared row bytes) for N rows of K, or None where
        tiles do not serve. q8: TILE_ROWS' fewest that cover N (at most the last). q16: N rows
        dealt evenly over the fewest tiles of at most TILE16_MAX rows (5 rows: one tile of 5; 12:
        two of 6), more tiles while the rows padded to whole tiles do not fit the scratch (the
        pool sizes it for its chunk's or max_seqs' rows); on a CPU, from TILE16_WIDE rows on,
        whole tiles of TILE16_WIDE rows (85 rows: six, the last with 5); None if none fits."""
        off, nbytes, bits = self.rows_act
        row_bytes = prepared_row_bytes(bits, K)
        if bits == 8:
            return next((t for t in TILE_ROWS if t >= N), TILE_ROWS[-1]), row_bytes
        if bits != 16:
            return None
        if self.on_cpu and N >= TILE16_WIDE and round_up(N, TILE16_WIDE) * row_bytes <= nbytes:
            return TILE16_WIDE, row_bytes
        wide = next(t for t in TILE_NS if t >= N) if N < TILE16_WIDE else 0
        if self.on_cpu and N > TILE16_MAX and wide * row_bytes <= nbytes:
            return wide, row_bytes       # one tile (12 or 16 rows, the rest padded): see TILE16_MAX
        for tiles in range(-(-N // TILE16_MAX), N + 1):
            tn = -(-N // tiles)
            if round_up(N, tn) * row_bytes <= nbytes:
                return tn, row_bytes
        return None

    def _linear_tile(self, a, N, out, ld, rows):
        """A decode batch's linear in int8 or int16 (q8, q16), 8 weight rows a work-item
        (cl/batch.cl), a build per K holding a kernel per rows a work-item takes (_tile_rows)."""
        K, M, (_, qs, d, m) = a["K"], a["M"], a["w"]
        tn, row_bytes = self._tile_rows(K, N)
        ks = self._kernels(64, self.rows_act[2], None,
                           f"-DTILE_K={K} -DTILE_ROW_BYTES={row_bytes} -DTILE_ALL_N")
        self._prep_rows(a["x"][1], K, N, round_up(N, tn), row_bytes, ks)
        # int8 on AVX512-VNNI: 16 weight rows a work-item, one vpdpbusd512 for 64 products
        name, w = (f"linear_tile16_n{tn}", 16) if M % 16 == 0 and f"linear_tile16_n{tn}" in ks \
            and self.tile16 else (f"linear_tile_n{tn}", 8)
        self._go(name, (round_up(M // w, self.lin_r), -(-N // tn)), (self.lin_r, 1),
                 self.rows_act[0], qs, d, m, out, K, M, N, ld, rows, row_bytes, ks=ks)

    def _rope(self, a, N, pos0):
        """x [N, heads*hd] -> out (may be a KV ref), rotated for positions pos0 .. pos0+N-1"""
        H, hd = a["heads"], a["head_dim"]
        if "pos" in a:          # rows at their own positions (paged.cl), KV rows from `rows`
            check_aligned("rope", a["x"][1], a["out"][1], to=8)
            self._go("rope_rows", (hd // 2, N), (hd // 2, 1), a["x"][1], a["out"][1], a["pos"][1],
                     a["rows"][1] if "rows" in a else 0, H, hd, a["theta"], self._rope_rows(a, N),
                     int(a.get("neox", 0)), a["f"][1] if "f" in a else 0)
            return
        out = out_offset(a["out"], pos0, H * hd, self.kv_half)
        check_aligned("rope", a["x"][1], out, to=8)
        self._go("rope", (hd // 2, N), (hd // 2, 1), a["x"][1], out, H, hd, a["theta"], pos0,
                 int(a.get("neox", 0)), a["f"][1] if "f" in a else 0)

    def _rope_rows(self, a, N) -> int:
        """Offset of this step's cos / sin table for rows at positions a["pos"], computed by the
        first rope of a recorded or walked step (positions are data: only replay() knows that one
        step holds them fixed); 0: none, the kernel computes its own."""
        hd = a["head_dim"]
        one_step = self._recording is not None or self._one_step
        if not one_step or self.rope_rows is None or N * hd * 4 > self.rope_rows[1]:
            return 0
        f = a["f"][1] if "f" in a else 0
        key = (a["pos"][1], N, hd, a["theta"], f)
        if self._rope_table != key:
            self._go("rope_rows_table", (hd // 2, N), (hd // 2, 1), a["pos"][1], self.rope_rows[0],
                     hd, a["theta"], f)
            self._rope_table = key
        return self.rope_rows[0]

    def _attention(self, a, N, pos0):
        """q [N, H*hd], K/V cache rows 0 .. pos0+N -> out [N, H*hd] (causal, GQA): a work-group
        per (head, row), its ATT_WG work-items splitting the keys (split-K, merged in local memory)"""
        H, KVH, wg = a["heads"], a["kv_heads"], self.att_wg
        check_aligned("attention", a["q"][1], a["k"][1], a["v"][1], a["out"][1])
        if "btab" in a:         # paged K/V, every row its own sequence and position (paged.cl)
            br = a["block_rows"]
            if br % 8 or br & (br - 1):
                raise ValueError(f"attention: block_rows {br} is not a power of two >= 8")
            args = (a["q"][1], a["k"][1], a["v"][1], a["out"][1], a["pos"][1], a["seq"][1],
                    a["btab"][1], H, KVH, a["block_rows"], a["max_blocks"], a.get("window", 0),
                    a["tmask"][1] if "tmask" in a else 0)
            if "part" in a:     # HCMP: one part of a verifying step's attention (paged.cl)
                self._go("attention_hcmp", (1, H, N), (1, 1, 1), *args, PARTS.index(a["part"]),
                         a["cols"], ks=self._kernels(a["head_dim"]))
                return
            g = H // KVH
            if wg == 1 and g > 1 and self.att_group and "tmask" not in a and N >= ATT_TILE_FROM \
                    and a["head_dim"] <= 128:
                # a prefill chunk's rows, a tile of them a work-item (paged.cl attention_paged_gt)
                self._go("attention_paged_gt", (1, KVH, -(-N // ATT_TILE_ROWS)), (1, 1, 1), *args, N,
                         ks=self._kernels(a["head_dim"], 32, None, f"-DATT_G={g}"))
                return
            if wg == 1 and g > 1 and self.att_group:
                # a work-item for the g query heads of a KV head: K and V converted once for them
                self._go("attention_paged_g", (1, KVH, N), (1, 1, 1), *args,
                         ks=self._kernels(a["head_dim"], 32, None, f"-DATT_G={g}"))
                return
            self._go("attention_paged", (wg, H, N), (wg, 1, 1), *args, ks=self._kernels(a["head_dim"]))
            return
        self._go("attention", (wg, H, N), (wg, 1, 1), a["q"][1], a["k"][1], a["v"][1], a["out"][1],
                 H, KVH, pos0, a.get("window", 0), ks=self._kernels(a["head_dim"]))

    def _attn_merge(self, a, N, pos0):
        """the dense and sparse parts' rows a, b [N, cols] -> out [N, H*hd] (HCMP, paged.cl)"""
        H, hd = a["heads"], a["head_dim"]
        check_aligned("attn_merge", a["a"][1], a["b"][1], a["out"][1])
        self._go("attention_merge_parts", (hd // 8, H, N), (hd // 8, 1, 1), a["a"][1], a["b"][1],
                 a["out"][1], H, a["cols"], ks=self._kernels(hd))

    def _silu_mul(self, a, N, pos0):
        """g, u [N, F] -> out [N, F]"""
        n = N * a["F"]
        self._go("silu_mul", (round_up(n, self.group),), (self.group,), a["g"][1], a["u"][1], a["out"][1], n)

    def _gelu_mul(self, a, N, pos0):
        """g, u [N, F] -> out [N, F]"""
        n = N * a["F"]
        self._go("gelu_mul", (round_up(n, self.group),), (self.group,), a["g"][1], a["u"][1], a["out"][1], n)

    def _add(self, a, N, pos0):
        """a, b [N, D] -> out [N, D]"""
        n = N * a["D"]
        self._go("add", (round_up(n, self.group),), (self.group,), a["a"][1], a["b"][1], a["out"][1], n)

    def _lm_tile(self, a, N, qs, d) -> bool:
        """Every row's logits at q16 or q8 on x86 (cl/batch.cl lm_head_tile): the rows prepared
        in int16 (int8) in their own order, 8 table rows a work-item against a tile of rows, the
        products a one-row step's lm_head_act takes. False where it does not serve (f32, another
        device, a V not a multiple of 8, no tile that fits the scratch)."""
        D, V = a["D"], a["V"]
        tiles = self._tile_rows(D, N) if self.rows_act is not None and self.rows_act[2] in (8, 16) \
            and V % 8 == 0 else None
        if tiles is None:
            return False
        (tn, row_bytes), (off, _, bits) = tiles, self.rows_act
        ks = self._kernels(64, bits, None, f"-DTILE_K={D} -DTILE_ROW_BYTES={row_bytes} -DTILE_ALL_N")
        if f"lm_head_tile_n{tn}" not in ks:
            return False
        self._prep_rows(a["x"][1], D, N, round_up(N, tn), row_bytes, ks, natural=True)
        self._go(f"lm_head_tile_n{tn}", (round_up(V // 8, self.lin_r), -(-N // tn)), (self.lin_r, 1),
                 off, qs, d, a["out"][1], N, V, ks=ks)
        return True

    def _lm_head(self, a, N, pos0):
        """x [N, D] (row N-1), table Q8_0 [V, D] -> out [V] (a table in a block format: the
        linear kernels, over row N-1 or, all_rows, every row)"""
        D, V = a["D"], a["V"]
        if a["table"][0] != "w8":
            rows = N if a.get("all_rows") else 1
            x = a["x"][1] + (N - rows) * D * 4
            self._linear({"x": ("a", x), "w": a["table"], "out": a["out"], "K": D, "M": V}, rows, 0)
            return
        _, qs, d = a["table"]
        if D % QK:
            raise ValueError(f"lm_head: D={D} is not a multiple of {QK}")
        check_aligned("lm_head", a["x"][1])
        check_aligned("lm_head", qs, to=16)
        if a.get("all_rows"):   # a batch: every row's logits, the table read once for GEMM_TN rows
            if self._lm_tile(a, N, qs, d):
                return
            tn, ks = self._tn(N)
            if "lm_head_rows2" in ks:       # x86 with AVX-512: two table rows a work-item
                self._go("lm_head_rows2", (round_up(-(-V // 2), self.group), -(-N // tn)), (self.group, 1),
                         a["x"][1], qs, d, a["out"][1], D, V, N, ks=ks)
                return
            self._go("lm_head_rows", (round_up(V, self.group), -(-N // tn)), (self.group, 1), a["x"][1],
                     qs, d, a["out"][1], D, V, N, ks=ks)
            return
        self._go("lm_head", (round_up(V, self.group),), (self.group,), a["x"][1], qs, d, a["out"][1], D, V, N)
