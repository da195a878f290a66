"""GPU processor backend: OpenCL kernels (pyopencl) on one buffer that wraps the whole pool.

On a device that shares host memory (an iGPU; PoCL on this machine) the buffer is the pool
itself (CL_MEM_USE_HOST_PTR): no copies. Kernels are enqueued without waiting; the queue is
finished only where another processor needs a result (a signal) and at the end of the step.
"""
from __future__ import annotations

from socllm.graph.program import StepProgram

from .worker import kernel_units


class GPUBackend:
    name = "gpu"

    def __init__(self, arena_buf, lay, threads: int):
        from .kernels_cl import CLKernels, make_context, wrap_arena
        self.ctx, self.queue, self.device = make_context()
        if not self.device.host_unified_memory:
            raise RuntimeError(f"{self.device.name}: discrete GPUs need an upload path (not built yet)")
        self.buf = wrap_arena(self.ctx, arena_buf)
        self.kernels = CLKernels(self.ctx, self.queue, self.buf, scratch_off=lay.io["q8"])
        self.threads = threads

    def build_units(self, prog: StepProgram, precision: str) -> list:
        return kernel_units(self.kernels, prog.tasks.get(self.name, []))

    def begin_step(self, precision: str):
        # q8 (W4A8): decode matmuls quantize their activation row to int8 per 32-block, as
        # llama.cpp does; measured 2.2x faster GEMVs on PoCL. f32/f16/bf16 keep f32 activations.
        self.kernels.set_activation_quant(precision == "q8")

    def finish(self):
        self.kernels.finish()

    def describe(self) -> dict:
        d = self.device
        return {"processor": "gpu", "api": "OpenCL", "platform": d.platform.name, "device": d.name,
                "type": "CPU (PoCL: OpenCL on the CPU, not a GPU)" if d.type & 2 else "GPU",
                "host_unified_memory": bool(d.host_unified_memory), "threads": self.threads}
