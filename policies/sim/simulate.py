"""A discrete-event simulator that runs socllm's own step programs in virtual time on a simulated
SoC (policies/sim/soc.py). Every figure it gives is simulated.

Each processor runs its task list in order, as a processor actor does (actors/worker.py): a task
starts when the processor is free and every ready word it waits for has been signalled; a wait
on another processor's word costs the SoC's synchronization time (the pool's ready flags,
HeteroLLM §4.2, or a driver copy without them), and a GPU whose queue ran dry pays its
resubmission. A running task's duration is a roofline (policies/soc.task_time) whose memory part
depends on the bandwidth it gets: the processors that run at once share the SoC's total
bandwidth in proportion to what each would draw alone, never more than each reaches alone
(HeteroLLM §3.3), recomputed whenever a task starts or ends. Deterministic: no randomness, ties
in processor order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from socllm.graph.partition import DOMINANT
from socllm.graph.program import StepProgram
from socllm.graph.seqcut import part_rows

from .soc import WEIGHT_BYTES, SoC, task_time


@dataclass
class StepResult:
    seconds: float                                   # the step's makespan
    busy: dict = field(default_factory=dict)         # processor -> seconds running tasks
    bytes: dict = field(default_factory=dict)        # processor -> bytes moved
    syncs: int = 0                                   # cross-processor waits
    trace: list = field(default_factory=list)        # (processor, op, layer, start, end)

    @property
    def bandwidth(self) -> float:
        """Bytes per second over the step, all processors."""
        return sum(self.bytes.values()) / self.seconds if self.seconds else 0.0


@dataclass
class _Running:
    task: object
    compute_s: float
    nbytes: float
    overhead_s: float
    start: float
    done: float = 0.0           # fraction of the task completed


def simulate_step(prog: StepProgram, soc: SoC, n: int, pos0: int, fast_sync: bool = True,
                  trace: bool = False, weight_bytes: dict = WEIGHT_BYTES) -> StepResult:
    """One step of `prog` over n rows after pos0 cached ones; weight_bytes: bytes per weight of
    each weight ref (policies/soc.WEIGHTS)."""
    queues = {p: list(ts) for p, ts in prog.tasks.items() if ts and p in soc.processors}
    if set(queues) != {p for p, ts in prog.tasks.items() if ts}:
        missing = sorted({p for p, ts in prog.tasks.items() if ts} - set(soc.processors))
        raise ValueError(f"{soc.name} has no {', '.join(missing)} processor")
    signalled_by = {w: p for p, ts in queues.items() for t in ts for w, _ in t.signals}
    signals: dict = {}          # word -> [(value, time, processor)]
    sync = soc.sync_s if fast_sync else soc.sync_copy_s
    res = StepResult(0.0, dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0.0))
    free_at = dict.fromkeys(queues, 0.0)
    running: dict = {}          # processor -> _Running
    pending: dict = {}          # processor -> start time of its next task
    t = 0.0
    while any(queues.values()) or running:
        for p, q in queues.items():                          # start what can start
            if p in running or not q:
                continue
            start = pending.get(p)
            if start is None:
                start = _earliest(q[0], p, signals, signalled_by, free_at[p], sync, soc, res,
                                  DOMINANT.get(prog.phase))
                if start is None:
                    continue
                pending[p] = start
            if start <= t:
                task = q.pop(0)
                del pending[p]
                c, b = task_time(soc.processors[p], task.op, task.args,
                                 *part_rows(task.args, n, pos0), weight_bytes)
                running[p] = _Running(task, c, b, soc.processors[p].kernel_s, t)
        if not running:
            if not pending:
                raise RuntimeError("the program deadlocks: a task waits for a word nobody signals")
            t = min(pending.values())
            continue
        rates = _rates(running, soc)
        t_next = min(t + (1.0 - r.done) / rates[p] for p, r in running.items())
        t_next = min([t_next] + [s for s in pending.values() if s > t])
        for p, r in list(running.items()):
            r.done += rates[p] * (t_next - t)
            if r.done >= 1.0 - 1e-9:
                del running[p]
                res.busy[p] += t_next - r.start
                res.bytes[p] += r.nbytes
                free_at[p] = t_next
                for w, v in r.task.signals:
                    signals.setdefault(w, []).append((v, t_next, p))
                if trace:
                    res.trace.append((p, r.task.op, r.task.layer, r.start, t_next))
        t = t_next
    res.seconds = t
    return res


def _earliest(task, p, signals, signalled_by, free, sync, soc, res, dominant):
    """When `task` can start on p (None: a word it waits for is not signalled yet)."""
    start, crossed = free, False
    for w, v in task.waits:
        if w not in signalled_by:          # written before the step (the step's inputs)
            continue
        hit = [(tm, q) for val, tm, q in signals.get(w, ()) if val >= v]
        if not hit:
            return None
        tm, q = min(hit)
        if q != p:
            crossed = True
            start = max(start, tm + sync)
        else:
            start = max(start, tm)
    if crossed:
        res.syncs += 1
        if start > free and p != dominant:
            # it waited and its queue ran dry (HeteroLLM §3.1). The dominant processor's kernels
            # stay queued behind the wait (§4.2: "the inherent queue ordering guarantees
            # synchronization"), so only the other one pays the resubmission
            start += soc.processors[p].resubmit_s
    return start


def _rates(running: dict, soc: SoC) -> dict:
    """Fraction of its task each running processor completes per second, given the bandwidth
    it gets: alone, what its roofline draws (at most what it reaches alone); together, shares
    of the SoC's total in proportion to those draws."""
    alone = {}
    for p, r in running.items():
        bw = soc.processors[p].bandwidth
        alone[p] = (max(r.compute_s, r.nbytes / bw) if r.nbytes else r.compute_s, bw)
    draw = {p: (r.nbytes / alone[p][0] if alone[p][0] > 0 else 0.0) for p, r in running.items()}
    total = sum(draw.values())
    scale = min(1.0, soc.bandwidth_total / total) if total > 0 else 1.0
    rates = {}
    for p, r in running.items():
        mem = r.nbytes / (draw[p] * scale) if r.nbytes and draw[p] > 0 else 0.0
        rates[p] = 1.0 / max(max(r.compute_s, mem) + r.overhead_s, 1e-12)
    return rates
