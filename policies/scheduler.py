"""Scheduling policies: which requests run next. Pure: no Ray, no kernels (DESIGN.md §5).

A policy sees requests arrive (`add`), end (`finish`) and is asked each iteration what to run
(`schedule`). The service's loop is: schedule -> run -> postprocess (nano-vllm's engine step).
policies/agent.py's priority policy works through the same three calls.

The KV cache is paged (memory/blocks.py, passed in as `kv`): a request takes the blocks of its
prompt when it is admitted (`_admit_kv`: first the prefix cache's blocks that already hold its
leading rows, which it does not prefill, then blank ones) and one more block whenever decode
crosses into one. When the pool runs dry, the newest running request is preempted: its blocks are
given back and it waits again at the head of the queue, to be prefilled anew (prompt and the
tokens it has, from the prefix cache where its blocks are still there) when blocks free.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Request
from .sampling import BadParam


@dataclass
class Batch:
    prefill: list = field(default_factory=list)    # [Request] whose rows still need a prefill
    decode: list = field(default_factory=list)     # [Request] that decode one token this step
    preempted: list = field(default_factory=list)  # [Request] that gave their blocks back

    def __bool__(self):
        return bool(self.prefill or self.decode)


class FCFS:
    """First come, first served: a waiting queue and the running set, admission in arrival order.

    max_seqs: requests running at once (the decode batch's cap); context: rows one request may
    hold; kv: the block pool (memory.blocks.BlockPool)."""

    name = "fcfs"
    slice_s = None       # prefill chunks run whole (policies/agent.py runs them in spans)
    bound_s = None       # the longest piece of work that cannot stop (policies/agent.py)

    def __init__(self, max_seqs: int, context: int, kv):
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        self.max_seqs, self.context, self.kv = max_seqs, context, kv
        self.waiting: deque = deque()
        self.running: list = []

    def observe(self, rows: int, keys: int, seconds: float):
        """A decode step ran (rows, the keys they attended, seconds): FCFS needs no cost."""

    def check(self, req: Request):
        """Raise ValueError for a request that could never run (it would wait forever)."""
        need = len(req.prompt) + req.params.max_tokens
        limit = min(self.context, self.kv.n_blocks * self.kv.block_rows)
        if need > limit:
            raise BadParam("max_tokens", f"({req.params.max_tokens}) plus the prompt ({len(req.prompt)} "
                                         f"tokens) needs {need} KV rows; the context holds {limit}")

    def add(self, req: Request):
        self.check(req)
        self.waiting.append(req)

    def schedule(self) -> Batch:
        batch = Batch()
        for req in list(self.running):
            if req not in self.running or not req.prefilled:
                continue                    # preempted below, or still prefilling
            while not self.kv.can_grow(req.blocks, req.rows) and self.running[-1] is not req:
                batch.preempted.append(self._preempt(self.running[-1]))
            if self.kv.can_grow(req.blocks, req.rows):
                self.kv.grow(req.blocks, req.rows)
                batch.decode.append(req)
            else:
                batch.preempted.append(self._preempt(req))
        batch.decode = [r for r in batch.decode if r in self.running]
        while self.waiting and len(self.running) < self.max_seqs and not batch.preempted:
            req = self.waiting[0]
            if not self._admit_kv(req):
                break                      # in order: a later, smaller request does not jump it
            self.running.append(self.waiting.popleft())
        batch.prefill = [r for r in self.running if not r.prefilled]
        return batch

    def _admit_kv(self, req: Request) -> bool:
        """A waiting request's blocks: those of the prefix cache holding its leading rows (their
        rows count as computed), then blank ones for the rest. False, holding nothing, if the
        rest does not fit."""
        # a request that asks every prompt row's output (prompt_logprobs, an embedding)
        # computes every row
        found = self.kv.match(req.blocks, req.names, req.ids, req.rows) if not req.every_row else 0
        if not self.kv.can_grow(req.blocks, req.rows):
            self.kv.release(req.blocks, req.names)
            return False
        self.kv.grow(req.blocks, req.rows)
        req.computed, req.lag = found, 0
        if not req.tokens:                 # a first admission (a preempted one is counted once)
            req.cached = found
            self.kv.count(len(req.prompt), found)
        return True

    def _preempt(self, req: Request) -> Request:
        self.running.remove(req)
        self.kv.release(req.blocks, req.names, req.ids, req.computed)
        req.computed, req.lag = 0, 0
        self.waiting.appendleft(req)
        return req

    def preempts_prefill(self) -> bool:
        """Whether a request waits that should stop a prefill chunk at its next span: none here."""
        return False

    def finish(self, req: Request):
        """A request ended (finished, cancelled or failed): it leaves its queue, its blocks free."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req.blocks, req.names, req.ids, req.computed)

    def queues(self) -> dict:
        return {"waiting": [r.id for r in self.waiting], "running": [r.id for r in self.running]}
