"""Stress: many concurrent clients through the Python API and HTTP at once, for a bounded time.

    python -m socllm.scripts.stress [--minutes 10] [--clients 32] [--cancel 0.15]
                                    [--kill-actor gpu@120s] [--json FILE] [--plot FILE.png]

Half the clients use `socllm.connect()`, half stream `/v1/completions` over HTTP; each sends
requests one after another until the time is up, with mixed prompt lengths (5-300 words) and
output lengths (8-256 tokens), and breaks off a share of its streams mid-way (a cancel). It
reports completed, failed, cancelled and lost requests (lost: hung past REQUEST_TIMEOUT_S, or
a stream that ended before it finished: over HTTP without a finish_reason and `data: [DONE]`,
through Python cancelled by the service while its client still read it), latency percentiles, and the PSS of socllm's
processes sampled every few seconds (a plot with --plot). It starts a private service in its own
Ray instance and checks at the end that no request is left in the table and every KV block is free.
Exit status 1 if anything was lost or failed, or memory grew (last minute's mean more than 5 %
above the second minute's, for runs of 3 minutes or more).

--kill-actor NAME@Ts SIGKILLs that processor actor's process (cpu, gpu or npu) T seconds in. The
service must carry on (Ray restarts the actor, the service redoes the lost step): the report gives
the gap in the token flow around the kill, the service's own recovery record, and whether the
requests that were running across the kill (all greedy) return the same text when run again
after the soak, beside as many undisturbed ones run again the same way (a control: a decode
batch's arithmetic at q8 depends on its row count, so a rerun may differ without any kill).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time

import requests

from socllm.actors.front.client import RequestCancelled

from .serve_bench import DATA, Socllm, pct

REQUEST_TIMEOUT_S = 300.0
SAMPLE_S = 5.0


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {"completed": 0, "failed": 0, "cancelled": 0, "lost": 0}
        self.ttft, self.latency, self.errors = [], [], []
        self.done = []              # completed: (kind, prompt, max_tokens, text, start, end)
        self.pieces = []            # when each piece arrived (time.time())

    def add(self, outcome: str, ttft=None, latency=None, error=None, record=None):
        with self.lock:
            self.counts[outcome] += 1
            if record is not None and outcome == "completed":
                self.done.append(record)
            if ttft is not None:
                self.ttft.append(ttft)
            if latency is not None and outcome == "completed":
                self.latency.append(latency)
            if error:
                self.errors.append(error)


def one_request(kind, client, url, words, rng, cancel_share, tally):
    text = " ".join(words[rng.randrange(0, len(words) - 300):][:rng.randint(5, 300)])
    max_tokens = rng.randint(8, 256)
    cancel_after = rng.randint(1, 8) if rng.random() < cancel_share else None
    t0, first, n = time.perf_counter(), None, 0
    done = threading.Event()
    result, parts, start = {}, [], time.time()
    ending = {}             # HTTP: the finish_reason seen and whether [DONE] came

    def run():
        nonlocal first, n
        try:
            if kind == "python":
                pieces = client.generate(text, max_tokens=max_tokens, stream=True)
            else:
                r = requests.post(url + "/v1/completions", stream=True, timeout=REQUEST_TIMEOUT_S,
                                  json={"prompt": text, "max_tokens": max_tokens, "stream": True})
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                pieces = _sse_texts(r, ending)
            for piece in pieces:
                first = first or time.perf_counter()
                n += 1
                parts.append(piece)
                tally.pieces.append(time.time())
                if cancel_after is not None and n >= cancel_after:
                    pieces.close()
                    if kind == "http":
                        r.close()
                    result["outcome"] = "cancelled"
                    return
            if kind == "http" and not (ending.get("finish_reason") and ending.get("done")):
                result.update(outcome="lost", error=f"http: the stream ended without "
                              f"{'a finish_reason' if not ending.get('finish_reason') else '[DONE]'}")
            else:
                result["outcome"] = "completed"
        except RequestCancelled as e:       # the service ended a stream its client still read
            result.update(outcome="lost", error=f"{kind}: {str(e)[:200]}")
        except Exception as e:
            result.update(outcome="failed", error=f"{kind}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            done.set()
    threading.Thread(target=run, daemon=True).start()
    if not done.wait(REQUEST_TIMEOUT_S):
        tally.add("lost", error=f"{kind}: no end after {REQUEST_TIMEOUT_S:.0f} s")
        return
    tally.add(result["outcome"], ttft=(first - t0) if first else None,
              latency=time.perf_counter() - t0, error=result.get("error"),
              record=(kind, text, max_tokens, "".join(parts), start, time.time()))


def _sse_texts(r, ending: dict):
    """The text pieces of an OpenAI completions stream; records in `ending` the finish_reason
    and whether `data: [DONE]` closed it (a stream cut short has neither)."""
    for line in r.iter_lines():
        if line == b"data: [DONE]":
            ending["done"] = True
        elif line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
            choice = chunk["choices"][0]
            if choice.get("finish_reason"):
                ending["finish_reason"] = choice["finish_reason"]
            yield choice.get("text", "")


def parse_kill(ap, spec):
    if spec is None:
        return None
    name, _, at = spec.partition("@")
    try:
        seconds = float(at.rstrip("s"))
    except ValueError:
        seconds = -1
    if name not in ("cpu", "gpu", "npu") or seconds < 0:
        ap.error(f"--kill-actor takes NAME@SECONDS with NAME cpu, gpu or npu (e.g. gpu@120s), got {spec!r}")
    return name, seconds


def kill_at(svc, t_start, name, seconds, out):
    import os
    import signal

    import ray
    time.sleep(max(0.0, t_start + seconds - time.time()))
    st = ray.get(svc.svc.status.remote())
    pid = next(p["pid"] for p in st["processors"] if p["processor"] == name)
    out.update(actor=name, pid=pid, at=time.time(), at_s=time.time() - t_start,
               recoveries_before=st["recoveries_total"])
    os.kill(pid, signal.SIGKILL)


def recovery_report(client, tally, killed, final) -> dict:
    """The kill's effect: the token flow's gap, the service's record, and greedy reruns."""
    t = killed["at"]
    after = [p for p in tally.pieces if p > t]
    across = [r for r in tally.done if r[4] < t < r[5]]
    rng = random.Random(0)
    calm = [r for r in tally.done if r[5] < t - 5 or r[4] > t + 60]
    control = rng.sample(calm, min(len(calm), len(across)))

    def rerun(recs):
        out = [None] * len(recs)

        def one(i):
            out[i] = client.generate(recs[i][1], max_tokens=recs[i][2])
        for lo in range(0, len(recs), 16):                 # batches as large as the soak's
            threads = [threading.Thread(target=one, args=(i,)) for i in range(lo, min(lo + 16, len(recs)))]
            for th in threads:
                th.start()
            for th in threads:
                th.join(REQUEST_TIMEOUT_S)
        return sum(o == r[3] for o, r in zip(out, recs))
    rec = final["recoveries"][-1] if final["recoveries_total"] > killed["recoveries_before"] else None
    return {"actor": killed["actor"], "pid": killed["pid"], "at_s": killed["at_s"],
            "gap_s": (after[0] - max([p for p in tally.pieces if p <= t], default=t)) if after else float("inf"),
            "service": rec, "disturbed": len(across), "disturbed_same": rerun(across),
            "control": len(control), "control_same": rerun(control)}


