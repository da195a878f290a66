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
import contextlib
import math
import os
import secrets
import threading
import time
import traceback

import ray
from threadpoolctl import threadpool_limits

from socllm.policies.agent import POLICIES, b_rf_from_profile
from socllm.policies.arca import SHARE_UNITS, climb, positions, solo_share, start_step
from socllm.policies.config import DEFAULT_PRECISION, ServeConfig  # noqa: F401 (service's, as before)
from socllm.policies.buckets import batch_bucket, whole_graph
from socllm.policies.placement import NPU_MARGIN
from socllm.policies.plan_cache import plan_cache, plan_key, processors_for
from socllm.policies.request import Sequence
from socllm.policies.drafting import Speculator
from socllm.policies.sampling import Sampler, SamplingParams

from socllm.actors.front.cluster import NAME, NAMESPACE  # noqa: F401 (also imported from here)
from socllm.actors.front.intake import Intake, timings

POLL_COALESCE_S = 0.02       # pieces of a stream are handed out at most every 20 ms
# status's request counts: these in the table now, the ended ones since start (the table
# keeps the last KEEP_ENDED; metrics.py counts them all)
LIVE = ("waiting", "prefilling", "decoding")
# the KV cache's elements per precision: f16 halves what attention reads; f32 keeps the oracle's
KV_DTYPE = {"q8": "f16", "q16": "f16", "f32": "f32"}


def _kv_dtype(plan: str, precision: str) -> str:
    """The KV cache's elements: f16 at q16/q8, but f32 for the tensor plan, whose NPU prefill
    graphs are contiguous and read f32 K/V (npu/backend.py)."""
    return "f32" if plan == "tensor" else KV_DTYPE[precision]
# what a processor's status adds where its backend has them: the config's knobs as it applied
# them (policies/config.py), and the NPU's compiled graphs
KNOBS_APPLIED = ("fuse", "whole_graph", "sleep_fraction", "compiled_graphs")


