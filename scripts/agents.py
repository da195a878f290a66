"""Agent workload replay (Agent.xpu §6.1): one mixed reactive/proactive trace against socllm's
`--policy agent`, its `--policy fcfs` (same engine) and llama.cpp's `llama-server` (FIFO with
continuous batching), in the same run.

    python -m socllm.scripts.agents [--minutes 15] [--reactive-rate 3] [--proactive-rate 6]
        [--levels 3:6,5:12] [--engines agent,fcfs,llama-server] [--seed 0]
        [--json FILE] [--plot FILE.png]

Arrivals are Poisson, the two classes drawn independently at their rates (requests per minute;
`--levels R:P,...` runs several load levels). Lengths are shaped like §6.1 Figure 7: reactive
prompts and outputs long-tailed (log-normal, most short, a few long), proactive prompts longer
(summaries of documents) with moderate outputs. Prompts are cut from the public-domain text in
scripts/data; outputs run to their drawn length (EOS ignored). Every engine gets the same trace
through the same streaming HTTP client (`/v1/completions`; `priority` is sent to socllm only).
Reported per engine and class: mean and P90 end-to-end latency, TTFT, time per output token,
normalized latency (end-to-end seconds per prompt + output token, §6.1), queueing time (arrival
to the first prefill chunk: for a reactive request, its preemption latency; socllm only), and
proactive throughput (proactive output tokens per second from the trace's start to the last
proactive request's end); per processor, its busy share over the trace. A table, --json, and a
plot like §6 Figure 9.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import psutil
import requests

from socllm.policies.sim import workload

from .serve_bench import DATA, LlamaServer, pct, start_llama_server, start_socllm, stop_socllm

MAX_SEQS = 16              # socllm's sequences at once and llama-server's --parallel


def trace(minutes: float, rates: dict, seed: int, tokenizer) -> list:
    """policies/workload.trace over the repository's public-domain text, prompts counted with
    `tokenizer`."""
    return workload.trace(minutes, rates, seed, open(DATA).read().split(),
                          lambda text: len(tokenizer.encode(text)))


def system_prompt(tokens: int, tokenizer) -> str:
    """An agent's system prompt of about `tokens` tokens: instructions and a tool list, the
    same text before every request."""
    head = ("You are an on-device assistant agent. Follow the user's instructions, be brief, and "
            "use the tools below when a task needs them. Tools:\n")
    lines, i = [head], 0
    while len(tokenizer.encode("".join(lines))) < tokens:
        lines.append(f"- tool_{i}(query: string, limit: integer) -> list: searches source {i} "
                     f"for the query and returns at most limit results, newest first.\n")
        i += 1
    return "".join(lines) + "\nRequest: "


# -- replaying a trace over HTTP ---------------------------------------------------------------
def one(url: str, t0: float, item, send_priority: bool, out: list, lock):
    arrival, cls, prompt, max_tokens, prompt_tokens = item
    delay = t0 + arrival - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, **({"priority": cls} if send_priority else {"n_predict": max_tokens})}
    start, times, rid, err = time.perf_counter(), [], None, None
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=1800) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rid = rid or chunk.get("id")
                c = chunk.get("choices") or [{}]
                if c[0].get("text"):
                    times.append(time.perf_counter())
    except Exception as e:        # counted, never silent
        err = f"{type(e).__name__}: {e}"
    rec = {"class": cls, "arrival_s": arrival, "late_s": start - (t0 + arrival), "id": rid,
           "error": err or (None if times else "no tokens"), "max_tokens": max_tokens,
           "pieces": len(times), "prompt_tokens": prompt_tokens}
    if times:
        end = times[-1]
        rec.update(ttft_s=times[0] - start, e2e_s=end - start, end_s=end - t0,
                   tpot_s=(end - times[0]) / max(1, max_tokens - 1))
    with lock:
        out.append(rec)


def replay(url: str, items: list, send_priority: bool) -> tuple:
    out, lock = [], threading.Lock()
    t0 = time.perf_counter() + 1.0
    threads = [threading.Thread(target=one, args=(url, t0, it, send_priority, out, lock), daemon=True)
               for it in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, t0


# -- the engines -------------------------------------------------------------------------------
class SocllmPolicy:
    """socllm's service with one policy, in this process's Ray, behind its HTTP ingress."""

    def __init__(self, gguf: str, policy: str, prefix_cache: bool = True, context: int = 2048):
        self.name = f"socllm-{policy}" + ("" if prefix_cache else "-nocache")
        self.gguf, self.policy, self.prefix_cache, self.context = gguf, policy, prefix_cache, context

    def start(self):
        self.svc, self.info, self.url = start_socllm(
            self.gguf, max_seqs=MAX_SEQS, policy=self.policy, prefix_cache=self.prefix_cache,
            context=self.context)
        self.version = f"socllm {self.info['policy']} ({self.info['precision']}, PoCL)"
        return self.url

    def busy(self) -> dict:
        import ray
        st = ray.get(self.svc.status.remote())
        return {p["processor"]: p["busy_share"] * st["uptime_s"] for p in st["processors"]} | \
            {"pss_mb": st["memory_pss_mb"]}

    def enrich(self, recs: list):
        """Queueing time (arrival to the first prefill chunk) from the service's request table."""
        import ray
        for r in recs:
            if r.get("id"):
                try:
                    info = ray.get(self.svc.request.remote(r["id"].split("-", 1)[1]))
                except Exception:          # dropped from the table: left out
                    continue
                if info["prefill_start"] is not None:
                    r["queue_s"] = info["prefill_start"] - info["arrival"]
                    r["arrived_during"] = info.get("arrived_during")

    def stop(self):
        stop_socllm(self.svc)


