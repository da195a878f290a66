"""CPU processor backend: numpy kernels over the pool, one unit per task."""
from __future__ import annotations

from socllm.graph.program import StepProgram

from socllm.actors.cpu.kernels import NumpyKernels
from socllm.actors.worker import kernel_units


class CPUBackend:
    name = "cpu"

    def __init__(self, arena_buf, lay, threads: int, config=None):
        """config: the engine's (policies/config.py); numpy's kernels take no knob of it."""
        self.kernels = NumpyKernels(arena_buf, lay.kv_dtype)
        self.threads = threads

    def build_units(self, prog: StepProgram, precision: str) -> list:
        return kernel_units(self.kernels, prog.tasks.get(self.name, []))

    def begin_step(self, precision: str, pos0: int):
        pass

    def finish(self):
        pass

    def describe(self) -> dict:
        return {"processor": "cpu", "api": "numpy", "threads": self.threads}
