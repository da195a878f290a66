"""Where a served batch's time goes: N concurrent streaming HTTP completions against a running
`socllm serve`, and the service's own loop counters over the same requests (`socllm status`'s
"loop"): seconds in prefill chunks and in decode steps, steps and rows.

    ray start --head && socllm serve && python -m socllm.scripts.serve_breakdown [--clients 8]
        [--reps 2] [--url http://127.0.0.1:8000] [--json FILE]

The workload is serve_bench's (public-domain prompts of 64 words, 128 tokens each, greedy, EOS
ignored; every rep new prompts, so no prefix is cached), all clients at once, as OpenVINO GenAI's
ContinuousBatchingPipeline is given its requests in scripts/serve_bench.py.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import requests

import socllm
from socllm.scripts.serve_bench import prompts


def one(url: str, prompt: str, max_tokens: int, out: list):
    r = requests.post(url + "/v1/completions", stream=True, timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
        "temperature": 0, "stream_options": {"include_usage": True}})
    r.raise_for_status()
    tokens = 0
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            usage = json.loads(line[6:]).get("usage")
            tokens = usage["completion_tokens"] if usage else tokens
    out.append(tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="serve_breakdown", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    client = socllm.connect()
    texts = prompts(a.clients * (a.reps + 1), 64, 3)
    one(a.url, texts[-1], 8, [])                      # warm: the HTTP path's first request
    runs = []
    for rep in range(a.reps):
        before, outs = client.status()["loop"], []
        threads = [threading.Thread(target=one, args=(a.url, p, a.max_tokens, outs))
                   for p in texts[rep * a.clients:(rep + 1) * a.clients]]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = client.status()["loop"]
        loop = {k: round(after[k] - before[k], 3) for k in after}
        run = {"wall_s": round(wall, 3), "tokens": sum(outs), "tok_s": round(sum(outs) / wall, 1),
               "loop": loop,
               "decode_ms_a_step": round(1e3 * loop["decode_s"] / max(1, loop["decode_steps"]), 2),
               "kernels_ms_a_step": round(1e3 * loop["decode_kernels_s"] / max(1, loop["decode_steps"]), 2),
               "rows_a_step": round(loop["decode_rows"] / max(1, loop["decode_steps"]), 2)}
        runs.append(run)
        print(f"{run['tokens']} tokens in {wall:.2f} s ({run['tok_s']} tok/s): prefill "
              f"{loop['prefill_s']:.2f} s in {loop['prefill_chunks']} chunks, decode "
              f"{loop['decode_s']:.2f} s in {loop['decode_steps']} steps "
              f"({run['decode_ms_a_step']} ms, {run['kernels_ms_a_step']} in the step's kernels, "
              f"{run['rows_a_step']} rows a step)")
    if a.json:
        st = client.status()
        with open(a.json, "w") as f:
            json.dump({"clients": a.clients, "max_tokens": a.max_tokens, "plan": st["plan"],
                       "precision": st["precision"], "policy": st["policy"],
                       "speculation": st["speculation"].get("mode"),
                       "device": [p.get("device") for p in st["processors"]],
                       "date": time.strftime("%Y-%m-%d"), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
