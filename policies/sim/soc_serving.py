"""An agent workload on a simulated SoC (Agent.xpu §6): socllm's scheduling policies, unchanged,
serving a trace in virtual time, their steps timed by the simulator (policies/sim/simulate.py) on
socllm's own step programs. Every figure is simulated.

Two ways to serve, as Agent.xpu §6.1 compares them:
  fcfs-gpu   one pipeline on the GPU, first come first served, continuous batching: each
             iteration one prefill chunk, then one decode step of every running request (the
             iGPU continuous-batching baseline, and socllm's service taking turns)
  agent      Agent.xpu §4.3-4.5: the agent policy (policies/agent.py) with prefill on the NPU's
             static chunks and decode on the GPU, the two pipelines at once (disaggregated),
             sharing the KV cache in place; reactive requests first, capped mixed batches
Each step is simulated alone (its seconds and bytes); while the two pipelines' steps overlap
they share the SoC's total bandwidth as a fluid (HeteroLLM §3.3, Agent.xpu §3.1 Figure 3): when
the bytes per second they draw alone add up to more than it, both progress that much slower. A
decode batch is timed as the decode program over its rows at their mean position, plus every
other row's own K/V read.
"""
from __future__ import annotations

import math

from socllm.graph.program import StepProgram
from socllm.memory.blocks import BlockPool

from ..agent import AgentPolicy, b_rf_from_profile
from ..buckets import bucket_for
from ..request import Request
from ..sampling import SamplingParams
from ..scheduler import FCFS
from .simulate import simulate_step
from .soc import WEIGHTS

