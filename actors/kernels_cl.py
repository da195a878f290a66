"""The GPU actor's kernels: OpenCL (pyopencl) over the pool's arena, with exactly the semantics of
kernels_numpy.NumpyKernels (their specification and test oracle), op for op.

The whole arena is one cl.Buffer; kernels get byte offsets into it (DESIGN.md §3). Where the device
shares host memory (an iGPU, PoCL on the CPU) the buffer wraps the arena with CL_MEM_USE_HOST_PTR:
zero-copy, kernels read the weights and write the slots / KV cache in the pool itself. A discrete
GPU gets a COPY_HOST_PTR buffer: one upload at wrap time, and its caller must copy outputs back
(cl.enqueue_copy of the live-out byte ranges) before another processor reads them.

Threads: PoCL reads POCL_MAX_PTHREAD_COUNT when pyopencl first lists platforms; the actor sets it
from the machine's thread budget (DESIGN.md §6) before importing this module. Nothing here sets it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyopencl as cl

from socllm.models.quant import QK

SRC = Path(__file__).parent / "cl" / "kernels.cl"
ALIGN = 64  # every offset in the arena is a multiple of this (vector loads, cache lines)

u64, i32, f32 = np.uint64, np.int32, np.float32
_SCALARS = {  # kernel -> scalar arg dtypes after the arena buffer
    "embed": [u64] * 4 + [i32],
    "rmsnorm": [u64] * 3 + [i32, f32, i32],
    "linear_gemv": [u64] * 5 + [i32, i32],
    "linear_gemm": [u64] * 5 + [i32, i32, i32],
    "rope": [u64] * 2 + [i32, i32, f32, i32],
    "attention": [u64] * 4 + [i32, i32, i32],
    "silu_mul": [u64] * 3 + [i32],
    "add": [u64] * 3 + [i32],
    "lm_head": [u64] * 3 + [u64, i32, i32, i32],
}


def make_context(device_kind: str = "any"):
    """-> (ctx, queue, device). "any": the first GPU of any platform, else PoCL's CPU device;
    "gpu" / "cpu": only that kind (RuntimeError if there is none)."""
    gpus, cpus = [], []
    for p in cl.get_platforms():
        for d in p.get_devices():
            if d.type & cl.device_type.GPU:
                gpus.append(d)
            elif d.type & cl.device_type.CPU:
                cpus.append(d)
    # PoCL's CPU device first among CPUs: it is the one this project ships and tunes for
    cpus.sort(key=lambda d: "Portable Computing Language" not in d.platform.name)
    pick = {"any": gpus + cpus, "gpu": gpus, "cpu": cpus}[device_kind]
    if not pick:
        raise RuntimeError(f"no OpenCL {device_kind} device found")
    device = pick[0]
    ctx = cl.Context([device])
    return ctx, cl.CommandQueue(ctx, device), device


def wrap_arena(ctx: cl.Context, arena: np.ndarray) -> cl.Buffer:
    """The arena (uint8 [bytes]) as one cl.Buffer: zero-copy (USE_HOST_PTR) on host-unified memory,
    else an uploaded copy (COPY_HOST_PTR): then outputs must be copied back by the caller."""
    mf = cl.mem_flags
    unified = all(d.host_unified_memory for d in ctx.devices)
    flags = mf.READ_WRITE | (mf.USE_HOST_PTR if unified else mf.COPY_HOST_PTR)
    return cl.Buffer(ctx, flags, hostbuf=arena)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _out_off(ref, pos0: int, cols: int) -> int:
    """Byte offset of an output ref's first row: KV refs start at row pos0 (written in place)."""
    return ref[1] + (pos0 * cols * 4 if ref[0] == "kv" else 0)


