"""The decode GEMV over E0M4 FP4 weights (models/e0m4.py) on the GPU actor's arena (cl/e0m4.cl).

An experiment beside CLKernels, not an op of the engine: it answers whether the paper's
two-bitwise-op dequantization (Transformer-Lite §2.3) beats Q4_1's int -> float conversion on this
device. It builds with CLKernels' tuning (kernels_cl.tuning), so a GEMV here splits its rows
exactly as CLKernels' linear_gemv does. Layout rules are linear_gemv's: x 32-byte aligned,
qs 16-byte aligned, K a multiple of 32.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from socllm.actors.gpu.device import cl

from socllm.models.quant import QK

from socllm.actors.gpu.device import tuning
from socllm.actors.gpu.kernels import SRC as CL_SRC, check_aligned, round_up

SRC = Path(__file__).parent / "cl" / "e0m4.cl"   # built after kernels.cl, whose helpers it uses


class E0M4Kernels:
    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, arena_buf: cl.Buffer,
                 build_options: str = ""):
        """build_options may override LIN_T / LIN_R, as CLKernels' do."""
        self.queue, self.buf = queue, arena_buf
        knobs, options = tuning(queue.device, build_options)
        self.lin_t, self.lin_r = knobs["LIN_T"], knobs["LIN_R"]
        prg = cl.Program(ctx, CL_SRC.read_text() + SRC.read_text()).build(options=options)
        self.knl = cl.Kernel(prg, "linear_gemv_e0m4")
        self.knl.set_scalar_arg_dtypes([None] + [np.uint64] * 5 + [np.int32] * 2)

    def gemv(self, x: int, w: tuple, out: int, K: int, M: int):
        """x [1, K] f32, w = (qs, scale, bias) byte offsets of an E0M4 [M, K] -> out [1, M] f32.
        Enqueues, does not wait."""
        if K % QK:
            raise ValueError(f"linear_e0m4: K={K} is not a multiple of {QK}")
        qs, scale, bias = w
        check_aligned("linear_e0m4", x)
        check_aligned("linear_e0m4", qs, to=16)
        self.knl.set_args(self.buf, x, qs, scale, bias, out, K, M)
        cl.enqueue_nd_range_kernel(self.queue, self.knl, (self.lin_t, round_up(M, self.lin_r)),
                                   (self.lin_t, self.lin_r))

    def finish(self):
        self.queue.finish()