class LlamaServerFIFO:
    name = "llama-server"

    def __init__(self, gguf: str, binary: str | None):
        self.gguf = gguf
        self.version = LlamaServer(gguf, binary).version
        self.binary = LlamaServer(gguf, binary).binary

    def start(self):
        self.proc, url = start_llama_server(self.binary, self.gguf, MAX_SEQS, MAX_SEQS * 2048)
        return url

    def busy(self) -> dict:
        from socllm.actors.metrics import pss_mb
        t = psutil.Process(self.proc.pid).cpu_times()
        return {"cpu_s": t.user + t.system, "pss_mb": pss_mb([self.proc.pid])}

    def enrich(self, recs):
        pass

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


# -- the report --------------------------------------------------------------------------------
def stats(xs: list) -> dict | None:
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": pct(xs, 50), "p90": pct(xs, 90),
            "p99": pct(xs, 99), "max": max(xs)} if xs else None


def preemption_latency(recs: list) -> tuple:
    """Agent.xpu §4.4 ②: a reactive request preempts proactive work at the next kernel or span,
    but "reactive tasks do not preempt each other and run sequentially": its pending time
    (arrival -> first prefill kernel) is its preemption latency unless another reactive request
    was still waiting or prefilling when it arrived (then it queued behind that one).
    -> (preemption latencies, times queued behind a reactive prefill), seconds."""
    react = [r for r in recs if r["class"] == "reactive" and not r["error"]]
    sent = lambda r: r["arrival_s"] + r.get("late_s", 0.0)   # ttft_s counts from the send
    pre, behind = [], []
    for i, r in enumerate(react):
        if r.get("queue_s") is None:      # its timing left the service's table: not counted
            continue
        queued = any(sent(q) < sent(r) < sent(q) + q["ttft_s"] or (sent(q) == sent(r) and j < i)
                     for j, q in enumerate(react) if q is not r)
        (behind if queued else pre).append(r["queue_s"])
    return pre, behind


def summarize(recs: list, t_span: float, busy0: dict, busy1: dict) -> dict:
    out = {"requests": len(recs), "errors": [r["error"] for r in recs if r["error"]]}
    for cls in ("reactive", "proactive"):
        ok = [r for r in recs if r["class"] == cls and not r["error"]]
        m = {"n": len(ok)}
        for key in ("e2e_s", "ttft_s", "tpot_s", "queue_s"):
            m[key] = stats([r[key] for r in ok if r.get(key) is not None])
        if cls == "reactive":
            pre, behind = preemption_latency(recs)
            m["preemption_s"], m["behind_reactive_s"] = stats(pre), stats(behind)
        # what the loop ran when they arrived: a decode step, a chunk, a span of one, idle
        by: dict = {}
        for r in ok:
            if r.get("arrived_during") and r.get("queue_s") is not None:
                by.setdefault(r["arrived_during"].split()[0], []).append(r["queue_s"])
        m["queue_by_arrival"] = {k: {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99)}
                                 for k, xs in sorted(by.items())}
        norm = [r["e2e_s"] / (r["prompt_tokens"] + r["max_tokens"]) for r in ok if r.get("prompt_tokens")]
        m["normalized_s_per_token"] = statistics.fmean(norm) if norm else None
        if ok:
            toks, end = sum(r["max_tokens"] for r in ok), max(r["end_s"] for r in ok)
            m["throughput_tok_s"] = toks / end
        out[cls] = m
    wall = t_span
    out["busy_share"] = {k: round((busy1[k] - busy0[k]) / wall / (2 if k == "cpu_s" else 1), 3)
                         for k in busy1 if k != "pss_mb" and k in busy0}
    out["pss_mb"] = busy1.get("pss_mb")
    out["wall_s"] = wall
    return out


