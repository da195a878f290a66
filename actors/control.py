"""The CPU control actor: step control and sampling (and the CPU's own kernels).

A generation is one Ray call; inside it every step is a few words written into the pool's control
block and the go words of the processors the step's program uses; the actor then waits for their
done words, samples from the logits in the pool and appends the token to the pool's token ring,
which the client reads as a stream. No Ray call per step or token.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import ray

from socllm.memory.kvcache import KVCache
from socllm.memory.layout import W_FIRST_LOC, W_TOKENS
from socllm.memory.ready import MAX_EPOCH, STEP, SleepPredictor
from socllm.policies.buckets import DECODE_BUCKET, prefill_chunks
from socllm.policies.placement import hybrid_steps, online_prepare, resolve, seqcut_steps
from socllm.policies.sampling import Sampler, SamplingParams

from .processor import MAX_RESTARTS, ProcessorCore

PRECISIONS = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q16": 4}


def next_epoch(ctl, words) -> int:
    """The next step's epoch, shared through the control block by every process that drives
    steps of this pool (this actor, the service's runner): stamps only grow."""
    epoch = ctl["epoch"] + 1
    if epoch > MAX_EPOCH:            # stamps would wrap: every processor is idle, reset them
        words.words[W_FIRST_LOC:] = 0
        epoch = 1
    return epoch


def run_step(lay, ctl, words, predict, pid: int, procs, final: dict, n: int, pos0: int,
             precision: str, check_errors, span: tuple | None = None) -> int:
    """One step from any process attached to the pool: the control block's words, the go words
    of the processors the program uses, then their done words (a step's length is learned:
    predict sleeps most of it, then polls). check_errors(procs, waiting) raises a processor's
    error; waiting: called because the done words are late (where to look for a dead actor).
    span: (lo, hi), run only the program's stages lo .. hi-1 (graph/program.py stage_of).
    Returns the step's epoch."""
    epoch = next_epoch(ctl, words)
    ctl["epoch"], ctl["program"], ctl["n"], ctl["pos0"] = epoch, pid, n, pos0
    ctl["span_lo"], ctl["span_hi"] = span or (0, 0)
    ctl["precision"] = PRECISIONS[precision]
    base = epoch * STEP
    for p in procs:
        words.store(lay.go(p), epoch)
    for p in procs:
        while not predict.wait(words, (pid, p, span), lay.done(p), base + final[p], timeout_s=0.25):
            check_errors(procs, True)
    check_errors(procs, False)
    return epoch


class ControlCore(ProcessorCore):
    def __init__(self, arena_name: str, layout: dict, config, planner, peers: dict,
                 one_shot: bool = False):
        """config: the engine's (ProcessorCore). planner, peers: the planner and processor
        actors, or their names (looked up in this job's namespace: a restarted control actor
        finds them again). one_shot: the engine serves one request and goes (the CLI's private
        engine): graphs that `auto` would compile for later requests are never compiled."""
        super().__init__("cpu", arena_name, layout, config)

        def actor(a):
            return ray.get_actor(a) if isinstance(a, str) else a
        self.planner, self.one_shot = actor(planner), one_shot
        self.peers = {p: actor(a) for p, a in peers.items()}
        self.deferred: set = set()   # (phase, bucket, precision) the NPU should have compiled
        self.epoch = 0
        self.installed: dict = {}    # (plan, phase, bucket, precision) -> (pid, procs, final seqs)
        lay = self.lay
        self.ids = self.arena.buf[lay.io["ids"]: lay.io["ids"] + lay.max_rows * 4].view(np.int32)
        self.logits = self.arena.buf[lay.io["logits"]: lay.io["logits"] + lay.vocab * 4].view(np.float32)
        self.ring = self.arena.buf[lay.io["ring"]: lay.io["ring"] + lay.context * 4].view(np.int32)
        self.kv = KVCache(lay.kv_rows, len(lay.kv) // 2, lay.kv_cols)
        self.step_predict = SleepPredictor(config.sleep_fraction)

    # -- programs ------------------------------------------------------------------------------
    def _program(self, plan, phase, bucket, precision, prepare: bool = False):
        available = set(self.peers) | {"cpu"}
        concrete = resolve(plan, phase, bucket, available)
        compiled = prepare or ("npu", phase, bucket, precision) in self.installed
        if online_prepare(plan, concrete, compiled, available) != concrete:
            self.deferred.add((phase, bucket, precision))    # compiled after the request
            concrete = "gpu"
        plan = concrete
        key = (plan, phase, bucket, precision)
        if key not in self.installed:
            pid, blob, procs = ray.get(self.planner.program.remote(plan, phase, bucket))
            code = PRECISIONS[precision]
            refs = [self.peers[p].install.remote(pid, blob, code, precision) for p in procs if p != "cpu"]
            if "cpu" in procs:
                self.install(pid, blob, code, precision)
            ray.get(refs)
            from socllm.graph.program import StepProgram
            final = StepProgram.from_bytes(blob).final
            self.installed[key] = (pid, procs, final, plan)
        return self.installed[key]

    def prepare(self, plan: str, precision: str, buckets=(32,)) -> bool:
        """Install (and, on the NPU, compile) the programs of a plan ahead of the first request."""
        self._program(plan, "decode", DECODE_BUCKET, precision, prepare=True)
        for b in buckets:
            self._program(plan, "prefill", b, precision, prepare=True)
        return True

    # -- one step ------------------------------------------------------------------------------
    def _step(self, prog, n: int, pos0: int, precision: str):
        pid, procs, final, _ = prog
        self.epoch = run_step(self.lay, self.ctl, self.words, self.step_predict, pid, procs, final,
                              n, pos0, precision, self._check_errors)

    def _check_errors(self, procs, waiting: bool = False):
        if self.ctl["error"]:
            msgs = [self.worker.error] + [ray.get(self.peers[p].last_error.remote())
                                          for p in procs if p != "cpu"]
            self.ctl["error"] = 0
            raise RuntimeError("; ".join(m for m in msgs if m))

    # -- a generation --------------------------------------------------------------------------
    def generate(self, request_id: int, prompt: list, params: dict, plan: str, precision: str,
                 stop_ids: list) -> dict:
        sp = SamplingParams(**params)
        sample = Sampler(sp)
        lay, words = self.lay, self.words
        if len(prompt) >= lay.context:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {lay.context}")
        placed = {}
        # installed once per engine (planner, kernels bound / graphs compiled): not a step's time
        decode = self._program(plan, "decode", DECODE_BUCKET, precision)
        with self.kv.acquire(request_id):     # one generation at a time owns the KV cache
            self.ctl["request"], self.ctl["finished"] = request_id, 0
            out, t0 = [], time.perf_counter()
            pos = 0
            chunks = {"seqcut": seqcut_steps, "hybrid": hybrid_steps}.get(plan, prefill_chunks)(len(prompt))
            for rows, bucket in chunks:
                if self.ctl["cancel"] == request_id:
                    break
                prog = self._program(plan, "prefill", bucket, precision)
                placed.setdefault("prefill", prog[3])
                self.ids[:rows] = prompt[pos: pos + rows]
                self._step(prog, rows, pos, precision)
                pos += rows
            t_prefill = time.perf_counter()
            placed["decode"] = decode[3]
            prefilled = pos == len(prompt)    # not when cancelled during the prefill
            tok = sample(self.logits) if prefilled else None
            while prefilled:
                self.ring[len(out)] = tok
                out.append(tok)
                words.store(W_TOKENS, len(out))
                if tok in stop_ids or len(out) >= sp.max_tokens or pos >= lay.context \
                        or self.ctl["cancel"] == request_id:     # the client cancelled: stop here
                    break
                self.ids[0] = tok
                self._step(decode, 1, pos, precision)
                pos += 1
                tok = sample(self.logits)
            t_end = time.perf_counter()
            self.ctl["finished"] = request_id
            words.store(W_TOKENS, len(out) + (1 << 30))   # wakes the reader; the high bit: "done"
        n_dec = len(out) - 1
        if self.deferred and not self.one_shot:      # compiled after the request, not inside it
            todo, self.deferred = self.deferred, set()
            threading.Thread(target=lambda: [self._program("npu", ph, b, pr, prepare=True)
                                             for ph, b, pr in todo], daemon=True).start()
        return {"tokens": out, "prompt_tokens": list(prompt), "plan": plan, "placement": placed,
                "precision": precision,
                "timings": {"ttft_s": t_prefill - t0,
                            "prefill_tok_s": len(prompt) / max(t_prefill - t0, 1e-9),
                            "decode_tok_s": n_dec / (t_end - t_prefill) if n_dec > 0 else 0.0}}

    def logits_after(self, ids: list, plan: str, precision: str) -> np.ndarray:
        """Teacher-forced logits [len(ids), V] through decode steps (for numerical checks)."""
        rows = []
        with self.kv.acquire(-1):
            prog = self._program(plan, "decode", DECODE_BUCKET, precision)
            for pos, t in enumerate(ids):
                self.ids[0] = t
                self._step(prog, 1, pos, precision)
                rows.append(self.logits.copy())
        return np.stack(rows)


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=MAX_RESTARTS)
class ControlActor(ControlCore):
    pass
