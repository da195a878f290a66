"""The service's loop (Agent.xpu §4.1, §4.3): schedule -> run -> postprocess, on its own thread.

Each iteration runs one prefill chunk of the first request that needs one (prefill runs singly,
in chunks) and then one decode step of every prefilled request (continuous batching: requests
join and leave the batch at every step), through actors/runner.py; the sampled tokens become the
requests' text, and requests end where they end. A mixin of the Service actor (actors/service.py),
whose request table, scheduler, runner and streams it uses.
"""
from __future__ import annotations

import time
import traceback

from socllm.policies.request import Request

from .runner import ProcessorLost

KEEP_ENDED = 256              # ended requests kept in the table for late polls and status


class ServingLoop:
    def _serve(self):
        """Each iteration: one prefill chunk of the first request that needs one (Agent.xpu
        §4.3: prefill runs singly, in chunks), then one decode step of every prefilled request
        (continuous batching: requests join and leave the batch at every step)."""
        stopped = False         # the last iteration stopped a chunk for a reactive arrival
        next_check = 0.0        # when to look for dead processor actors next
        while not self.stopping:
            with self.cv:
                for req in [r for r in self.scheduler.running if r.id in self.cancelled]:
                    self._end(req, "cancelled", "cancelled")
                for req in [r for r in self.scheduler.running if r.id in self.abandoned_ids]:
                    self._end(req, "cancelled", "abandoned")
                batch = self.scheduler.schedule()
                for req in batch.preempted:
                    req.state = "waiting"
                    if req.id in self.slot:      # admitted earlier (not in this schedule)
                        self.slots.append(self.slot.pop(req.id))
                if not batch:
                    self.doing = "idle"
                    self.cv.wait(0.5)
                for req in self.scheduler.running:
                    if req.id not in self.slot:
                        self.slot[req.id] = self.slots.pop()
            if not batch or time.monotonic() >= next_check:    # a death outside the steps
                next_check = time.monotonic() + 1.0               # (idle, or an unused actor)
                self._cancel_abandoned()
                lost = self.engine.lost()
                if lost:
                    self._recover(lost, [])
                    continue
            if not batch:
                continue
            step = [batch.prefill[0]] if batch.prefill else []
            try:
                if batch.prefill and self._prefill(batch.prefill) and not stopped:
                    stopped = True             # stopped for a reactive arrival: schedule it
                    self.last_step = time.monotonic()
                    continue                   # now (once: decode runs if it could not start)
                stopped = False
                step = batch.decode
                if batch.decode:
                    self._decode(batch.decode)
                self.last_step = time.monotonic()
            except ProcessorLost as ex:     # redone at the next iteration, once it is back
                self._recover(ex.names, step)
            except Exception as ex:   # one bad step fails its requests, never the service
                traceback.print_exc()
                self._fail(step, ex)

    def _cancel_abandoned(self):
        """Cancel the running requests whose client is gone: no poll open and none for
        abandon_s (policies/config.py ServeConfig)."""
        now, limit = time.monotonic(), self.config.abandon_s
        with self.cv:
            for req in self.scheduler.running:
                polled = self.polled.get(req.id)
                if polled is not None and not polled[0] and now - polled[1] > limit:
                    self.abandoned_ids.add(req.id)
                    self.abandoned += 1

    def _fail(self, step: list, ex: Exception):
        if self.part is not None:
            step, self.part = [*step, self.part["req"]], None
        for req in {r.id: r for r in step}.values():
            if not req.ended:
                self._end(req, "failed", "error", f"{type(ex).__name__}: {ex}")

    def _recover(self, names: list, step: list):
        """A processor actor died inside a step (DESIGN.md §5): Ray restarts it and its
        constructor attaches the pool again; the programs are installed in it again and the loop
        goes on. Nothing of the lost step was accepted, so the next iteration redoes it: it
        rewrites the same KV rows with the same values, and the KV of earlier steps is in the pool,
        which outlived the process. A chunk suspended between layers starts over (a span cut
        short may have updated its activations in place)."""
        t0 = time.monotonic()
        self.part = None
        try:
            restart_s = self.engine.revive(names)
            self.runner.reinstall()
        except Exception as ex:
            traceback.print_exc()
            self._fail(step, ex)
            return
        now = time.monotonic()
        self.recoveries.append({"processors": names, "at": time.time(), "restart_s": round(restart_s, 2),
                                "recovery_s": round(now - t0, 2),
                                # from the end of the last step that ran to now: the service's gap
                                "stalled_s": round(now - self.last_step, 2) if step else None})

    def _prefill(self, ready: list) -> bool:
        """One prefill chunk of the first request in `ready` (the policy's order). A policy with
        a slice_s runs proactive chunks in the second activation buffer, a span of layers at a
        time, and stops between spans when it says a reactive request waits; the chunk resumes
        at a later iteration (unless its request lost its blocks meanwhile). Returns True if
        the chunk stopped before its end."""
        req, part = ready[0], self.part
        if part is not None and (part["req"].ended or part["key"] != self._chunk_key(part["req"])
                                 or part["req"] not in self.scheduler.running):
            part = self.part = None          # ended, cancelled or preempted: its rows are gone
        if part is not None and part["req"] in ready and req.priority != "reactive":
            req = part["req"]                # a suspended chunk goes on before newer ones
        if part is not None and part["req"] is not req and req.priority != "reactive":
            # an aged chunk while the second buffer holds one the policy defers: the deferred one
            # gives up its buffer and starts over later (at most one chunk's work), so that no
            # proactive chunk ever runs whole where a reactive arrival would wait for all of it
            part = self.part = None
        # reactive chunks run whole in the first buffer
        if self.scheduler.slice_s is None or req.priority == "reactive" or not self.runner.meta[1:]:
            self._prefill_chunk(req)
            return False
        return self._prefill_spans(req)

    def _chunk_key(self, req: Request) -> tuple:
        return req.computed, self.slot.get(req.id), tuple(req.blocks)

    def _start_chunk(self, req: Request, rows_max: int) -> tuple:
        seq = req.prompt + req.tokens     # a preempted request prefills its tokens too
        lo = req.computed
        hi = min(len(seq), lo + rows_max)
        req.state = "prefilling"
        if req.prefill_start is None:
            req.prefill_start = time.monotonic()
            self.metrics.prefill_started(req)
        s = self.slot[req.id]
        return [(seq[i], i, s) for i in range(lo, hi)], hi == len(seq)

    def _end_chunk(self, req: Request, rows: list, last: bool, logits, t0: float):
        req.computed += len(rows)
        if last:
            self._accept(req, self.streams[req.id][2](logits[0]))
        self.loop_times["prefill_chunks"] += 1
        self.loop_times["prefill_s"] += time.perf_counter() - t0

    def _prefill_chunk(self, req: Request):
        t0 = time.perf_counter()
        rows, last = self._start_chunk(req, self.config.prefill_chunk)
        self.doing = f"chunk {req.priority} {len(rows)}"
        # the plan's chunk program where it takes these rows (runner.py), else the base processor
        logits = self.runner.step(rows, {rows[0][2]: req.blocks}, all_rows=False)
        self._end_chunk(req, rows, last, logits, t0)

    def _prefill_spans(self, req: Request) -> bool:
        """Agent.xpu §4.4 ②: spans of about slice_s (the per-stage time learned from earlier
        spans), a check for a reactive arrival after each."""
        t0 = time.perf_counter()
        if self.part is None:
            rows, last = self._start_chunk(req, self.runner.lay.double_rows)
            self.part = {"req": req, "rows": rows, "last": last, "stage": 0,
                         "key": self._chunk_key(req)}
        part, stages = self.part, self.runner.stages
        rows = part["rows"]
        while True:
            lo = part["stage"]
            k = max(1, int(self.scheduler.slice_s / max(1e-6, self.stage_s * len(rows))))
            hi = min(stages, lo + k)
            t = time.perf_counter()
            self.doing = f"span {req.priority} {len(rows)} {lo}-{hi}"
            logits = self.runner.step(rows, {rows[0][2]: req.blocks}, all_rows=False, buffer=1,
                                      span=(lo, hi))
            per = (time.perf_counter() - t) / ((hi - lo) * len(rows))
            self.stage_s += 0.3 * (per - self.stage_s)       # seconds per stage and row
            part["stage"] = hi
            if hi == stages:
                break
            if self.scheduler.preempts_prefill():
                self.loop_times["prefill_s"] += time.perf_counter() - t0
                self.loop_times["prefill_stops"] += 1
                return True
        self.part = None
        self._end_chunk(req, rows, part["last"], logits, t0)
        return False

    def _decode(self, batch: list):
        rows = [(r.tokens[-1], r.computed, self.slot[r.id]) for r in batch]
        self.doing = f"decode {len(rows)}"
        t0 = time.perf_counter()
        logits = self.runner.step(rows, {self.slot[r.id]: r.blocks for r in batch}, all_rows=True)
        t1 = time.perf_counter()
        for i, req in enumerate(batch):
            req.computed += 1
            self._accept(req, self.streams[req.id][2](logits[i]))
        t = self.loop_times
        t["decode_steps"] += 1
        t["decode_rows"] += len(batch)
        t["decode_kernels_s"] += t1 - t0
        t["decode_s"] += time.perf_counter() - t0

    def _accept(self, req: Request, tok: int):
        """Postprocess one sampled token: stream its text, end the request where it ends."""
        now = time.monotonic()
        if req.first_token is None:
            req.first_token = now
        req.state = "decoding"
        self.metrics.token(req, now)
        self.token_times.append(now)
        req.tokens.append(tok)
        dec, stops, _ = self.streams[req.id]
        e = self.engine
        if tok in e.stop_ids and not req.ignore_eos:
            reason = "stop"
        else:
            self._emit(req, stops.feed(dec.feed(tok)))
            reason = "stop" if stops.hit else "length" if (
                len(req.tokens) >= req.params.max_tokens or req.rows >= e.context) else None
        if reason:
            if not stops.hit:
                self._emit(req, stops.feed(dec.flush()) + stops.flush())
            with self.cv:
                self._end(req, "finished", reason)

    def _emit(self, req: Request, piece: str):
        if piece:
            req.text += piece
            self.pieces[req.id].append(piece)
            self._wake(req.id)

    def _end(self, req: Request, state: str, reason: str, error: str | None = None):
        """End a request: its blocks and its row of the block tables are free at once."""
        with self.cv:
            req.end(state, reason, error)
            self.scheduler.finish(req)
            if req.id in self.slot:
                self.slots.append(self.slot.pop(req.id))
            self.cancelled.discard(req.id)
            self.abandoned_ids.discard(req.id)
            self.streams.pop(req.id, None)
            self.polled.pop(req.id, None)
            self.metrics.ended(req)
            ended = [r for r in self.table.values() if r.ended]
            for old in ended[:max(0, len(ended) - KEEP_ENDED)]:
                for d in (self.table, self.pieces, self.events):
                    d.pop(old.id, None)
        self._wake(req.id)

    def _wake(self, rid: int):
        ev, loop = self.events.get(rid), self.loop
        if ev is not None and loop is not None:
            loop.call_soon_threadsafe(ev.set)
