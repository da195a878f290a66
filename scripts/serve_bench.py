"""Serving benchmark: N concurrent streaming clients against socllm's service and its peers.

    python -m socllm.scripts.serve_bench [--clients 1,2,4,8,16] [--prompt-words 64]
        [--max-tokens 128] [--requests 2] [--reps 1] [--json FILE] [--plot FILE.png]
        [--peers llama-server,openvino-genai] [--precision q8|q16|f32] [--plan P] [--python-client]

Each client sends `--requests` requests one after another, each a distinct prompt of
`--prompt-words` words (public-domain text, so no engine reuses a cached prefix) and `--max-tokens`
output tokens (greedy, EOS ignored). socllm and llama.cpp's `llama-server --parallel N` (continuous
batching; scripts/build_llama_server.sh builds it) are measured through the same streaming HTTP
client (`/v1/completions`, server-sent events); OpenVINO GenAI's ContinuousBatchingPipeline has no
server, so it runs with all of a level's requests added at once, in a process of its own for
each level (scripts/ov_serving.py run_ov_cb_process; it ran in this process before 2026-11-28). Same GGUF, thread budget 2 everywhere; engines alternate within each
repetition. Reported per engine and level: aggregate output tokens/s, TTFT and inter-token
latency percentiles (p50/p90/p99), time per output token (each request's mean gap; p50/p90), and
PSS of the engine's processes after the level.
A missing peer is reported as missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

import requests

from socllm.actors.metrics import pss_mb

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pride_and_prejudice_ch1-2.txt")


def prompts(n: int, words: int, salt: int) -> list:
    text = open(DATA).read().split()
    out = []
    for i in range(n):
        start = (salt * 7919 + i * 211) % (len(text) - words)
        out.append(" ".join(text[start:start + words]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_socllm(gguf: str, **knobs) -> tuple:
    """socllm's service in this process's Ray (started here, 2 CPUs, if it is not yet), behind its
    HTTP ingress on a free port: (the service actor, its describe(), the URL). knobs: ServeConfig's."""
    import ray

    from socllm.actors.front.http import deploy
    from socllm.actors.service import NAME, NAMESPACE, Service
    from socllm.policies.config import ServeConfig
    from socllm.policies.threads import actor_env
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=NAMESPACE,
                 log_to_driver=False, logging_level="ERROR",
                 _system_config={"worker_niceness": 0, "enable_worker_prestart": False,
                                 "prestart_worker_first_driver": False})
    svc = Service.options(name=NAME, namespace=NAMESPACE, runtime_env={"env_vars": actor_env(2)}).remote(
        ServeConfig.from_env(model=gguf, threads=2, **knobs))
    info = ray.get(svc.ready.remote())
    return svc, info, deploy("127.0.0.1", free_port())


def stop_socllm(svc):
    """The ingress removed, the service shut down and gone (Ray stays up for the next engine)."""
    import ray

    from socllm.actors.front.http import undeploy
    undeploy()
    ray.get(svc.shutdown.remote(), timeout=120)
    ray.kill(svc)
    time.sleep(2)


