"""The per-token loop of a processor actor: no Ray call per step, op or token (DESIGN.md §3).

The control actor starts a step by writing the control block and bumping this processor's go
word; the worker thread wakes (futex), runs its installed units in order — waiting on the ready
words its program names, signalling the ones it must — and stores its done word. A unit is one
kernel launch (CPU, GPU) or one fused compiled graph (NPU).
"""
from __future__ import annotations

import threading
import time
import traceback

from socllm.graph.program import stage_of
from socllm.graph.seqcut import part_rows
from socllm.memory.layout import W_ERROR, Control, PoolLayout
from socllm.memory.ready import STEP, ReadyWords, SleepPredictor


class Unit:
    """run(n, pos0); a step that runs a span of its program's stages (graph/program.py stage_of)
    skips a unit of another `stage`, and hands the span to a unit that `spans` several
    (run(n, pos0, span)); a unit with neither always runs."""
    __slots__ = ("waits", "run", "signals", "seqs", "stage", "spans")

    def __init__(self, waits, run, signals, seqs=(), stage=None, spans=False):
        self.waits, self.run, self.signals, self.seqs = waits, run, signals, seqs
        self.stage, self.spans = stage, spans


def kernel_units(kernels, tasks: list) -> list:
    """One unit per task for backends that launch kernels one by one (CPU, GPU); a sequence-cut
    part's task takes its own rows (graph/seqcut.part_rows), the others the step's as they are."""
    def unit(t, stage):
        if "seq_n" in t.args:
            run = lambda n, p: kernels.run(t.op, t.args, *part_rows(t.args, n, p))
        else:
            run = lambda n, p: kernels.run(t.op, t.args, n, p)
        return Unit(t.waits, run, t.signals, (t.seq,), stage)
    return [unit(t, stage) for t, stage in zip(tasks, stage_of(tasks))]


class Worker:
    def __init__(self, name: str, backend, words: ReadyWords, ctl: Control, lay: PoolLayout,
                 sleep_fraction: float = 0.0):
        self.name, self.backend, self.words, self.ctl = name, backend, words, ctl
        self.go, self.done = lay.go(name), lay.done(name)
        self.units: dict = {}              # (program id, precision code) -> [Unit]
        self.precisions: dict = {}         # precision code -> name
        self.final: dict = {}              # program id -> seq of the last task
        self.error: str | None = None
        self.busy_s = 0.0                  # time spent running units (not waiting)
        self.steps = 0
        # per (program, unit): HeteroLLM §4.2 (the config's sleep_fraction; off by default)
        self.predict = SleepPredictor(sleep_fraction)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"socllm-{name}", daemon=True)
        self._thread.start()

    def wait_stopped(self):
        self._stop.wait()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2)

    def _loop(self):
        seen = self.words.get(self.go)
        while not self._stop.is_set():
            cur = self.words.wait_change(self.go, seen, 0.25)
            if cur == seen:
                continue
            seen = cur
            try:
                self._step()
            except Exception as e:  # report through the pool; the control actor raises it
                self.error = f"{self.name}: {type(e).__name__}: {e}"
                traceback.print_exc()
                self.ctl["error"] = 1
                self.words.store(W_ERROR, self.words.get(W_ERROR) + 1)

    def _step(self):
        ctl, words = self.ctl, self.words
        base = ctl["epoch"] * STEP
        pid, n, pos0, prec = ctl["program"], ctl["n"], ctl["pos0"], ctl["precision"]
        lo, hi = ctl["span_lo"], ctl["span_hi"]
        span = (lo, hi) if hi else None
        units = self.units[(pid, prec)]
        self.backend.begin_step(self.precisions[prec], pos0)
        t0 = time.perf_counter()
        for k, u in enumerate(units):
            for w, v in u.waits:
                if not self.predict.wait(words, (pid, k), w, base + v, timeout_s=300):
                    raise TimeoutError(f"waited 300 s for ready word {w}")
            if u.spans:
                u.run(n, pos0, span)
            elif span is None or u.stage is None or lo <= u.stage < hi:
                u.run(n, pos0)
            if u.signals:
                self.backend.finish()
                for w, v in u.signals:
                    words.store(w, base + v)
        self.backend.finish()
        self.busy_s += time.perf_counter() - t0
        self.steps += 1
        words.store(self.done, base + self.final[pid])
