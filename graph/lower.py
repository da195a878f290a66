"""Lowering: a graph + a placement -> one StepProgram (one task list per processor).

Every tensor is resolved to where it lives (the caller's `refs`). Cross-processor hazards become
waits and signals on ready words (DESIGN.md §3):
  read after write   the producer signals the location's ready word, the consumer waits for it;
  write after read   the reader signals its processor's done word, the overwriting writer waits;
  write after write  the later writer waits for the earlier one's location word.
Same-processor order is program order, so it needs nothing. Stamps are task positions in the
global order (1-based); the worker adds the step's epoch base at run time.
"""
from __future__ import annotations

from .ir import Graph
from .liveness import SlotPlan
from .program import StepProgram, Task


def location(g: Graph, slots: SlotPlan, name: str) -> str | None:
    kind = g.tensors[name].kind
    if kind == "act":
        return f"slot.{slots.assign[name]}"
    if kind == "weight":
        return None
    return name  # kv caches and io tensors are their own locations


def lower(g: Graph, slots: SlotPlan, refs: dict, words: dict, done_words: dict, place,
          phase: str, bucket: int) -> StepProgram:
    """refs: tensor name -> ref tuple (act tensors: by slot, see `slot_ref`); words: location ->
    ready word; done_words: processor -> its done word; place: Op -> processor name."""
    tasks: dict = {}
    writer: dict = {}        # location -> (seq, proc, task)
    readers: dict = {}       # location -> [(seq, proc, task)] since the last write
    for i, op in enumerate(g.ops):
        seq, proc = i + 1, place(op)
        args = dict(op.attrs)
        for role, name in {**op.inputs, **op.outputs}.items():
            args[role] = refs[name]
        task = Task(op.kind, args, layer=op.layer, seq=seq)
        for name in op.inputs.values():
            loc = location(g, slots, name)
            if loc is None or loc not in writer:
                continue
            wseq, wproc, wtask = writer[loc]
            if wproc != proc:
                _signal(wtask, (words[loc], wseq))
                _wait(task, (words[loc], wseq))
            readers.setdefault(loc, []).append((seq, proc, task))
        for name in op.outputs.values():
            loc = location(g, slots, name)
            for rseq, rproc, rtask in readers.get(loc, []):
                if rproc != proc:
                    _signal(rtask, (done_words[rproc], rseq))
                    _wait(task, (done_words[rproc], rseq))
            if loc in writer and writer[loc][1] != proc and not readers.get(loc):
                wseq, _, wtask = writer[loc]
                _signal(wtask, (words[loc], wseq))
                _wait(task, (words[loc], wseq))
            writer[loc], readers[loc] = (seq, proc, task), []
        tasks.setdefault(proc, []).append(task)
    prog = StepProgram(phase, bucket, tasks)
    prog.final = {p: ts[-1].seq for p, ts in tasks.items()}
    return prog


def _signal(task: Task, sig):
    if sig not in task.signals:
        task.signals.append(sig)


def _wait(task: Task, w):
    # keep only the strongest wait per word
    for k, (word, val) in enumerate(task.waits):
        if word == w[0]:
            task.waits[k] = (word, max(val, w[1]))
            return
    task.waits.append(w)