def start_llama_server(binary: str, gguf: str, parallel: int, context: int) -> tuple:
    """llama-server on a free port, 2 threads, answering /health: (its process, the URL)."""
    port = free_port()
    proc = subprocess.Popen([binary, "-m", gguf, "-t", "2", "-tb", "2", "--parallel", str(parallel),
                             "-c", str(context), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 120
    while True:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        if time.time() > end or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("llama-server did not start")
        time.sleep(0.2)


def pct(xs, q) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# -- one streaming request over HTTP ----------------------------------------------------------
def stream_one(url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """Its tokens are the usage's where the server sends one (a chunk may carry several tokens:
    socllm's carry what was made since its last), else one a chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    times, tokens = [], None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not times:
        raise RuntimeError(f"no tokens from {url}")
    tokens = tokens or len(times)
    return {"ttft_s": times[0] - t0, "itl_s": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens,
            "tpot_s": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None}


def http_level(url: str, n: int, per_client: int, words: int, max_tokens: int, salt: int,
               extra: dict | None = None) -> dict:
    return clients_level(n, per_client, prompts(n * per_client, words, salt),
                         lambda text: stream_one(url, text, max_tokens, extra or {}))


def clients_level(n: int, per_client: int, texts: list, one) -> dict:
    """n client threads, each sending its per_client texts one after another through one(text)
    -> a request's timings; summarized over the level's wall time."""
    results, errors = [], []

    def client(i):
        for k in range(per_client):
            try:
                results.append(one(texts[i * per_client + k]))
            except Exception as e:     # reported, and the level counts it
                errors.append(f"{type(e).__name__}: {e}")
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(results, time.perf_counter() - t0, errors)


def summarize(results: list, wall: float, errors=()) -> dict:
    itl = [g for r in results for g in r["itl_s"]]       # between chunks, not tokens
    ttft = [r["ttft_s"] for r in results]
    # time per output token of each request (first to last chunk over its tokens): unlike the
    # gaps between chunks, it does not depend on how a server groups tokens into chunks
    # (socllm's carry what its streams made in the last 20-50 ms, actors/front/client.py)
    tpot = [r.get("tpot_s") or sum(r["itl_s"]) / len(r["itl_s"]) for r in results
            if r.get("tpot_s") or r["itl_s"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "errors": list(errors), "output_tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall if wall else 0.0,
            **{f"ttft_p{q}_ms": 1e3 * pct(ttft, q) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": 1e3 * pct(itl, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": 1e3 * pct(tpot, q) for q in (50, 90)}}


# -- the engines -------------------------------------------------------------------------------
class Socllm:
    name = "socllm"

    def __init__(self, gguf: str, max_seqs: int, precision: str | None = None,
                 speculate: str | None = None, plan: str | None = None):
        knobs = {"precision": precision, "speculate": speculate, "plan": plan}
        self.svc, self.info, self.url = start_socllm(
            gguf, max_seqs=max_seqs, **{k: v for k, v in knobs.items() if v})
        pl = self.info["placement"]
        self.version = f"socllm (plan {self.info['plan']}: prefill on the {pl['prefill']}, decode on " \
                       f"the {pl['decode']}, PoCL; {self.info['precision']})"

    def level(self, n, per_client, words, max_tokens, salt) -> dict:
        import ray
        out = http_level(self.url, n, per_client, words, max_tokens, salt)
        out["pss_mb"] = ray.get(self.svc.status.remote())["memory_pss_mb"]
        return out

    def close(self):
        import ray
        try:
            ray.get(self.svc.shutdown.remote(), timeout=60)
        finally:
            ray.shutdown()


class SocllmPython:
    """The same service through socllm's Python client (Ray, no HTTP), from this process's
    threads: beside OpenVINO GenAI, which is measured in this process, what the HTTP front end
    (Ray Serve's proxy and the ingress, on the same cores) costs."""
    name = "socllm-python"

    def __init__(self, served: Socllm):
        import socllm
        self.served, self.client = served, socllm.connect()
        self.version = served.version + ", Python client"

    def level(self, n, per_client, words, max_tokens, salt) -> dict:
        import ray

        def one(prompt):
            t0, times, out = time.perf_counter(), [], None
            for out in self.client.polls(self.client.submit(prompt=prompt, max_tokens=max_tokens,
                                                            temperature=0, ignore_eos=True)):
                if out["pieces"]:
                    times.append(time.perf_counter())
            tokens = out["usage"]["completion_tokens"]
            return {"ttft_s": times[0] - t0, "itl_s": [b - a for a, b in zip(times, times[1:])],
                    "tokens": tokens,
                    "tpot_s": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None}

        # prompts of their own: the HTTP row's, sent to the same service just before, would be
        # found in its prefix cache
        out = clients_level(n, per_client, prompts(n * per_client, words, salt + 5000), one)
        out["pss_mb"] = ray.get(self.served.svc.status.remote())["memory_pss_mb"]
        return out

    def close(self):
        pass


class LlamaServer:
    name = "llama-server"

    def __init__(self, gguf: str, binary: str | None):
        self.gguf = gguf
        self.binary = binary or shutil.which("llama-server") or os.path.join(
            os.path.dirname(sys.executable), "llama-server")
        if not os.path.exists(self.binary):
            raise FileNotFoundError("llama-server is not built (scripts/build_llama_server.sh)")
        self.version = subprocess.run([self.binary, "--version"], capture_output=True,
                                      text=True).stderr.strip().splitlines()[0]

    def level(self, n, per_client, words, max_tokens, salt) -> dict:
        proc, url = start_llama_server(self.binary, self.gguf, n, max(2048, n * 512))
        try:
            out = http_level(url, n, per_client, words, max_tokens, salt, {"n_predict": max_tokens})
            out["pss_mb"] = pss_mb([proc.pid])
            return out
        finally:
            proc.terminate()
            proc.wait(30)

    def close(self):
        pass


class OVGenAI:
    name = "openvino-genai"

    def __init__(self, gguf: str):
        # each level in a process of its own (its TBB workers apart from the engine run next)
        from .ov_serving import run_ov_cb_process
        import openvino_genai                 # raises ImportError without openvino-genai
        self.run, self.gguf, self.version = run_ov_cb_process, gguf, f"OpenVINO GenAI {openvino_genai.__version__}"

    def level(self, n, per_client, words, max_tokens, salt) -> dict:
        results, wall, pss = [], 0.0, 0.0
        texts = prompts(n * per_client, words, salt)
        for k in range(per_client):       # each client's requests one after another
            r = self.run(self.gguf, texts[k * n:(k + 1) * n], max_tokens, 2)
            results += r["requests"]
            wall += r["wall_s"]
            pss = max(pss, r["pss_mb"])
        out = summarize(results, wall)
        out["pss_mb"] = pss
        return out

    def close(self):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="serve_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured levels each engine runs first (its largest client count, one "
                         "request each): a just-started engine's first load is not its speed")
    ap.add_argument("--peers", default="llama-server,openvino-genai")
    ap.add_argument("--llama-server", default=None, help="the binary (default: on PATH or in .venv/bin)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--precision", default=None, help="socllm's (default: the service's default)")
    ap.add_argument("--speculate", default=None, help="socllm's --speculate (default: the service's, auto)")
    ap.add_argument("--plan", default=None, help="socllm's --plan (default: the service's, auto)")
    ap.add_argument("--python-client", action="store_true",
                    help="also socllm's service through its Python client (Ray, no HTTP)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    from socllm.models.gguf_file import default_model_path
    gguf = a.model or default_model_path()
    levels = [int(x) for x in a.clients.split(",")]
    engines, missing = [], {}
    makers = {"llama-server": lambda: LlamaServer(gguf, a.llama_server), "openvino-genai": lambda: OVGenAI(gguf)}
    for p in [p for p in a.peers.split(",") if p]:
        try:
            engines.append(makers[p]())
        except Exception as e:
            missing[p] = f"{type(e).__name__}: {e}"
            print(f"# {p}: missing ({missing[p]})", file=sys.stderr)
    engines.insert(0, Socllm(gguf, max(levels), a.precision, a.speculate, a.plan))
    if a.python_client:
        engines.insert(1, SocllmPython(engines[0]))
    rows = []
    try:
        for w in range(a.warmup):
            for eng in engines:
                eng.level(max(levels), 1, a.prompt_words, min(32, a.max_tokens), salt=9000 + w)
        for rep in range(a.reps):
            for n in levels:
                for eng in engines:           # alternate: noise falls on every engine alike
                    r = eng.level(n, a.requests, a.prompt_words, a.max_tokens, salt=rep * 100 + n)
                    r.update(engine=eng.name, clients=n, rep=rep)
                    rows.append(r)
                    print(f"{eng.name:>15} x{n:<3} {r['tok_s']:7.1f} tok/s  ttft p50 {r['ttft_p50_ms']:7.0f} ms"
                          f"  itl p50/p90/p99 {r['itl_p50_ms']:.0f}/{r['itl_p90_ms']:.0f}/"
                          f"{r['itl_p99_ms']:.0f} ms  pss {r['pss_mb']:.0f} MB  errors {len(r['errors'])}",
                          flush=True)
    finally:
        for eng in engines:
            eng.close()
    report = {"device": "2-core CPU: socllm's gpu actor is OpenCL on PoCL (the CPU)",
              "versions": {e.name: e.version for e in engines}, "missing": missing,
              "settings": vars(a), "rows": rows}
    print(table(rows, [e.name for e in engines], levels))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot:
        plot(rows, [e.name for e in engines], levels, a.plot)
    return 0


def median_of(rows, eng, n, key):
    vals = [r[key] for r in rows if r["engine"] == eng and r["clients"] == n]
    return statistics.median(vals) if vals else float("nan")


def table(rows, names, levels) -> str:
    out = ["| engine | clients | tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50/p90 ms | PSS MB |",
           "|---|---|---|---|---|---|---|"]
    for n in levels:
        for e in names:
            m = lambda k: median_of(rows, e, n, k)
            out.append(f"| {e} | {n} | {m('tok_s'):.1f} | {m('ttft_p50_ms'):.0f}/{m('ttft_p90_ms'):.0f}/"
                       f"{m('ttft_p99_ms'):.0f} | {m('itl_p50_ms'):.0f}/{m('itl_p90_ms'):.0f}/"
                       f"{m('itl_p99_ms'):.0f} | {m('tpot_p50_ms'):.0f}/{m('tpot_p90_ms'):.0f} | "
                       f"{m('pss_mb'):.0f} |")
    return "\n".join(out)


def plot(rows, names, levels, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for e in names:
        a.plot(levels, [median_of(rows, e, n, "tok_s") for n in levels], marker="o", label=e)
        key = "tpot_p50_ms" if all("tpot_p50_ms" in r for r in rows) else "itl_p50_ms"
        b.plot(levels, [median_of(rows, e, n, key) for n in levels], marker="o", label=e)
    a.set(xlabel="concurrent clients", ylabel="aggregate output tok/s", xscale="log", title="throughput")
    b.set(xlabel="concurrent clients", ylabel=f"{key.split('_')[0].upper()} p50 (ms)", xscale="log",
          title="time per output token" if key.startswith("tpot") else "inter-token latency")
    a.legend()
    fig.suptitle("2-core CPU (socllm's gpu = OpenCL on PoCL)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
