"""The socllm service: one detached, named Ray actor that owns the engine and the request table.

`socllm serve` creates it in the "socllm" namespace; every client on the device (the CLI, Python
jobs through `socllm.connect()`, the HTTP ingress) finds it by name, so one copy of the weights
serves them all and it outlives the command that started it. Inside, the engine's pool, planner
and processor actors are created by this actor (they live and die with it), and one thread runs
the loop of Agent.xpu §4.1: schedule -> run -> postprocess. Clients submit a request (one Ray
call), then long-poll for its text (one Ray call per batch of pieces, never one per token:
DESIGN.md §5), and cancel it by id.
"""
from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
import traceback

import ray

from socllm.policies.request import Request, StopText, check_priority
from socllm.policies.sampling import SamplingParams
from socllm.policies.scheduler import POLICIES

NAMESPACE, NAME = "socllm", "service"
STATE_KEYS = ("waiting", "prefilling", "decoding", "finished", "cancelled", "failed")
KEEP_ENDED = 256              # ended requests kept in the table for late polls and status


@ray.remote(num_cpus=0, max_concurrency=1000)
class Service:
    def __init__(self, model: str | None = None, context: int = 2048, max_seqs: int = 16,
                 policy: str = "fcfs", plan: str | None = None, precision: str | None = None,
                 threads: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.opts = dict(model=model, context=context, max_seqs=max_seqs, policy=policy, plan=plan,
                         precision=precision, threads=threads)
        self.table: dict = {}                 # id -> Request
        self.pieces: dict = {}                # id -> [text piece]: what polls hand out
        self.events: dict = {}                # id -> asyncio.Event, set when a request changes
        self.cancelled: set = set()
        self.results: dict = {}               # id -> the engine's plan, placement and timings
        self.frontends: dict = {}             # name -> (pid, url)
        self.started = time.time()
        self.token_times: collections.deque = collections.deque()   # for tokens/s over a minute
        self.engine, self.error, self.loop = None, None, None
        self.ids = iter(range(1, 1 << 62))
        self.cv = threading.Condition()
        self.ready_event = threading.Event()
        self.stopping = False
        from .metrics import ServiceMetrics
        self.metrics = ServiceMetrics()
        threading.Thread(target=self._main, name="socllm-service", daemon=True).start()

    # -- start-up ------------------------------------------------------------------------------
    def _main(self):
        try:
            from .engine import Engine
            o = self.opts
            self.engine = Engine(model=o["model"], context=o["context"], threads=o["threads"])
            self.plan, self.precision = self.engine._check(o["plan"], o["precision"])
            # the decode program (and its kernels / graphs) before the first request, not in it
            self.engine.prepare(self.plan, self.precision, buckets=())
            # one generation at a time owns the pool's KV region (paged KV: the serving issue)
            self.scheduler = POLICIES[o["policy"]](min(o["max_seqs"], 1), self.engine.context)
        except BaseException as e:    # said by ready(), once; the actor stays for it to be read
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self.ready_event.set()
            return
        self.ready_event.set()
        self._serve()

    async def ready(self, timeout_s: float = 600.0) -> dict:
        """Waits until the model is loaded and the actors run; raises the start-up error."""
        self.loop = asyncio.get_running_loop()
        ok = await asyncio.to_thread(self.ready_event.wait, timeout_s)
        if self.error:
            raise RuntimeError(self.error)
        if not ok:
            raise TimeoutError(f"the service did not start within {timeout_s:.0f} s")
        return self.describe()

    def describe(self) -> dict:
        e = self.engine
        return {"model": os.path.basename(e.model_path), "model_path": e.model_path,
                "context": e.context, "plan": self.plan, "precision": self.precision,
                "policy": self.scheduler.name, "max_seqs": self.opts["max_seqs"],
                "running_cap": self.scheduler.max_seqs, "pid": os.getpid(),
                "frontends": {k: v[1] for k, v in self.frontends.items()}}

    # -- the client calls ----------------------------------------------------------------------
    async def submit(self, prompt: str | None = None, messages: list | None = None,
                     ids: list | None = None, priority: str = "proactive", stop=None,
                     **sampling) -> int:
        """A new request; bad input raises ValueError here, before it queues."""
        self.loop = asyncio.get_running_loop()
        if self.engine is None:
            raise RuntimeError(self.error or "the service is still starting")
        ids = self._prompt_ids(prompt, messages, ids)
        check_priority(priority)
        if sampling.get("max_tokens") is None:      # OpenAI's default: up to the context's end
            sampling["max_tokens"] = max(1, self.engine.context - len(ids))
        req = Request(next(self.ids), ids, SamplingParams(**sampling), priority, stop)
        with self.cv:
            self.scheduler.add(req)              # raises for a request that could never fit
            self.table[req.id] = req
            self.pieces[req.id] = []
            self.events[req.id] = asyncio.Event()
            self.metrics.arrived(req)
            self.cv.notify()
        return req.id

    def _prompt_ids(self, prompt, messages, ids) -> list:
        e = self.engine
        if sum(x is not None for x in (prompt, messages, ids)) != 1:
            raise ValueError("give exactly one of prompt, messages or ids")
        if messages is not None:
            from socllm.models.chat import render_chat
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages):
                raise ValueError("messages must be a non-empty list of {role, content} strings")
            text = render_chat(e.template, messages)
            return e.tokenizer.encode(text, bos=e.tokenizer.add_bos)
        if ids is not None:
            if not ids or not all(isinstance(t, int) and 0 <= t < e.cfg.vocab for t in ids):
                raise ValueError(f"ids must be a non-empty list of token ids below {e.cfg.vocab}")
            return list(ids)
        if not isinstance(prompt, str):
            raise ValueError("the prompt must be a string")
        return e.encode_prompt(prompt)

    async def poll(self, rid: int, seen: int = 0, timeout_s: float = 10.0) -> dict:
        """Text pieces of request `rid` after the first `seen`; waits (up to timeout_s) while
        there are none and the request runs on."""
        req = self.table.get(rid)
        if req is None:
            raise KeyError(f"no request {rid}")
        ev = self.events[rid]
        ev.clear()
        if len(self.pieces[rid]) <= seen and not req.ended:
            try:
                await asyncio.wait_for(ev.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        pieces = self.pieces[rid][seen:]
        return {"pieces": pieces, "seen": seen + len(pieces), "state": req.state,
                "finish_reason": req.finish_reason, "error": req.error, "usage": req.usage()}

    async def cancel(self, rid: int) -> bool:
        """Cancel a request: a waiting one leaves the queue, a running one stops at its next
        step and its KV is free for the next request."""
        req = self.table.get(rid)
        if req is None or req.ended:
            return False
        with self.cv:
            self.cancelled.add(rid)
            if req.state == "waiting":
                self.scheduler.finish(req)
                self._end(req, "cancelled", "cancelled")
            elif self.engine.running is not None:
                self.engine.cancel()
        return True

    def request(self, rid: int) -> dict:
        """A request's table entry (and, once it ended, how it ran)."""
        req = self.table[rid]
        return {k: getattr(req, k) for k in ("id", "state", "priority", "prompt", "tokens", "text",
                                             "finish_reason", "error")} \
            | {"usage": req.usage()} | self.results.get(rid, {})

    # -- the loop: schedule -> run -> postprocess ------------------------------------------------
    def _serve(self):
        while not self.stopping:
            with self.cv:
                batch = self.scheduler.schedule()
                if not batch.prefill:
                    self.cv.wait(0.5)
                    continue
            for req in batch.prefill:          # one at a time: the KV region holds one sequence
                self._run(req)

    def _run(self, req: Request):
        e, rid = self.engine, req.id
        req.state = "prefilling"
        self._wake(rid)
        dec, stops = e.tokenizer.stream(), StopText(req.stop)
        reason = "length"
        try:
            for t in e.run(req.prompt, self.plan, self.precision, **req.params.__dict__):
                now = time.monotonic()
                if req.first_token is None:
                    req.first_token, req.state = now, "decoding"
                self.metrics.token(req, now)
                self.token_times.append(now)
                req.tokens.append(t)
                req.kv_rows = len(req.prompt) + len(req.tokens)
                if rid in self.cancelled:
                    e.cancel()
                    continue
                if t in e.stop_ids:
                    reason = "stop"
                    continue
                piece = stops.feed(dec.feed(t))
                if stops.hit:
                    reason = "stop"
                    e.cancel()                 # the text is complete: stop generating
                self._emit(req, piece)
            self._emit(req, stops.feed(dec.flush()) + stops.flush())
            self.results[rid] = {k: e.last[k] for k in ("plan", "placement", "precision", "timings")}
            if rid in self.cancelled:
                self._end(req, "cancelled", "cancelled")
            else:
                self._end(req, "finished", reason)
        except Exception as ex:       # one bad request never takes the service down
            traceback.print_exc()
            self._end(req, "failed", "error", f"{type(ex).__name__}: {ex}")

    def _emit(self, req: Request, piece: str):
        if piece:
            req.text += piece
            self.pieces[req.id].append(piece)
            self._wake(req.id)

    def _end(self, req: Request, state: str, reason: str, error: str | None = None):
        with self.cv:
            req.end(state, reason, error)
            self.scheduler.finish(req)
            self.cancelled.discard(req.id)
            self.metrics.ended(req)
            ended = [r for r in self.table.values() if r.ended]
            for old in ended[:max(0, len(ended) - KEEP_ENDED)]:
                for d in (self.table, self.pieces, self.events, self.results):
                    d.pop(old.id, None)
        self._wake(req.id)

    def _wake(self, rid: int):
        ev, loop = self.events.get(rid), self.loop
        if ev is not None and loop is not None:
            loop.call_soon_threadsafe(ev.set)

    # -- what runs -------------------------------------------------------------------------------
    def register_frontend(self, name: str, pid: int, url: str):
        self.frontends[name] = (pid, url)

    def pids(self) -> list:
        """Every process socllm runs: this actor, the engine's actors, the front ends."""
        return sorted({*self.engine.pids(), *(p for p, _ in self.frontends.values())})

    def status(self) -> dict:
        from .metrics import pss_mb
        now = time.monotonic()
        while self.token_times and self.token_times[0] < now - 60:
            self.token_times.popleft()
        reqs = list(self.table.values())
        procs = []
        uptime = time.time() - self.started
        for d in self.engine.info():
            procs.append({k: d.get(k) for k in ("processor", "api", "device", "type", "threads", "pid",
                                                "steps")} | {"busy_share": round(d["busy_s"] / uptime, 4)})
        running = self.engine.running is not None
        return {**self.describe(), "uptime_s": round(uptime, 1), "processors": procs,
                "requests": {s: sum(r.state == s for r in reqs) for s in STATE_KEYS},
                "queues": self.scheduler.queues(),
                "kv": {"rows": self.engine.context, "rows_used": sum(r.kv_rows for r in reqs),
                       "sequences_max": 1, "sequences_used": int(running)},
                "tokens_per_s_1min": round(len(self.token_times) / min(60.0, max(uptime, 1e-3)), 2),
                "memory_pss_mb": round(pss_mb(self.pids()), 1)}

    def prometheus(self) -> str:
        return self.metrics.text(self.table.values(), self.engine.context)

    def shutdown(self) -> bool:
        """Stop the loop and tear the engine down (actors killed, pool unlinked)."""
        self.stopping = True
        with self.cv:
            self.cv.notify_all()
        if self.engine is not None:
            self.engine.cancel()
            self.engine.close()
        return True
