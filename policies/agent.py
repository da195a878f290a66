"""Agent.xpu's reactive-first scheduling (§4.4-4.5) as a policy: pure, no Ray, no kernels.

Two priority classes, each with its own queue for both phases: `reactive` (a person waits) and
`proactive` (background agents). Through FCFS's three calls (add / schedule / finish):

  prefill   reactive requests first (oldest first), then aged proactive, then proactive. A
            proactive chunk runs in the pool's second activation buffer, a span of layers of
            about SLICE_S at a time (§4.4 ②); a reactive arrival stops it at the next span's end,
            its prefill runs in the first buffer, and the proactive chunk then resumes at the
            layer where it stopped: nothing recomputed, no activation copied (§4.4 ①).
            While a reactive request runs (prefills or decodes), plain proactive prefill is
            deferred (§4.3 ⑤: lower-priority work waits where the pipelines contend; here both
            share the same cores, so there is no compute slack to piggyback on).
  decode    homogeneous batches take everyone; a batch mixing the classes is capped at b_rf rows
            (chosen from this device's decode profile by b_rf_from_profile, else B_RF):
            every reactive row, then proactive rows that are not evicted (aged ones bypass the
            cap). Evicted first (§4.5 ②): the longest sequences, then the newest arrivals.
            Evicted rows keep their KV and wait for the next iteration. The profile is taken at
            position 0, and a step's time grows with its rows' lengths too (§4.5 ②: "with both
            batch size and request sequence length"): with a StepModel (the profile plus the
            cost of each key attended, learned from the steps that ran), a proactive row also
            joins only while the predicted step stays within the slowdown of the step without
            it.
  admission reactive first; a reactive request that finds every sequence slot taken preempts the
            newest proactive one, decoding or not (its blocks are given back; it prefills its
            prompt and tokens again later).
  aging     a proactive request with no progress for AGING_S (no token since it arrived, or
            since its latest one) is promoted (§4.5 ③): it prefills before the other proactive
            ones and joins a decode batch beyond the cap.
"""
from __future__ import annotations

import time
from collections import deque

from .request import Request
from .scheduler import FCFS, Batch

B_RF = 3          # rows of a batch mixing the classes: Agent.xpu's value, where there is no profile
# §4.5 ②: proactive rows join a reactive batch "only when their marginal impact on reactive latency
# is accepted": here, while the step stays within this share of a one-row step's time
REACTIVE_SLOWDOWN = 0.25
AGING_S = 30.0    # seconds without progress after which a proactive request is promoted
SLICE_S = 0.02    # a proactive prefill chunk's span of layers: a reactive arrival waits for one
# the longest a reactive arrival should wait for the work it preempts (arrival -> its first prefill
# kernel): no piece of proactive work that cannot stop midway may take longer. Proactive chunks
# run as GPU spans of SLICE_S; a whole NPU chunk graph cannot stop midway, so a proactive chunk
# runs there only where such chunks took at most this (a prompt's first chunk in the NPU's
# whole-model graph: 44 ms for 128 rows on the 2-core Xeon VM, actors/engine.py
# _whole_within_bound); reactive chunks run there whole (no reactive request preempts another)
PREEMPT_BOUND_S = 0.05


def b_rf_from_profile(step_s: dict, slowdown: float = REACTIVE_SLOWDOWN) -> int:
    """The largest batch whose decode step (step_s: rows -> seconds, measured on this device)
    takes at most (1 + slowdown) times a one-row step: a reactive stream decodes at most that
    much slower for the proactive rows it carries."""
    if not step_s or 1 not in step_s:
        return B_RF
    limit, b_rf = (1 + slowdown) * step_s[1], 1
    for b in sorted(step_s):
        if step_s[b] > limit:
            break                       # every size up to the cap must stay within the limit
        b_rf = b
    return b_rf


