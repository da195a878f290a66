"""CPU processor backend: numpy kernels over the pool, one unit per task."""
from __future__ import annotations

from socllm.graph.program import StepProgram

from .kernels_numpy import NumpyKernels
from .worker import Unit


class CPUBackend:
    name = "cpu"

    def __init__(self, arena_buf, lay, threads: int):
        self.kernels = NumpyKernels(arena_buf)
        self.threads = threads

    def build_units(self, prog: StepProgram, precision: str) -> list:
        k = self.kernels
        return [Unit(t.waits, (lambda n, p, t=t: k.run(t.op, t.args, n, p)), t.signals, (t.seq,))
                for t in prog.tasks.get(self.name, [])]

    def finish(self):
        pass

    def describe(self) -> dict:
        return {"processor": "cpu", "api": "numpy", "threads": self.threads}
