"""A paged program's kernel launches, recorded once per row count and replayed (gpu/kernels.py
CLKernels.replay makes one): the tasks of a paged program depend on no pos0 (positions are data in
the pool), so the launches for n rows are recorded once, each with its own cl.Kernel and its
arguments set once, and only enqueued at later steps of n rows (no Python per op)."""
from __future__ import annotations

import contextlib

from socllm.actors.gpu.device import cl


class Recording:
    """The launches for n rows, recorded up to some stage: a span records only as far as it runs
    (recording every stage of a 128-row chunk took ~200 ms of Python, which a reactive arrival
    waited for behind the chunk's first span)."""

    def __init__(self):
        self.bound, self.next = [], 0           # launches (name, kernel, gsize, lsize); next task
        self.starts: dict = {}                  # stage -> index of its first launch
        self.state = (None, None)               # (_prepared, _rope_table) between parts


class Replay:
    def __init__(self, kernels, tasks: list, rows_act: tuple | None = None, keep: int | None = None,
                 rope_rows: tuple | None = None, stages: list | None = None):
        """kernels: the CLKernels that launch each task (its run(op, args, n, pos0)).
        rows_act = (offset, bytes, bits): the linears of more than one row take their rows
        prepared in int16 (bits 16) or int8 (8) in that scratch (decode batches at q16 / q8).
        keep: recordings kept at most, the least recently used dropped (each is a few hundred
        kernel objects); 0: none, every step walks its tasks (prefill chunks: in every length,
        and the walk's ~2 ms of Python is within 1-3 % of a recording's time for 20-128 rows,
        where recording a length costs ~100 ms, which a reactive arrival behind it waited for).
        rope_rows: (offset, bytes) of the step's cos / sin table (default: the kernels' own).
        stages: each task's stage (graph/program.py stage_of): run(n, span=(lo, hi)) enqueues
        only the launches of stages lo .. hi-1 (every stage prepares its own inputs)."""
        self.k, self.tasks, self.rows_act, self.keep = kernels, tasks, rows_act, keep
        self.stages = stages or [0] * len(tasks)
        self.table = rope_rows or kernels.rope_rows
        self.last = max(self.stages)
        self.recorded: dict = {}        # n -> Recording, the most recently used last
        self.walked: dict = {}          # n -> (_prepared, _rope_table) between a walked chunk's spans

    def __call__(self, n: int, pos0: int = 0, span: tuple | None = None):
        """The step's launches for n rows (span (lo, hi): its stages lo .. hi-1 only)."""
        k = self.k
        if k.mirror is not None:                # the kernel tests' harness only
            k.upload()
        lo, hi = (0, self.last + 1) if span is None else (min(s, self.last + 1) for s in span)
        if self.keep == 0:
            state = self.walked.get(n, (None, None)) if lo else (None, None)
            self.walked[n] = self._walk(n, state, lambda i, stage: lo <= stage < hi)
            return
        rec = self.recorded.pop(n, None) or Recording()
        self.recorded[n] = rec
        if self.keep is not None and len(self.recorded) > self.keep:
            del self.recorded[next(iter(self.recorded))]
        if rec.next < len(self.tasks) and self.stages[rec.next] < hi:
            try:
                self._record(rec, n, hi)
            except Exception:          # a part recorded half-way: none of it is kept
                self.recorded.pop(n, None)
                raise
        launches = rec.bound if span is None else \
            rec.bound[self._bound_of(rec, lo): self._bound_of(rec, hi)]
        for name, knl, gsize, lsize in launches:
            ev = cl.enqueue_nd_range_kernel(k.queue, knl, gsize, lsize)
            if k.profile:
                k.events.append((name, ev))

    @contextlib.contextmanager
    def _as_step(self, state: tuple):
        """The kernels' per-step state set for this program's tasks (prepared rows, the step's
        rope table), from the carried (_prepared, _rope_table); put back after."""
        k = self.k
        saved = (k.rows_act, k._prepared, k._rope_table, k.rope_rows, k._one_step)
        k.rows_act, k.rope_rows, k._one_step = self.rows_act, self.table, True
        k._prepared, k._rope_table = state
        try:
            yield k
        finally:
            k.rows_act, k._prepared, k._rope_table, k.rope_rows, k._one_step = saved

    def _walk(self, n: int, state: tuple, select) -> tuple:
        """Runs the tasks select(i, stage) takes, in order, for n rows (launches go to the
        kernels' _recording where one is open), from the carried state; -> the state after."""
        with self._as_step(state) as k:
            for i, (t, stage) in enumerate(zip(self.tasks, self.stages)):
                if not select(i, stage):
                    continue
                k.run(t.op, t.args, n, 0)
                if k._prepared and t.args.get("out", (None, None))[1] == k._prepared[0]:
                    k._prepared = None          # its input was overwritten
            return k._prepared, k._rope_table

    def _record(self, rec: Recording, n: int, upto: int):
        """Records tasks until the first of stage >= upto (the same launches, in the same order,
        as recording them all at once: the state carries from one part to the next)."""
        k = self.k
        saved, k._recording = k._recording, []
        first = len(rec.bound)

        def select(i, stage):
            if i < rec.next or stage >= upto:
                return False
            rec.starts.setdefault(stage, first + len(k._recording))
            rec.next = i + 1
            return True
        try:
            rec.state = self._walk(n, rec.state, select)
            recs = k._recording
        finally:
            k._recording = saved
        for name, gsize, lsize, args, ks in recs:
            rec.bound.append((name, k.clone(ks, name, args), gsize, lsize))

    def _bound_of(self, rec: Recording, s: int) -> int:
        """Index of stage s's first launch (a stage without launches: the next one's)."""
        while s <= self.last and s not in rec.starts:
            s += 1
        return rec.starts[s] if s <= self.last else len(rec.bound)