class StepModel:
    """A decode step's seconds: the profile's step of n rows at position 0 (step_s: n -> s) plus
    c s for each key the rows attend past the first (their lengths), c learned from the steps
    that ran (observe: least squares of the residual over the extra keys, recent steps weighing
    more). predict is None until WARM steps with keys have been seen."""

    WARM = 20

    def __init__(self, step_s: dict, decay: float = 0.99):
        self.step_s, self.decay = dict(step_s), decay
        self.sxy = self.sxx = 0.0
        self.seen = 0

    def observe(self, rows: int, keys: int, seconds: float):
        base = self.step_s.get(rows)
        x = keys - rows
        if base is None or x <= 0:
            return
        self.sxy = self.decay * self.sxy + x * (seconds - base)
        self.sxx = self.decay * self.sxx + x * x
        self.seen += 1

    @property
    def per_key(self) -> float | None:
        return max(0.0, self.sxy / self.sxx) if self.seen >= self.WARM and self.sxx > 0 else None

    def predict(self, rows: int, keys: int) -> float | None:
        c, base = self.per_key, self.step_s.get(rows)
        return None if c is None or base is None else base + c * max(0, keys - rows)


class AgentPolicy(FCFS):
    name = "agent"

    def __init__(self, max_seqs: int, context: int, kv, b_rf: int = B_RF,
                 aging_s: float = AGING_S, clock=time.monotonic, profile: dict | None = None):
        """profile: the decode profile b_rf came from (rows -> seconds), for the StepModel."""
        super().__init__(max_seqs, context, kv)
        if b_rf < 1 or aging_s <= 0:
            raise ValueError(f"b_rf must be >= 1 and aging_s > 0, got {b_rf}, {aging_s}")
        self.b_rf, self.aging_s, self.clock = b_rf, aging_s, clock
        self.model = StepModel(profile) if profile and 1 in profile else None
        self.reactive: deque = deque()        # waiting, per class (FCFS's `waiting` is unused)
        self.proactive: deque = deque()

    slice_s, bound_s = SLICE_S, PREEMPT_BOUND_S

    def preempts_prefill(self) -> bool:
        """A reactive request waits: the proactive chunk stops at its span's end (§4.4 ②)."""
        return bool(self.reactive)

    def urgent(self, req: Request) -> bool:
        """Reactive, or proactive past the aging threshold: no progress for aging_s (since its
        arrival, or its latest token once it has one). §4.5 ③ guards against indefinite
        postponement; a proactive row that decodes, only more slowly for being left out of
        reactive steps, is not postponed, and promoting it would put it back in them (measured:
        rows of requests over 30 s old but decoding filled the steps of a reactive reply, 45 ms
        a token against ~15)."""
        return req.priority == "reactive" or self.clock() - (req.last_token or req.arrival) > self.aging_s

    def add(self, req: Request):
        self.check(req)
        (self.reactive if req.priority == "reactive" else self.proactive).append(req)

    def schedule(self) -> Batch:
        batch = Batch()
        decoding = [r for r in self.running if r.prefilled]
        for req in sorted(decoding, key=lambda r: not self.urgent(r)):   # urgent ones grow first
            if req not in self.running:
                continue
            while not self.kv.can_grow(req.blocks, req.rows):
                victim = self._newest(lambda r: r is not req and not self.urgent(r)) or \
                    self._newest(lambda r: r is not req)
                if victim is None:
                    break
                batch.preempted.append(self._preempt(victim))
            if self.kv.can_grow(req.blocks, req.rows):
                self.kv.grow(req.blocks, req.rows)
                batch.decode.append(req)
            else:
                batch.preempted.append(self._preempt(req))
        batch.decode = self._cap([r for r in batch.decode if r in self.running])
        self._admit(batch)
        prefill = [r for r in self.running if not r.prefilled]
        if any(r.priority == "reactive" for r in self.running):
            # §4.3 ⑤: prefill and decode share these cores, so lower-priority prefill waits
            # while reactive work runs (aged requests excepted, §4.5 ③)
            prefill = [r for r in prefill if self.urgent(r)]
        batch.prefill = sorted(prefill, key=lambda r: (r.priority != "reactive", not self.urgent(r),
                                                        r.arrival))
        return batch

    def _admit(self, batch: Batch):
        """Waiting requests into the running set: reactive, then aged proactive, then the rest,
        in arrival order within each; the first that does not fit stops admission (nothing
        smaller jumps it). A reactive request that finds every sequence slot taken preempts the
        newest plain proactive one, one outside this step's decode batch if there is one, else
        one taken out of it (a slot is a row of the block tables: a reactive request must not
        wait seconds for a proactive one to end). An aged one waits for a slot: Agent.xpu gives
        it precedence, not the power to preempt."""
        aged = [r for r in self.proactive if self.urgent(r)]
        for req in [*self.reactive, *aged, *(r for r in self.proactive if r not in aged)]:
            if req in batch.preempted:
                break                     # the KV ran dry this step: nobody new starts
            if len(self.running) >= self.max_seqs and req.priority == "reactive":
                victim = self._newest(lambda r: not self.urgent(r) and r not in batch.decode) or \
                    self._newest(lambda r: not self.urgent(r))
                if victim is not None:
                    batch.preempted.append(self._preempt(victim))
                    if victim in batch.decode:
                        batch.decode.remove(victim)
            if len(self.running) >= self.max_seqs or not self._admit_kv(req):
                break
            (self.reactive if req.priority == "reactive" else self.proactive).remove(req)
            self.running.append(req)

    def _cap(self, rows: list) -> list:
        """Reactive-first batching (§4.5 ②): a batch holding both classes keeps its reactive and
        aged rows and fills up to b_rf rows with proactive ones, evicting the longest first, then
        the newest; a batch of one class takes everyone."""
        reactive = [r for r in rows if r.priority == "reactive"]
        aged = [r for r in rows if r.priority != "reactive" and self.urgent(r)]
        rest = [r for r in rows if not self.urgent(r)]
        if not reactive or not (aged or rest):
            return rows
        keep = sorted(rest, key=lambda r: (r.rows, r.arrival))[:max(0, self.b_rf - len(reactive))]
        keep = self._within(reactive + aged, keep)
        return [r for r in rows if r in reactive or r in aged or r in keep]

    def _within(self, base: list, cands: list) -> list:
        """The leading cands whose rows keep the predicted step within REACTIVE_SLOWDOWN of the
        step of base's rows alone (all of them without a model yet)."""
        model = self.model
        n, keys = len(base), sum(r.rows for r in base)
        alone = model.predict(n, keys) if model else None
        if alone is None:
            return cands
        for k, r in enumerate(cands):
            t = model.predict(n + k + 1, keys + r.rows)
            if t is None or t > (1 + REACTIVE_SLOWDOWN) * alone:
                return cands[:k]
            keys += r.rows
        return cands

    def observe(self, rows: int, keys: int, seconds: float):
        """A decode step ran: rows, the keys its rows attended (their positions + 1), seconds."""
        if self.model is not None:
            self.model.observe(rows, keys, seconds)

    def _newest(self, which) -> Request | None:
        cands = [r for r in self.running if which(r)]
        return max(cands, key=lambda r: r.arrival) if cands else None

    def _preempt(self, req: Request) -> Request:
        self.running.remove(req)
        self.kv.release(req.blocks, req.names, req.ids, req.computed)
        req.computed, req.lag = 0, 0
        (self.reactive if req.priority == "reactive" else self.proactive).appendleft(req)
        return req

    def finish(self, req: Request):
        for q in (self.reactive, self.proactive):
            if req in q:
                q.remove(req)
        super().finish(req)

    def queues(self) -> dict:
        return {"waiting_reactive": [r.id for r in self.reactive],
                "waiting_proactive": [r.id for r in self.proactive],
                "waiting": [r.id for r in (*self.reactive, *self.proactive)],
                "running": [r.id for r in self.running]}


POLICIES = {"fcfs": FCFS, "agent": AgentPolicy}     # socllm serve --policy