def preemption(results: list) -> str:
    """Reactive pending time (arrival -> first prefill kernel) by what the loop ran when the
    request arrived, and the longest proactive wait (starvation: aging threshold + one batch)."""
    from socllm.policies.agent import AGING_S
    lines = []
    for r in results:
        by = r["reactive"].get("queue_by_arrival") or {}
        if not by:
            continue
        parts = ", ".join(f"{k} n={v['n']} p50 {1e3 * v['p50']:.0f} / p99 {1e3 * v['p99']:.0f} ms"
                          for k, v in by.items())
        q = r["proactive"].get("queue_s") or {}
        pre, behind = r["reactive"].get("preemption_s"), r["reactive"].get("behind_reactive_s")
        parts += (f"; preemption latency n={pre['n']} p50 {1e3 * pre['p50']:.0f} / p90 "
                  f"{1e3 * pre['p90']:.0f} / p99 {1e3 * pre['p99']:.0f} / max {1e3 * pre['max']:.0f} ms"
                  if pre else "") + (f"; queued behind another reactive prefill n={behind['n']}, "
                                     f"max {1e3 * behind['max']:.0f} ms" if behind else "")
        lines.append(f"{r['level']} {r['engine']}: reactive pending behind {parts}; longest proactive "
                     f"wait {q.get('max', 0):.1f} s (aging {AGING_S:g} s); b_rf {r.get('b_rf')}")
    return "\n".join(lines)