def plot(report: dict, path: str):
    """PSS over the run (and the kill, if any); also from a saved --json report."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    memory, a, fault = report["memory"], report["settings"], report.get("kill")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t for t, _, _ in memory], [m for _, m, _ in memory], marker=".")
    title = f"stress: {a['clients']} clients, {a['minutes']:g} min (2-core CPU)"
    if fault:
        ax.axvline(fault["at_s"], color="tab:red", linestyle="--")
        title += f"; {fault['actor']} actor killed at {fault['at_s']:.0f} s"
    ax.set(xlabel="seconds", ylabel="PSS of socllm's processes (MB)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="stress", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--cancel", type=float, default=0.15, help="share of streams broken off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-actor", default=None, metavar="NAME@Ts",
                    help="SIGKILL a processor actor (cpu, gpu, npu) that many seconds in, e.g. gpu@120s")
    ap.add_argument("--precision", default=None, help="the service's (default: socllm serve's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    kill = parse_kill(ap, a.kill_actor)
    import ray

    import socllm
    from socllm.models.gguf_file import default_model_path
    svc = Socllm(default_model_path(), max_seqs=16, precision=a.precision)
    client = socllm.connect()
    words = open(DATA).read().split()
    tally, memory, by_process = Tally(), [], []
    t_start = time.time()
    deadline = t_start + a.minutes * 60
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.wait(SAMPLE_S):
            st = ray.get(svc.svc.status.remote())
            memory.append((time.time() - t_start, st["memory_pss_mb"], st["kv"]["blocks_used"]))
            by_process.append(st["memory_pss_mb_by_process"])
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    killed = {}
    if kill:
        threading.Thread(target=kill_at, args=(svc, t_start, *kill, killed), daemon=True).start()

    def worker(i):
        rng = random.Random(a.seed * 1000 + i)
        kind = "python" if i % 2 == 0 else "http"
        while time.time() < deadline:
            one_request(kind, client, svc.url, words, rng, a.cancel, tally)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.minutes * 60 + 2 * REQUEST_TIMEOUT_S)
    time.sleep(1.0)                    # the last cancels reach the service
    stop_sampling.set()
    final = ray.get(svc.svc.status.remote())
    left = {k: v for k, v in final["requests"].items() if k in ("waiting", "prefilling", "decoding") and v}
    fault = recovery_report(client, tally, killed, final) if kill else None
    svc.close()

    flat = None
    if a.minutes >= 3:
        second = [m for t, m, _ in memory if 60 <= t < 120]
        last = [m for t, m, _ in memory if t >= memory[-1][0] - 60]
        flat = statistics.mean(last) <= 1.05 * statistics.mean(second)
    report = {"device": "2-core CPU (socllm's gpu actor: OpenCL on PoCL)", "settings": vars(a),
              "counts": tally.counts, "errors": tally.errors[:20],
              "ttft_ms": {f"p{q}": 1e3 * pct(tally.ttft, q) for q in (50, 90, 99)},
              "latency_s": {f"p{q}": pct(tally.latency, q) for q in (50, 90, 99)},
              "memory": memory, "memory_by_process": by_process[::6], "left_in_table": left, "kv_blocks_used_at_end": final["kv"]["blocks_used"],
              "memory_flat": flat, "kill": fault}
    c = tally.counts
    print(f"completed {c['completed']}  failed {c['failed']}  cancelled {c['cancelled']}  lost {c['lost']}"
          f"  | ttft p50/p90/p99 {report['ttft_ms']['p50']:.0f}/{report['ttft_ms']['p90']:.0f}/"
          f"{report['ttft_ms']['p99']:.0f} ms  | PSS {memory[0][1] if memory else 0:.0f} -> "
          f"{memory[-1][1] if memory else 0:.0f} MB  | left in table {left or 'none'}, KV blocks "
          f"in use at the end {final['kv']['blocks_used']}  | memory flat: {flat}")
    for e in tally.errors[:5]:
        print("  error:", e)
    if fault:
        print(f"killed {fault['actor']} (pid {fault['pid']}) at {fault['at_s']:.0f} s: token flow back after "
              f"{fault['gap_s']:.2f} s (service: {fault['service']}); rerun of the {fault['disturbed']} requests "
              f"running across the kill: {fault['disturbed_same']} identical; of {fault['control']} "
              f"undisturbed ones: {fault['control_same']} identical")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot and memory:
        plot(report, a.plot)
    bad = c["lost"] or c["failed"] or left or final["kv"]["blocks_used"] or flat is False \
        or (fault and (not fault["service"] or fault["gap_s"] > 30))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
