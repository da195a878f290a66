"""ProcessorActor: the Ray actor that owns one processor's kernels (cpu, gpu or npu).

Ray creates, places and supervises it and carries its few control messages (install a program,
report stats); tensors and step synchronization go through the pool (DESIGN.md §3).
"""
from __future__ import annotations

import os

import ray

from socllm.graph.program import StepProgram
from socllm.memory.arena import Arena
from socllm.memory.layout import Control, PoolLayout
from socllm.memory.ready import ReadyWords

BACKENDS = {"cpu": ("socllm.actors.cpu.backend", "CPUBackend"), "gpu": ("socllm.actors.gpu.backend", "GPUBackend"),
            "npu": ("socllm.actors.npu.backend", "NPUBackend")}


# Ray restarts a processor actor whose process dies (its constructor attaches the same pool
# again); the service re-installs its programs and redoes the step it lost (actors/engine.py)
MAX_RESTARTS = 8


class ProcessorCore:
    """Everything a processor actor holds; the control actor extends it."""

    def __init__(self, kind: str, arena_name: str, layout: dict, config):
        """config: the engine's (policies/config.py EngineConfig, its threads resolved): the knobs
        this process applies come from it, never from this process's environment (a cluster
        that `ray start` began never saw the environment of the command that made the engine)."""
        import importlib
        self.kind, self.config = kind, config
        self.lay = PoolLayout.from_dict(layout)
        self.arena = Arena.attach(arena_name, self.lay.size, self.lay.readonly_bytes)
        self.words = ReadyWords(self.arena.buf[self.lay.words: self.lay.words + self.lay.n_words * 4])
        self.ctl = Control(self.arena.buf, self.lay)
        mod, cls = BACKENDS[kind]
        self.backend = getattr(importlib.import_module(mod), cls)(self.arena.buf, self.lay,
                                                                  config.threads, config=config)
        from socllm.actors.worker import Worker
        self.worker = Worker(kind, self.backend, self.words, self.ctl, self.lay,
                             config.sleep_fraction)

    def install(self, pid: int, blob: bytes, precision: int, precision_name: str) -> bool:
        """Install a step program once (msgpack); the NPU compiles its graphs here, ahead of use."""
        key = (pid, precision)
        self.worker.precisions[precision] = precision_name
        if key not in self.worker.units:
            prog = StepProgram.from_bytes(blob)
            self.worker.units[key] = self.backend.build_units(prog, precision_name)
            self.worker.final[pid] = prog.final.get(self.kind, 0)
        return True

    def uninstall(self, pid: int) -> bool:
        """Drop a program's units; with none left, the backend's compiled graphs go too (the NPU
        of a service whose prefill runs on the GPU: its chunk graphs were only timed)."""
        for key in [k for k in self.worker.units if k[0] == pid]:
            del self.worker.units[key]
        self.worker.final.pop(pid, None)
        if not self.worker.units and hasattr(self.backend, "release"):
            self.backend.release()
        return True

    def compile_kv(self, positions: list) -> int:
        """The backend's graphs for later chunks at these positions, compiled ahead of use (an
        NPU's KV-length buckets: npu/backend.py compile_kv); 0 where a backend compiles none."""
        return self.backend.compile_kv(positions) if hasattr(self.backend, "compile_kv") else 0

    def info(self) -> dict:
        d = self.backend.describe()
        d.update(pid=os.getpid(), steps=self.worker.steps, busy_s=self.worker.busy_s,
                 error=self.worker.error, sleep_fraction=self.worker.predict.fraction)
        return d

    def last_error(self) -> str | None:
        return self.worker.error

    def pid(self) -> int:
        return os.getpid()

    def watch(self) -> bool:
        """Returns only when the worker stops: a caller keeps this call pending, and Ray fails it
        (RayActorError) the moment this process dies. That is how a step's driver learns of a
        death that its done words alone would hide for ever."""
        self.worker.wait_stopped()
        return True

    def stop(self):
        self.worker.stop()


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=MAX_RESTARTS)
class ProcessorActor(ProcessorCore):
    pass