def table(results: list) -> str:
    rows = ["| level R:P /min | engine | reactive e2e mean / P90 s | reactive TTFT P90 s | "
            "reactive preemption P50 / P99 ms | proactive e2e mean / P90 s | proactive tok/s | "
            "normalized s/token R / P | busy share |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        r, p = res["reactive"], res["proactive"]
        f = lambda m, k, q, s=1.0: f"{m[k][q] * s:.2f}" if m.get(k) else "n/a"
        q = lambda m: f"{m['preemption_s']['p50'] * 1e3:.0f} / {m['preemption_s']['p99'] * 1e3:.0f}" \
            if m.get("preemption_s") else "n/a"
        norm = lambda m: f"{m['normalized_s_per_token']:.3f}" if m.get("normalized_s_per_token") else "n/a"
        rows.append(f"| {res['level']} | {res['engine']} | {f(r, 'e2e_s', 'mean')} / {f(r, 'e2e_s', 'p90')} | "
                    f"{f(r, 'ttft_s', 'p90')} | {q(r)} | {f(p, 'e2e_s', 'mean')} / {f(p, 'e2e_s', 'p90')} | "
                    f"{p.get('throughput_tok_s', float('nan')):.1f} | {norm(r)} / {norm(p)} | "
                    f"{', '.join(f'{k} {v:.2f}' for k, v in res['busy_share'].items())} |")
    return "\n".join(rows)


def plot(results: list, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = list(dict.fromkeys(r["level"] for r in results))
    engines = list(dict.fromkeys(r["engine"] for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(engines)
    panels = [("reactive", "e2e_s", "reactive end-to-end latency (s)"),
              ("proactive", "e2e_s", "proactive end-to-end latency (s)")]
    for ax, (cls, key, title) in zip(axes, panels):
        for i, e in enumerate(engines):
            res = [next(r for r in results if r["level"] == lv and r["engine"] == e) for lv in levels]
            xs = [j + i * width for j in range(len(levels))]
            mean = [r[cls][key]["mean"] if r[cls].get(key) else 0 for r in res]
            p90 = [r[cls][key]["p90"] if r[cls].get(key) else 0 for r in res]
            ax.bar(xs, mean, width, label=f"{e} mean")
            ax.scatter(xs, p90, marker="_", s=200, color="black", zorder=3,
                       label="P90" if i == 0 else None)
        ax.set(title=title, xticks=[j + 0.4 - width / 2 for j in range(len(levels))],
               xticklabels=[f"R:P {lv}/min" for lv in levels])
        ax.legend(fontsize=7)
    ax = axes[2]
    for i, e in enumerate(engines):
        res = [next(r for r in results if r["level"] == lv and r["engine"] == e) for lv in levels]
        ax.bar([j + i * width for j in range(len(levels))],
               [r["proactive"].get("throughput_tok_s", 0) for r in res], width, label=e)
    ax.set(title="proactive throughput (output tok/s)",
           xticks=[j + 0.4 - width / 2 for j in range(len(levels))],
           xticklabels=[f"R:P {lv}/min" for lv in levels])
    ax.legend(fontsize=7)
    fig.suptitle("Agent.xpu-style mixed trace, 2-core CPU (socllm's gpu = OpenCL on PoCL)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="agents", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--reactive-rate", type=float, default=3.0, help="requests per minute")
    ap.add_argument("--proactive-rate", type=float, default=6.0, help="requests per minute")
    ap.add_argument("--levels", default=None, help="R:P,R:P... several load levels (overrides the rates)")
    ap.add_argument("--engines", default="agent,fcfs,llama-server",
                    help="of agent, agent-nocache (--no-prefix-cache), fcfs, llama-server")
    ap.add_argument("--system-tokens", type=int, default=0,
                    help="a system prompt of about this many tokens, the same before every prompt "
                         "(agents resend theirs with every call: the prefix cache's case)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--llama-server", default=None, help="the binary (default: on PATH or in .venv/bin)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    from socllm.models.gguf_file import default_model_path
    gguf = a.model or default_model_path()
    from socllm.models.gguf_file import open_gguf
    from socllm.models.tokenizer import Tokenizer
    tokenizer = Tokenizer(open_gguf(gguf))
    levels = [tuple(float(x) for x in lv.split(":")) for lv in a.levels.split(",")] if a.levels \
        else [(a.reactive_rate, a.proactive_rate)]
    engines, missing = [], {}
    for name in [e for e in a.engines.split(",") if e]:
        if name in ("agent", "fcfs", "agent-nocache"):
            engines.append(SocllmPolicy(gguf, name.split("-")[0], prefix_cache=name != "agent-nocache",
                                        context=2048 + (a.system_tokens + 63) // 64 * 64))
            continue
        try:
            engines.append(LlamaServerFIFO(gguf, a.llama_server))
        except Exception as e:
            missing[name] = f"{type(e).__name__}: {e}"
            print(f"# {name}: missing ({missing[name]})", file=sys.stderr)
    results, raw = [], []
    for k, (rr, pr) in enumerate(levels):
        items = trace(a.minutes, {"reactive": rr, "proactive": pr}, a.seed + k, tokenizer)
        if a.system_tokens:
            system = system_prompt(a.system_tokens, tokenizer)
            n_sys = len(tokenizer.encode(system))
            items = [(t, c, system + p, m, n + n_sys) for t, c, p, m, n in items]
        level = f"{rr:g}:{pr:g}"
        print(f"# level {level}: {sum(i[1] == 'reactive' for i in items)} reactive, "
              f"{sum(i[1] == 'proactive' for i in items)} proactive requests over {a.minutes:g} min",
              flush=True)
        for eng in engines:
            url = eng.start()
            try:
                b0 = eng.busy()
                recs, t0 = replay(url, items, isinstance(eng, SocllmPolicy))
                span = time.perf_counter() - t0
                b1 = eng.busy()
                eng.enrich(recs)
            finally:
                eng.stop()
            res = summarize(recs, span, b0, b1) | {"engine": eng.name, "level": level}
            if isinstance(eng, SocllmPolicy):
                res |= {k: eng.info.get(k) for k in ("b_rf", "decode_step_ms")}
            results.append(res)
            raw.append({"engine": eng.name, "level": level, "requests": recs})
            print(table([res]).splitlines()[-1], flush=True)
    report = {"device": "2-core CPU: socllm's gpu actor is OpenCL on PoCL (the CPU)",
              "versions": {e.name: e.version for e in engines if hasattr(e, "version")},
              "missing": missing, "settings": vars(a), "lengths": workload.LENGTHS, "results": results,
              "requests": raw}
    print(table(results))
    print(preemption(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot:
        plot(results, a.plot)
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
