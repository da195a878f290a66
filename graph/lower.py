"""Lowering: a graph + a placement -> one StepProgram (one task list per processor).

Every tensor is resolved to where it lives (the caller's `refs`). Cross-processor hazards become
waits and signals on ready words (DESIGN.md §3):
  read after write   the producer signals the location's ready word, the consumer waits for it;
  write after read   the reader signals its processor's done word, the overwriting writer waits;
  write after write  the later writer waits for the earlier one's location word.
Same-processor order is program order, so it needs nothing. The halves of a row-cut
(graph/partition.py) write disjoint columns of one location: no order between them, and a reader
waits for every half made elsewhere. Stamps are task positions in the
global order (1-based); the worker adds the step's epoch base at run time.
"""
from __future__ import annotations

from .ir import Graph
from .liveness import SlotPlan
from .program import StepProgram, Task, cut_rows
from .seqcut import SEP


def location(g: Graph, slots: SlotPlan, name: str) -> str | None:
    kind = g.tensors[name].kind
    if kind == "act":        # a sequence-cut part's rows of a slot are a location of their own
        base, sep, lo = name.partition(SEP)
        return f"slot.{slots.assign[base]}{sep}{lo}"
    if kind == "weight":
        return None
    return name  # kv caches and io tensors are their own locations


def lower(g: Graph, slots: SlotPlan, refs: dict, words: dict, done_words: dict, place,
          phase: str, bucket: int) -> StepProgram:
    """refs: tensor name -> ref tuple (act tensors: by slot, see `slot_ref`); words: location ->
    ready word; done_words: processor -> its done word; place: Op -> processor name."""
    tasks: dict = {}
    writers: dict = {}       # location -> [(seq, proc, task)]: the last write (several: a row-cut)
    readers: dict = {}       # location -> [(seq, proc, task)] since the last write
    before: dict = {}        # location -> (readers, writers) of the value the last write replaced
    for i, op in enumerate(g.ops):
        seq, proc = i + 1, place(op)
        args = {k: v for k, v in op.attrs.items() if k not in ("on", "rows")}
        for role, name in {**op.inputs, **op.outputs}.items():
            args[role] = refs[name]
        rows = op.attrs.get("rows")
        if rows is not None:
            args = cut_rows(args, *rows)
        task = Task(op.kind, args, layer=op.layer, seq=seq, rows=rows)
        def after_writes(ws, loc):
            """order this task after the writers ws of loc made on other processors"""
            for wseq, wproc, wtask in ws:
                if wproc != proc:
                    # a row-cut half signals its processor's done word: halves finish in any
                    # order, and one word stored by two processors could go backwards
                    _after(task, wtask, done_words[wproc] if wtask.rows else words[loc], wseq)
        for name in op.inputs.values():
            loc = location(g, slots, name)
            after_writes(writers.get(loc, []), loc)
            if loc in writers:
                readers.setdefault(loc, []).append((seq, proc, task))
        for name in op.outputs.values():
            loc = location(g, slots, name)
            # the second half of a row-cut orders itself after what the first one overwrote
            sibling = rows is not None and i > 0 and g.ops[i - 1].attrs.get("rows") is not None \
                and g.ops[i - 1].outputs == op.outputs
            if not sibling:
                before[loc] = (readers.get(loc, []), writers.get(loc, []))
            old_readers, old_writers = before[loc]
            for rseq, rproc, rtask in old_readers:
                if rproc != proc:
                    _after(task, rtask, done_words[rproc], rseq)
            if not old_readers:
                after_writes(old_writers, loc)
            writers[loc] = (writers[loc] if sibling else []) + [(seq, proc, task)]
            readers[loc] = []
        tasks.setdefault(proc, []).append(task)
    prog = StepProgram(phase, bucket, tasks)
    prog.final = {p: ts[-1].seq for p, ts in tasks.items()}
    return prog


def _after(task: Task, dep: Task, word: int, seq: int):
    """task waits for dep: dep stores seq into word when done, task waits for word >= seq."""
    _signal(dep, (word, seq))
    _wait(task, (word, seq))


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