def _time_chunks(runner, n: int, on: tuple, reps: int = 3, at: int = 0) -> dict:
    """ms of a whole prefill chunk of n rows from position `at` (0: a prompt's first chunk, the
    NPU's whole-model graph; later: its per-layer graphs) on each of `on` (the fastest of reps, on
    blocks from 0, where no request holds blocks yet)."""
    lay, ms = runner.lay, {}
    rows = [(0, at + i, 0) for i in range(n)]
    blocks = {0: [b % lay.kv_blocks for b in range(-(-(at + n) // lay.block_rows))]}
    for proc in on:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            runner.step(rows, blocks, all_rows=False, on=proc)
            best = min(best, time.perf_counter() - t)
        ms[proc] = round(1e3 * best, 1)
    return ms


def _time_batches(runner, base: str, max_seqs: int) -> dict:
    """ms of a decode batch of B rows (B the NPU's static batch buckets: powers of two up to
    max_seqs) on the base processor's kernels and in the NPU's batch graphs (the fastest of 3,
    rows at position 0 of sequences 0 .. B-1, on block 0: no request holds blocks yet)."""
    sizes = sorted({batch_bucket(n, max_seqs) for n in range(1, max_seqs + 1)})
    return {b: {on: round(1e3 * runner.time_step([(0, 0, s) for s in range(b)], {}, on=on), 2)
                for on in (base, "npu")} for b in sizes}


def _npu_takes(runner, chunk_ms: dict, base: str, chunk: int):
    """The chunks auto's NPU takes, from its timings: the NPU's static graph costs its bucket
    whatever the rows, the base processor's kernels grow with them, so from the rows where it is
    faster; a chunk past a prompt's start (per-layer graphs, where its first chunk ran the
    whole-model graph: "npu later") where that was timed faster."""
    runner.npu_from = math.ceil(chunk * chunk_ms["npu"] / chunk_ms[base])
    if "npu later" in chunk_ms:
        runner.npu_later = chunk_ms["npu later"] < chunk_ms[f"{base} later"]


def _time_hcmp(runner, rows: int) -> dict:
    """Ghidorah's ARCA (§III-C3, policies/arca.py) for the hcmp plan: at each position of
    arca.positions, a verifying step of `rows` rows timed on the GPU and on the CPU alone (the
    solo share, where the climb starts), then on the hcmp program at shares 1/SHARE_UNITS apart,
    climbing to the fastest under contention (both actors at once, on the cores they share). Sets
    the runner's bands, drops the programs only timed. -> {"rows", "bands": [[position, share]],
    "ms": {position: {"gpu", "cpu", "solo_share", "shares": {share: ms}}}} (what status shows)."""
    lay = runner.lay
    ms, bands = {}, []
    for pos in positions(min(lay.context, lay.kv_blocks * lay.block_rows), rows):
        alone = {on: runner.time_verify(rows, pos, on=on) for on in ("gpu", "cpu")}
        solo = solo_share(alone["gpu"], alone["cpu"])
        k, _, seen = climb(lambda j: runner.time_verify(rows, pos, share=j / SHARE_UNITS),
                           start_step(solo, SHARE_UNITS), 0, SHARE_UNITS)
        bands.append([pos, k / SHARE_UNITS])
        ms[str(pos)] = {**{on: round(1e3 * t, 3) for on, t in alone.items()},
                        "solo_share": round(solo, 3),
                        "shares": {str(j / SHARE_UNITS): round(1e3 * t, 3) for j, t in sorted(seen.items())}}
    runner.hcmp_bands = [tuple(b) for b in bands]
    runner.keep_batches()
    return {"rows": rows, "bands": bands, "ms": ms}


@ray.remote(num_cpus=0, max_concurrency=1000)
class Service:
    profile_from: str | None = None      # the batching profile's: "timed", "cached" (or none)

    def __init__(self, config: ServeConfig, front_ends_start: bool = False):
        """config: every knob (policies/config.py), validated and read from the environment by
        the caller (`socllm serve`: ServeConfig.from_env): this actor, its engine and the
        engine's actors take them from it, whatever environment the Ray cluster started with.
        front_ends_start: the caller starts the HTTP front end while the model loads and warms
        up, and says when it has (front_ends_up); this device's timings at start wait for that,
        so that the front end's start-up does not take their CPU."""
        if not isinstance(config, ServeConfig):
            raise TypeError(f"the service takes a ServeConfig, got {type(config).__name__}")
        # this process's numpy (the draft heads' two GEMMs a step) on one BLAS thread: OpenBLAS's
        # idle threads spin after each call, on the cores the next step's kernels run on (a
        # 3-row step 19-20 ms after the heads on two threads, 15-16 on one, Xeon VM)
        threadpool_limits(1, user_api="blas")
        self.config = config
        self.frontends: dict = {}             # name -> (pid, url)
        self.started = time.time()
        self.pool, self.core, self.error, self.loop = None, None, None, None
        self.hubs: dict = {}       # a PollHub's id -> the event its poll_many call waits on
        self.poked: dict = {}      # hubs poked while no call of theirs waited
        self.ready_event = threading.Event()
        self.quiet = threading.Event()        # nothing else starts now: timings may be taken
        if not front_ends_start:
            self.quiet.set()
        from socllm.actors.metrics import ServiceMetrics
        self.metrics = ServiceMetrics()
        self.thread = threading.Thread(target=self._main, name="socllm-service", daemon=True)
        self.thread.start()

    # -- start-up ------------------------------------------------------------------------------
    def _main(self):
        try:
            self._start_pool()
            self._start_engine()
        except BaseException as e:    # said by ready(), once; the actor stays for it to be read
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self.ready_event.set()
            return
        self.ready_event.set()
        self.core.run()

    def _start_pool(self):
        """The pool (the model, the processor actors) and the runner of the plan, warmed and
        timed."""
        from socllm.actors.pool import Pool
        c = self.config
        # the second activation buffer holds proactive chunks that stop between layers
        # (the agent policy's, Agent.xpu §4.4)
        self.slices = spans = POLICIES[c.policy].slice_s is not None
        from socllm.models.gguf_file import file_digest, model_path
        path = model_path(c.model)
        self.plan_key = plan_key(c, path, file_digest(path))
        cached = {} if c.plan != "auto" or spans else plan_cache(c.cache_dir).get(self.plan_key) or {}
        plan = c.plan if c.plan != "auto" else "gpu" if spans else cached.get("plan") or "auto"
        # the NPU also where auto found it the faster at some decode batch sizes
        procs = set(processors_for(plan)) | ({"npu"} if cached.get("npu_batches") else set())
        self.pool = e = Pool(c, processors_=tuple(sorted(procs)), kv_dtype=_kv_dtype(plan, c.precision),
                             double_rows=c.prefill_chunk if spans else 0)
        self.precision = c.precision
        self.runner, self.placement = self._start_plan(e)
        self.plan = self.runner.plan
        # the agent policy sizes its mixed batches from this device's step times
        # (and so does speculation, where on: policies/drafting.py StepCosts)
        self.step_profile = self._step_profile() \
            if c.policy == "agent" or c.speculate != "off" and c.warm else {}
        if c.warm and self.runner.chunk_on == self.runner.decode_on == self.runner.base:
            # warm() compiled every program of a base-processor plan: the planner's memory
            # is freed (it starts again if a program is ever missing)
            e.release_planner()

    def _step_profile(self) -> dict:
        """The batching profile (runner.profile_batches: seconds of a decode step of 1 ..
        max_seqs rows), timed at a plan's first start and cached as auto's choice is (per model,
        device, knobs and plan, plan_cache): later starts skip its ~50 steps (~0.8 s)."""
        c, r = self.config, self.runner
        key = f"{self.plan_key}|steps {r.plan} npu {sorted(r.npu_batches)} hcmp {r.hcmp_bands}"
        kept = (plan_cache(c.cache_dir).get(key) or {}).get("profile")
        self.profile_from = "cached" if kept else "timed"
        if kept:
            return {int(b): t for b, t in kept.items()}
        prof = r.profile_batches(c.max_seqs)
        plan_cache(c.cache_dir, key, {"profile": {str(b): t for b, t in prof.items()}})
        return prof

    def _start_engine(self):
        """The KV blocks, the scheduling policy, the drafter and the engine's loop over them."""
        from socllm.actors.engine import Engine    # here: a client's get_actor imports this module
        from socllm.memory.blocks import BlockPool
        c, e = self.config, self.pool
        self.kv = BlockPool(e.layout.kv_blocks, e.layout.block_rows, cache=c.prefix_cache,
                            cache_max=int(c.prefix_cache_mb * 2**20 // e.layout.kv_block_bytes))
        extra = {"b_rf": b_rf_from_profile(self.step_profile), "profile": self.step_profile} \
            if c.policy == "agent" else {}
        self.scheduler = POLICIES[c.policy](c.max_seqs, e.context, self.kv, **extra)
        spec = None if c.speculate == "off" else \
            Speculator(c.speculate, c.max_seqs, c.draft_max, self.step_profile, _heads(c, e),
                       c.draft_ranks if self.runner.trees else 1, reactive_first=c.policy == "agent")
        self.core = Engine(c, e, self.runner, self.scheduler, self.metrics, self._publish, spec)
        self.intake = Intake(e, c.speculate, spec is not None and bool(spec.heads))
        self.core.on_release = self.intake.drop_grammars      # idle: the mask library goes too

    def _publish(self, seq: Sequence):
        """Wake the polls of a sequence that changed (from the loop's thread)."""
        if seq.event is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(_wake, seq)

    def _start_plan(self, e) -> tuple:
        """The runner of the plan asked for (policies/placement.py SERVE_PLANS), warmed. auto:
        HeteroLLM §4.3's decider, by timing on this device (_time_plan: prefill chunks, decode
        batches of each size), cached per model, device and knobs (plan_cache), so later starts
        skip it. Under a policy that slices proactive chunks (agent), auto is the base processor."""
        from socllm.actors.runner import Runner
        c = self.config
        base = "gpu" if "gpu" in e.available else "cpu"
        plan, source, cached = self._which_plan(e, base)
        npu = plan in ("npu", "hetero", "tensor", "seqcut", "hybrid") or plan == "auto"
        chunk = min(c.prefill_chunk, e.context)          # a small model's context is the limit
        runner = Runner(e, base if plan == "auto" else plan, self.precision, chunk if npu else 0)
        runner.npu_batches = frozenset(cached.get("npu_batches", ()))
        if c.warm:
            runner.warm(c.max_seqs)
        self._wait_quiet()
        if plan == "auto":
            plan, cached = self._time_plan(e, runner, base, chunk)
        chunk_ms = cached.get("chunk_ms", {})
        if runner.chunk_on == "npu" and chunk_ms.get(base):
            _npu_takes(runner, chunk_ms, base, chunk)
        if runner.chunk_on == "npu" and c.warm:
            runner.warm_npu()
        placed = {"asked": c.plan, "plan": plan, "from": source, "decode": runner.decode_on,
                  "prefill": runner.chunk_on, "else": runner.base, "chunk_ms": chunk_ms,
                  "npu_from": runner.npu_from, "npu_later": runner.npu_later,
                  "batch_ms": cached.get("batch_ms", {}), "npu_batches": sorted(runner.npu_batches)}
        if plan == "hcmp":
            placed["hcmp"] = self._hcmp_share(runner)
        return runner, placed

    def _hcmp_share(self, runner) -> dict:
        """The hcmp plan's CPU share: asked for (--hcmp-share), else ARCA's (_time_hcmp), cached
        per model, device and knobs like the auto plan's choice."""
        c = self.config
        if c.hcmp_share is not None:
            return {"from": "asked", "bands": [[0, c.hcmp_share]]}
        key = f"{self.plan_key}|hcmp {1 + c.draft_max}"
        got = plan_cache(c.cache_dir).get(key)
        if got and got.get("bands"):
            runner.hcmp_bands = [tuple(b) for b in got["bands"]]
            return {**got, "from": "cached"}
        got = _time_hcmp(runner, min(1 + c.draft_max, runner.max_decode_rows))
        plan_cache(c.cache_dir, key, got)
        return {**got, "from": "timed"}

    def _which_plan(self, e, base: str) -> tuple:
        """(the plan to start, why: "asked" | "policy" | "cached" | "timed" | "no npu", what a
        cached choice kept: its chunk and batch times, npu_batches); "auto" is timed at start."""
        c = self.config
        if c.plan != "auto":
            return c.plan, "asked", {}
        if self.slices:
            # under a policy that slices proactive chunks, they run on the base processor (they
            # stop between layers there), and reactive prompts run whole, most past the NPU's
            # static chunk: its graphs would cost memory (~460 MB here) and take little work
            # (measured: the same reactive TTFT with them, scripts/results/serve-ttft-*.json)
            return base, "policy", {}
        entry = plan_cache(c.cache_dir).get(self.plan_key) or {}  # the plan and the times it had
        if entry.get("plan"):
            return entry["plan"], "cached", entry
        return ("auto", "timed", {}) if "npu" in e.available else (base, "no npu", {})

    def _time_plan(self, e, runner, base: str, chunk: int) -> tuple:
        """auto: a whole chunk timed on the base processor and the NPU; prefill on the NPU where
        it ran NPU_MARGIN times faster (its graphs otherwise dropped); decode batches of each
        static size timed on both, the NPU's graphs kept for the sizes where they ran NPU_MARGIN
        times faster; the choice cached. -> (the plan, what is cached: the times, npu_batches)."""
        chunk_ms = _time_chunks(runner, chunk, (base, "npu"))
        on = "npu" if chunk_ms["npu"] * NPU_MARGIN < chunk_ms[base] else base
        # decode batches too, each size where it ran faster (issue 28: measured, not assumed)
        batch_ms = _time_batches(runner, base, self.config.max_seqs)
        runner.npu_batches = frozenset(b for b, t in batch_ms.items() if t["npu"] * NPU_MARGIN < t[base])
        runner.keep_batches()
        if on == "npu" and self.config.whole_graph and whole_graph("chunk", chunk) \
                and chunk < runner.lay.context:
            # that was the whole-model graph: a chunk past a prompt's start runs per-layer graphs
            later = _time_chunks(runner, min(chunk, runner.lay.context - chunk), (base, "npu"), at=chunk)
            chunk_ms.update({f"{p} later": t for p, t in later.items()})
        runner.chunks_on(on)
        if on != "npu" and not runner.npu_batches:
            e.drop("npu")            # its graphs and its process: memory no step uses
        runner.plan = plan = "hetero" if on == "npu" else base
        return plan, plan_cache(self.config.cache_dir, self.plan_key, {
            "plan": plan, "chunk_ms": chunk_ms, "batch_ms": batch_ms,
            "npu_batches": sorted(runner.npu_batches)})

    def _wait_quiet(self, timeout_s: float = 120.0):
        """Until the front ends started beside the model's load are up (front_ends_up), at
        most timeout_s: the chunk timings and step profile that follow are this device's."""
        self.quiet.wait(timeout_s)

    def front_ends_up(self):
        """The caller's front ends have started (or failed to): timings may be taken."""
        self.quiet.set()

    async def ready(self, timeout_s: float = 600.0) -> dict:
        """Waits until the model is loaded and the actors run; raises the start-up error."""
        self.loop = asyncio.get_running_loop()
        ok = await asyncio.to_thread(self.ready_event.wait, timeout_s)
        if self.error:
            raise RuntimeError(self.error)
        if not ok:
            raise TimeoutError(f"the service did not start within {timeout_s:.0f} s")
        return self.describe()

    def health(self) -> dict:
        """{"status": "ok"} while the serving loop runs; else what is wrong (HTTP's /health)."""
        if self.error:
            return {"status": "failed", "error": self.error}
        if self.core is None:
            return {"status": "starting"}
        if not self.thread.is_alive() or self.core.stopping:
            return {"status": "stopped"}
        return {"status": "ok", "since_last_step_s": round(time.monotonic() - self.core.last_step, 3)}

    def describe(self) -> dict:
        e = self.pool
        return {"model": os.path.basename(e.model_path), "model_path": e.model_path,
                "arch": e.cfg.arch, "context": e.context, "plan": self.plan, "precision": self.precision,
                "hcmp_share": self.config.hcmp_share,
                "policy": self.scheduler.name, "max_seqs": self.scheduler.max_seqs,
                "b_rf": getattr(self.scheduler, "b_rf", None),
                # the agent policy's learned cost of a key attended (policies/agent.py StepModel)
                "decode_us_per_key": _per_key_us(self.scheduler),
                "decode_step_ms": {b: round(1e3 * t, 2) for b, t in self.step_profile.items()},
                "decode_step_from": self.profile_from,
                "kv_blocks": self.kv.n_blocks, "block_rows": self.kv.block_rows,
                "kv_dtype": e.layout.kv_dtype, "prefill_chunk": self.config.prefill_chunk,
                "placement": self.placement, "preemption": self._preemption(), "pid": os.getpid(),
                "speculation": self.core.speculator.describe() if self.core and self.core.speculator
                else {"mode": "off"},
                "frontends": {k: v[1] for k, v in self.frontends.items()}}

    def _preemption(self) -> dict | None:
        """What a reactive arrival waits for (Agent.xpu §4.4 ②), against the policy's bound_s."""
        if self.scheduler.slice_s is None:
            return None
        npu = self.placement["chunk_ms"].get("npu")
        spans = f"{self.runner.base} spans of ~{1e3 * self.scheduler.slice_s:.0f} ms" if self.runner.meta[1:] \
            else "whole chunks (no second activation buffer)"
        return {"bound_ms": 1e3 * self.scheduler.bound_s, "proactive": spans,
                "npu_chunk_ms": npu,
                "npu_runs": "reactive chunks, and proactive prompts' first chunks where they take "
                "at most the bound" if self.runner.chunk_on != self.runner.base else "no chunks",
                "npu_first_ms": self._first_ms()}

    def _first_ms(self) -> float | None:
        """The learned time of a prompt's first chunk on the plan's static program (a whole
        chunk of prefill_chunk rows), None where none ran."""
        took = self.runner.whole_chunk_s(self.config.prefill_chunk, 0)
        return None if took is None else round(1e3 * took, 1)

    # -- the client calls ----------------------------------------------------------------------
    async def submit(self, queue_bound: bool = True, **request) -> str:
        """A new request (_sequence's arguments): bad input raises ValueError before it queues,
        one too many waiting QueueFull. -> an unguessable handle (a client reads and cancels only
        its own). queue_bound False: the 2nd .. nth choice of one request (HTTP's n)."""
        seq = await self._sequence(**_given(request))
        self.core.add(seq, bound=queue_bound)     # raises for a request that could never fit
        return seq.id

    async def submit_many(self, requests: list, queue_bound: bool = True) -> list:
        """Several requests (each submit's keyword arguments), queued at once: the engine's next
        step sees them all (an embeddings request's inputs share prefill chunks: actors/engine.py
        _prefill_embeds). All or none: one bad request raises before any queues. -> their
        handles, in order."""
        if not isinstance(requests, list) or not requests or not all(isinstance(r, dict) for r in requests):
            raise ValueError("submit_many takes a non-empty list of requests (dicts)")
        seqs = [await self._sequence(**_given(r)) for r in requests]
        self.core.add(*seqs, bound=queue_bound)
        return [s.id for s in seqs]

    async def _sequence(self, prompt: str | None = None, messages: list | None = None,
                        ids: list | None = None, priority: str = "proactive", stop=None,
                        ignore_eos: bool = False, response_format: dict | None = None,
                        grammar: str | None = None, tools: list | None = None, tool_choice=None,
                        parallel_tool_calls: bool | None = None, speculate: str | None = None,
                        embed: str | None = None, continue_final_message: bool = False,
                        prediction: str | None = None, **sampling) -> Sequence:
        """A request checked and tokenized, not yet queued. Tokenized beside the loop in a
        thread without the GIL: a huge prompt stalls no one. response_format (OpenAI's), grammar
        (Lark or GBNF) and tools (with tool_choice, parallel_tool_calls; chat only) constrain the
        reply (policies/grammar.py); speculate: policies/drafting.py MODES; embed "mean" | "last":
        the prompt's embedding, no reply; continue_final_message (vLLM's); prediction (OpenAI's)."""
        self.loop = asyncio.get_running_loop()
        if self.pool is None:
            raise RuntimeError(self.error or "the service is still starting")
        self.intake.check_params(priority, speculate, sampling, prediction)
        sampling = self.intake.check_embed(embed, messages, sampling, self.runner.hidden_rows() is not None,
                                           (response_format, grammar, tools, prediction))
        shape = {"response_format": response_format, "grammar": grammar, "tools": tools,
                 "tool_choice": tool_choice, "parallel": bool(parallel_tool_calls),
                 "continue": bool(continue_final_message), "prediction": prediction}
        ids, constraint, tooled = await asyncio.to_thread(self.intake.prompt_ids, prompt, messages, ids, shape)
        params = SamplingParams(**{"max_tokens": max(1, self.pool.context - len(ids)),  # OpenAI's
                                   **{k: v for k, v in sampling.items() if v is not None}})
        seq = Sequence(secrets.token_urlsafe(12), ids, params, priority, stop, ignore_eos=bool(ignore_eos),
                       sampler=Sampler(params, ids, () if ignore_eos else self.pool.stop_ids),
                       decoder=self.pool.tokenizer.stream(), event=asyncio.Event(),
                       constraint=constraint, tools=tooled,
                       speculate=speculate, embed=embed, prediction=shape.get("prediction_ids"))
        return seq

    async def poll(self, rid: str, seen: int = 0, timeout_s: float = 10.0,
                   coalesce_s: float = POLL_COALESCE_S, seen_logprobs: int = 0) -> dict:
        """Text pieces of request `rid` after the first `seen`; waits (up to timeout_s) while
        there are none and the request runs on. After its first piece, a request's polls return
        at most every coalesce_s, with every piece made meanwhile: a Ray reply per token would
        cost the cores the kernels run on (DESIGN.md §5)."""
        seq = self.core.table.get(rid)
        if seq is None:
            raise KeyError(f"no request {rid}")
        seq.event.clear()
        seq.polls += 1
        try:
            if len(seq.pieces) <= seen and not seq.ended:
                try:
                    await asyncio.wait_for(seq.event.wait(), timeout_s)
                except asyncio.TimeoutError:
                    pass
            if seen and not seq.ended and coalesce_s > 0:
                await asyncio.sleep(coalesce_s)
        finally:
            seq.polls -= 1
            seq.last_poll = time.monotonic()
        return self.intake.answer(seq, seen, seen_logprobs)

    async def poll_many(self, hub: str, asks: dict, timeout_s: float = 10.0) -> dict:
        """The polls of many requests in one call: every stream of a client's event loop (an
        HTTP replica's: actors/front/client.py PollHub). asks: id -> (seen, seen_logprobs).
        Returns id -> poll's answer for each request with something new (pieces or logprobs
        after its seen, or its end; {"missing": True} for an id the service does not know),
        waiting up to timeout_s for one, or until poke(hub) (a new stream of the hub waits)."""
        seqs = {rid: self.core.table.get(rid) for rid in asks}
        news = lambda: [rid for rid, s in seqs.items()
                        if s is None or s.ended or len(s.pieces) > asks[rid][0]]
        poked = self.poked.pop(hub, None) is not None
        wake = self.hubs[hub] = asyncio.Event()
        live = [s for s in seqs.values() if s is not None]
        _watched(live, wake, True)
        try:
            if not (ready := news()) and not poked:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout_s)
                ready = news()
        finally:
            self.hubs.pop(hub, None)
            self.poked.pop(hub, None)
            _watched(live, wake, False)
        return {rid: {"missing": True} if seqs[rid] is None else self.intake.answer(seqs[rid], *asks[rid])
                for rid in ready}

    def poke(self, hub: str):
        """A hub's call in flight returns now (its new stream is not in it); a call not yet
        begun returns at once."""
        wake = self.hubs.get(hub)
        if wake is not None:
            wake.set()
        else:
            self.poked[hub] = True

    async def cancel(self, rid: str) -> bool:
        """Cancel a request: a waiting one leaves the queue, a running one stops at its next
        step and its KV is free for the next request."""
        seq = self.core.table.get(rid)
        if seq is None or seq.ended:
            return False
        self.core.cancel(seq)
        return True

    def request(self, rid: str) -> dict:
        """A request's table entry (and, once it ended, how it ran)."""
        req = self.core.table[rid]
        out = {k: getattr(req, k) for k in ("id", "state", "priority", "prompt", "tokens", "text",
                                            "finish_reason", "error", "arrival", "prefill_start",
                                            "first_token", "arrived_during")}
        if req.spec is not None:      # speculative decoding: this request's drafts
            out["speculation"] = {"drafted": req.spec.drafted, "accepted": req.spec.accepted,
                                  "verify_steps": sum(a.steps for a in req.spec.by_n.values())}
        out["finish"] = req.finish
        return out | {"usage": req.usage(), "plan": self.plan, "precision": self.precision,
                      "placement": {"prefill": self.runner.chunk_on, "decode": self.runner.decode_on},
                      "timings": timings(req)}

    async def tokenize(self, prompt: str | None = None, messages: list | None = None,
                       add_special: bool = True, tools: list | None = None, tool_choice=None,
                       continue_final_message: bool = False) -> list:
        """The ids a request with this prompt (or these chat messages and tools, through the
        model's template; its final message continued) would start from; add_special False:
        without the BOS the model adds. In a thread without the GIL, as submit's; the context
        does not bound it (a client counts)."""
        text, bos = self.intake.tokens(prompt, messages, add_special, tools, tool_choice,
                                       bool(continue_final_message))
        return await asyncio.to_thread(self.pool.tokenizer.encode, text, bos)

    def detokenize(self, ids: list) -> str:
        return self.intake.detokenize(ids)

    # -- what runs -------------------------------------------------------------------------------
    def register_frontend(self, name: str, pid: int, url: str):
        self.frontends[name] = (pid, url)

    def pids(self) -> list:
        """Every process socllm runs: this actor, the engine's actors, the front ends."""
        return sorted({*self.pool.pids(), *(p for p, _ in self.frontends.values())})

    def processes(self, info: list) -> dict:
        """name -> pid of socllm's processes (info: the processor actors' pool.info())."""
        planner = self.pool._planner       # None: released after start (pool.release_planner)
        named = {"service": os.getpid(),
                 **({"planner": ray.get(planner.pid.remote())} if planner is not None else {}),
                 **{d["processor"]: d["pid"] for d in info},
                 **{k: p for k, (p, _) in self.frontends.items()}}
        return named

    def status(self) -> dict:
        from socllm.actors.metrics import pss_mb
        now, core = time.monotonic(), self.core
        while core.token_times and core.token_times[0] < now - 60:
            core.token_times.popleft()
        reqs = list(core.table.values())
        procs = []
        uptime = time.time() - self.started
        info = self.pool.info()
        for d in info:
            procs.append({k: d.get(k) for k in ("processor", "api", "device", "type", "threads", "pid",
                                                "steps", "error")} | {"busy_share": round(d["busy_s"] / uptime, 4)}
                         | {k: d[k] for k in KNOBS_APPLIED if k in d})
        return {**self.describe(), "uptime_s": round(uptime, 1), "processors": procs,
                "steps_by_program": dict(self.runner.ran),
                "requests": {s: sum(r.state == s for r in reqs) for s in LIVE} | self.metrics.ended_total,
                "queues": self.scheduler.queues(),
                "kv": {"blocks": self.kv.n_blocks, "blocks_used": self.kv.n_used,
                       "blocks_free": self.kv.n_free, "block_rows": self.kv.block_rows,
                       "sequences_max": self.scheduler.max_seqs,
                       "sequences_used": len(self.scheduler.running),
                       "idle_s": self.config.prefix_cache_idle_s,
                       "mask_library_loaded": self.intake.grammars_loaded} | self.kv.stats(),
                "tokens_per_s_1min": round(len(core.token_times) / min(60.0, max(uptime, 1e-3)), 2),
                "loop": {k: round(v, 3) for k, v in core.times.items()},
                "recoveries": core.recoveries[-10:], "recoveries_total": len(core.recoveries),
                "abandoned_total": core.abandoned,
                "memory_pss_mb": round(pss_mb(self.pids()), 1),
                "memory_pss_mb_by_process": {k: round(pss_mb([p]), 1)
                                             for k, p in self.processes(info).items()}}

    def prometheus(self) -> str:
        return self.metrics.text(self.core.table.values(), self.kv, self.core.speculator)

    def shutdown(self) -> bool:
        """Stop the loop and tear the pool down (actors killed, segment unlinked)."""
        if self.core is not None:
            self.core.stop()
        if self.pool is not None:
            self.pool.close()
        return True


def _heads(c, e):
    """The draft heads trained for the served model (models/heads.py), where speculation may use
    them; --speculate heads without them is refused at start."""
    from socllm.models.heads import heads_path, load_heads
    from socllm.policies.config import ConfigError
    from socllm.policies.drafting import Heads
    h = load_heads(e.model_path) if c.speculate != "off" else None
    if h is None and c.speculate == "heads":
        raise ConfigError("speculate", f"heads: no draft heads for this model file "
                                       f"({heads_path(e.model_path)}; scripts/train_heads.py trains them)")
    heads = h and Heads(h["W"], h["b"], h["vocab"], h["embed"], h["meta"]["accuracy"]["head1"]["top1"], h["A"])
    del h
    from socllm.actors.pool import _trim
    _trim()      # the embedding's rows were read through a copy of its table; Heads keeps copies
    return heads


def _per_key_us(scheduler) -> float | None:
    c = scheduler.model.per_key if getattr(scheduler, "model", None) is not None else None
    return None if c is None else round(1e6 * c, 3)


def _wake(seq: Sequence):
    """On the service's event loop: a sequence changed; its polls and hubs return."""
    seq.event.set()
    for wake in seq.watchers:
        wake.set()


def _watched(seqs: list, wake, on: bool):
    """A poll_many call starts (on) or ends watching these sequences: an open poll each (no
    abandoning them meanwhile), woken by any change."""
    now = time.monotonic()
    for s in seqs:
        if on:
            s.polls += 1
            s.watchers.add(wake)
        else:
            s.polls -= 1
            s.last_poll = now
            s.watchers.discard(wake)


def _given(request: dict) -> dict:
    """A request's arguments; priority None is the default, as a JSON null is over HTTP."""
    return {k: v for k, v in request.items() if k != "priority" or v is not None}