class CLKernels:
    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, arena_buf: cl.Buffer,
                 build_options: str = ""):
        self.ctx, self.queue, self.buf = ctx, queue, arena_buf
        dev = queue.device
        gpu = bool(dev.type & cl.device_type.GPU)
        # tuning knobs (kernels.cl): a GPU splits a GEMV row over a warp; PoCL-on-CPU gives each
        # work-item whole rows and vectorizes inside it
        self.lin_t, self.lin_r, self.gemm_tn = (32, 4, 4) if gpu else (1, 16, 8)
        self.group = 64
        self.options = (f"-DLIN_T={self.lin_t} -DLIN_R={self.lin_r} -DGEMM_TN={self.gemm_tn} "
                        + build_options)
        self._programs = {}            # head_dim -> kernels (attention is compiled per head size)
        self.k = self._build(64)

    def _build(self, head_dim: int) -> dict:
        if head_dim not in self._programs:
            if head_dim % 16:
                raise ValueError(f"head_dim {head_dim} is not a multiple of 16")
            prg = cl.Program(self.ctx, SRC.read_text()).build(
                options=f"{self.options} -DHEAD_DIM={head_dim}")
            ks = {}
            for name, scalars in _SCALARS.items():
                ks[name] = cl.Kernel(prg, name)
                ks[name].set_scalar_arg_dtypes([None] + scalars)
            self._programs[head_dim] = ks
        return self._programs[head_dim]

    def _go(self, name, gsize, lsize, *args, k=None):
        knl = (k or self.k)[name]
        knl.set_args(self.buf, *args)
        cl.enqueue_nd_range_kernel(self.queue, knl, gsize, lsize)

    def run(self, op: str, a: dict, N: int, pos0: int):
        """Enqueue one op (same args and semantics as NumpyKernels.run); does not wait."""
        if N > 0:
            getattr(self, "_" + op)(a, N, pos0)

    def finish(self):
        self.queue.finish()

    # -- ops (shapes as in kernels_numpy) ------------------------------------------------------
    def _embed(self, a, N, pos0):
        _, qs, d = a["table"]
        D = a["D"]
        self._go("embed", (_round_up(D, self.group), N), (self.group, 1),
                 a["ids"][1], qs, d, a["out"][1], D)

    def _rmsnorm(self, a, N, pos0):
        self._go("rmsnorm", (N,), None, a["x"][1], a["w"][1], a["out"][1], a["D"], a["eps"], N)

    def _linear(self, a, N, pos0):
        K, M = a["K"], a["M"]
        assert K % QK == 0, K
        _, qs, d, m = a["w"]
        out = _out_off(a["out"], pos0, M)
        if N == 1:
            self._go("linear_gemv", (self.lin_t, _round_up(M, self.lin_r)), (self.lin_t, self.lin_r),
                     a["x"][1], qs, d, m, out, K, M)
        else:
            lr = min(self.lin_r, _round_up(M, 1))
            self._go("linear_gemm", (_round_up(M, lr), -(-N // self.gemm_tn)), (lr, 1),
                     a["x"][1], qs, d, m, out, K, M, N)

    def _rope(self, a, N, pos0):
        H, hd = a["heads"], a["head_dim"]
        pairs = H * hd // 2
        self._go("rope", (_round_up(pairs, self.group), N), (self.group, 1),
                 a["x"][1], _out_off(a["out"], pos0, H * hd), H, hd, a["theta"], pos0)

    def _attention(self, a, N, pos0):
        H, KVH = a["heads"], a["kv_heads"]
        self._go("attention", (H, N), (1, 1), a["q"][1], a["k"][1], a["v"][1], a["out"][1],
                 H, KVH, pos0, k=self._build(a["head_dim"]))

    def _silu_mul(self, a, N, pos0):
        n = N * a["F"]
        self._go("silu_mul", (_round_up(n, self.group),), (self.group,),
                 a["g"][1], a["u"][1], a["out"][1], n)

    def _add(self, a, N, pos0):
        n = N * a["D"]
        self._go("add", (_round_up(n, self.group),), (self.group,),
                 a["a"][1], a["b"][1], a["out"][1], n)

    def _lm_head(self, a, N, pos0):
        _, qs, d = a["table"]
        D, V = a["D"], a["V"]
        self._go("lm_head", (_round_up(V, self.group),), (self.group,),
                 a["x"][1], qs, d, a["out"][1], D, V, N)
