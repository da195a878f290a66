"""Scheduling policies: which requests run next. Pure: no Ray, no kernels (DESIGN.md §5).

A policy sees requests arrive (`add`), end (`finish`) and is asked each iteration what to run
(`schedule`). The service's loop is: schedule -> run -> postprocess (nano-vllm's engine step).
The agent-scheduling issue replaces FCFS with a priority policy through the same three calls.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request


@dataclass
class Batch:
    prefill: list = field(default_factory=list)    # [Request] admitted this iteration
    decode: list = field(default_factory=list)     # [Request] running, one token each

    def __bool__(self):
        return bool(self.prefill or self.decode)


class FCFS:
    """First come, first served: two queues, admission in arrival order while there is room.

    max_seqs: requests running at once (the decode batch's cap); kv_rows: KV rows the pool holds
    for running requests. A request reserves prompt + max_tokens rows when admitted, so a running
    request never runs out of KV; one that can never fit is refused by `check` before it queues.
    """

    name = "fcfs"

    def __init__(self, max_seqs: int, kv_rows: int):
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        self.max_seqs, self.kv_rows = max_seqs, kv_rows
        self.waiting: deque = deque()
        self.running: list = []

    def need(self, req: Request) -> int:
        return len(req.prompt) + req.params.max_tokens

    def check(self, req: Request):
        """Raise ValueError for a request that could never run (it would wait forever)."""
        if self.need(req) > self.kv_rows:
            raise ValueError(f"the prompt ({len(req.prompt)} tokens) plus max_tokens "
                             f"({req.params.max_tokens}) needs {self.need(req)} KV rows; "
                             f"the context holds {self.kv_rows}")

    def add(self, req: Request):
        self.check(req)
        self.waiting.append(req)

    def used(self) -> int:
        return sum(self.need(r) for r in self.running)

    def schedule(self) -> Batch:
        batch = Batch(decode=[r for r in self.running])
        while self.waiting and len(self.running) < self.max_seqs:
            req = self.waiting[0]
            if self.used() + self.need(req) > self.kv_rows:
                break                      # in order: a later, smaller request does not jump it
            self.waiting.popleft()
            self.running.append(req)
            batch.prefill.append(req)
        return batch

    def finish(self, req: Request):
        """A request ended (finished, cancelled or failed): it leaves whichever queue holds it."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def queues(self) -> dict:
        return {"waiting": [r.id for r in self.waiting], "running": [r.id for r in self.running]}


POLICIES = {"fcfs": FCFS}