MAX_SEQS = 16


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _timer(soc, planner, weights: str):
    """step(plan, phase, rows, pos0) -> (simulated seconds alone, bytes moved), cached by shape."""
    cache: dict = {}

    cfg = planner.cfg

    def step(plan, phase, rows, pos0):
        bucket = bucket_for(rows) if phase == "prefill" and plan == "npu" else (1 if phase == "decode" else rows)
        n = bucket if plan == "npu" else rows        # the NPU computes its padded bucket
        key = (plan, phase, bucket, n, pos0 // 64)
        if key not in cache:
            prog = StepProgram.from_bytes(planner.program(plan, phase, bucket)[1])
            res = simulate_step(prog, soc, n, pos0 // 64 * 64, weight_bytes=WEIGHTS[weights])
            s, nbytes = res.seconds, sum(res.bytes.values())
            if phase == "decode":
                # the program's attention reads one sequence's K/V; a batch's rows each read
                # their own (f16, every layer): the other rows' reads at the processor's bandwidth
                kv = (rows - 1) * (pos0 // 64 * 64) * 2 * cfg.kv_dim * 2 * cfg.n_layers
                s, nbytes = s + kv / soc.processors[plan].bandwidth, nbytes + kv
            cache[key] = (s + soc.sync_s, nbytes)
        return cache[key]
    return step


def serve(soc, planner, items: list, how: str, chunk: int = 128, weights: str = "w4a16",
          context: int = 4096) -> list:
    """items: [(arrival s, class, prompt tokens, output tokens)]. -> per request
    {class, arrival, first_token, finish, prompt, output} in virtual seconds."""
    step = _timer(soc, planner, weights)
    clock = _Clock()
    kv = BlockPool(MAX_SEQS * context // 16)
    if how == "agent":
        profile = {b: step("gpu", "decode", b, 256)[0] for b in range(1, MAX_SEQS + 1)}
        policy = AgentPolicy(MAX_SEQS, context, kv, b_rf=b_rf_from_profile(profile), clock=clock)
        pre, dec = "npu", "gpu"
    elif how == "fcfs-gpu":
        policy, pre, dec = FCFS(MAX_SEQS, context, kv), "gpu", "gpu"
    else:
        raise ValueError(f"unknown way to serve {how!r} (agent, fcfs-gpu)")
    todo = sorted(items)
    reqs, out = {}, []
    inflight = {}                            # processor -> [kind, requests, rows, seconds left
                                             # at full speed, bytes/s it draws alone]
    i, last = 0, "decode"
    while i < len(todo) or any(not r.ended for r in reqs.values()):
        now = clock.t
        while i < len(todo) and todo[i][0] <= now:
            arrival, cls, n_prompt, n_out = todo[i]
            r = Request(i, [0] * n_prompt, SamplingParams(max_tokens=n_out), cls, arrival=arrival)
            policy.add(r)
            reqs[i] = r
            i += 1
        batch = policy.schedule()
        prefill = [r for r in batch.prefill if not any(r in v[1] for v in inflight.values())]
        decode = [r for r in batch.decode if not any(r in v[1] for v in inflight.values())]
        # one pipeline takes turns: a chunk, then a decode step of everyone (actors/engine.py)
        turn = pre != dec or not (decode and last == "prefill")
        if prefill and pre not in inflight and turn:
            r = prefill[0]
            rows = min(chunk, r.rows - r.computed)
            if r.prefill_start is None:
                r.prefill_start = now
            s, nbytes = step(pre, "prefill", rows, r.computed)
            inflight[pre] = ["prefill", [r], rows, s, nbytes / s]
            last = "prefill"
        if decode and dec not in inflight:
            last = "decode"
            pos = sum(r.computed for r in decode) // len(decode)
            s, nbytes = step(dec, "decode", len(decode), pos)
            inflight[dec] = ["decode", decode, 1, s, nbytes / s]
        # the pipelines' steps at once share the SoC's bandwidth (fluid): both slow by its excess
        draw = sum(f[4] for f in inflight.values())
        speed = min(1.0, soc.bandwidth_total / draw) if len(inflight) > 1 and draw else 1.0
        nxt = [now + f[3] / speed for f in inflight.values()] + ([todo[i][0]] if i < len(todo) else [])
        if not nxt:
            break
        clock.t = max(now, min(nxt))
        for f in inflight.values():
            f[3] -= (clock.t - now) * speed
        for p in [p for p, f in inflight.items() if f[3] <= 1e-9]:
            kind, rs, rows, _, _ = inflight.pop(p)
            for r in rs:
                if r.ended or r not in policy.running:
                    continue
                r.computed += rows
                if kind == "prefill" and r.computed < r.rows:
                    continue
                r.tokens.append(0)
                if r.first_token is None:
                    r.first_token = clock.t
                r.last_token = clock.t
                if len(r.tokens) >= r.params.max_tokens:
                    r.state, r.finish = "finished", clock.t
                    policy.finish(r)
                    out.append({"class": r.priority, "arrival": r.arrival, "first_token": r.first_token,
                                "finish": r.finish, "prompt": len(r.prompt), "output": len(r.tokens),
                                "pending": r.prefill_start - r.arrival})
    return out


def summary(done: list) -> dict:
    """Per class: mean and P90 end-to-end latency, mean TTFT, mean pending (arrival to its first
    prefill chunk), normalized latency (s per token, §6.1)."""
    out = {}
    for cls in ("reactive", "proactive"):
        rs = [d for d in done if d["class"] == cls]
        if not rs:
            continue
        e2e = sorted(d["finish"] - d["arrival"] for d in rs)
        out[cls] = {"requests": len(rs), "e2e_mean_s": sum(e2e) / len(e2e),
                    "e2e_p90_s": e2e[min(len(e2e) - 1, math.ceil(0.9 * len(e2e)) - 1)],
                    "ttft_mean_s": sum(d["first_token"] - d["arrival"] for d in rs) / len(rs),
                    "pending_mean_s": sum(d["pending"] for d in rs) / len(rs),
                    "normalized_s_per_token": sum((d["finish"] - d["arrival"]) / (d["prompt"] + d["output"])
                                                  for d in rs) / len(rs)}
    return out
