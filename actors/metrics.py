"""What the service counts, as Prometheus text (prometheus_client, a private registry), and the
memory of socllm's processes."""
from __future__ import annotations

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from socllm.policies.request import ENDED, STATES

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServiceMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("socllm_requests", "requests that arrived, by priority class",
                                ["priority"], registry=r)
        self.ended_ = Counter("socllm_requests_ended", "requests that ended, by final state",
                              ["state"], registry=r)
        self.state = Gauge("socllm_requests_in_state", "requests in the table by state", ["state"],
                           registry=r)
        self.tokens = Counter("socllm_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("socllm_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.ttft = Histogram("socllm_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("socllm_inter_token_seconds", "time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.pending = Histogram("socllm_pending_seconds", "arrival to the start of the first "
                                 "prefill chunk, by priority (a reactive one's: its preemption "
                                 "latency)", ["priority"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv = Gauge("socllm_kv_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_total = Gauge("socllm_kv_blocks", "KV cache blocks in the pool", registry=r)
        self._last: dict = {}             # request id -> time of its last token
        self.ended_total = dict.fromkeys(ENDED, 0)   # since start (the table keeps the last 256)
        self._cache_and_spec(r)

    def _cache_and_spec(self, r):
        # the prefix cache (memory/blocks.py), in prompt tokens: vLLM's names
        self.cache_queries = Counter("socllm_prefix_cache_queries", "prompt tokens looked up in "
                                     "the prefix cache", registry=r)
        self.cache_hits = Counter("socllm_prefix_cache_hits", "prompt tokens found in the prefix "
                                  "cache (not prefilled)", registry=r)
        self.kv_cached = Gauge("socllm_kv_blocks_cached", "KV blocks no request holds, kept for "
                               "prefix-cache hits", registry=r)
        self._counted = (0, 0)
        # speculative decoding (policies/drafting.py): vLLM's spec_decode counters
        self.spec_drafted = Counter("socllm_spec_decode_draft_tokens", "tokens drafted for "
                                    "verification", registry=r)
        self.spec_accepted = Counter("socllm_spec_decode_accepted_tokens", "drafted tokens the "
                                     "model accepted", registry=r)
        self.spec_steps = Counter("socllm_spec_decode_verify_steps", "decode steps of a sequence "
                                  "that verified drafts", registry=r)
        self._spec = (0, 0, 0)

    def arrived(self, req):
        self.requests.labels(req.priority).inc()
        self.prompt_tokens.inc(len(req.prompt))

    def prefill_started(self, req):
        self.pending.labels(req.priority).observe(req.prefill_start - req.arrival)

    def token(self, req, now: float):
        self.tokens.inc()
        last = self._last.get(req.id)
        if last is None:
            self.ttft.observe(now - req.arrival)
        else:
            self.itl.observe(now - last)
        self._last[req.id] = now

    def ended(self, req):
        self.ended_.labels(req.state).inc()
        self.ended_total[req.state] = self.ended_total.get(req.state, 0) + 1
        self._last.pop(req.id, None)

    def text(self, requests, kv, spec=None) -> str:
        reqs = list(requests)
        for s in STATES:
            self.state.labels(s).set(sum(r.state == s for r in reqs))
        self.kv.set(kv.n_used)
        self.kv_total.set(kv.n_blocks)
        self.kv_cached.set(kv.n_cached)
        q, h = self._counted
        self.cache_queries.inc(kv.queries - q)
        self.cache_hits.inc(kv.hits - h)
        self._counted = (kv.queries, kv.hits)
        if spec is not None:
            now = (spec.drafted, spec.accepted, spec.steps)
            for c, a, b in zip((self.spec_drafted, self.spec_accepted, self.spec_steps), now, self._spec):
                c.inc(a - b)
            self._spec = now
        return generate_latest(self.registry).decode()


def pss_mb(pids) -> float:
    """Proportional set size of these processes, MB (shared pages counted once overall)."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 1e6
