"""Time to first token of one request at a time on the running service (`socllm serve`), by
prompt length, through the Python client: where a plan's prefill chunks run shows here.

    ray start --head && socllm serve [--plan P] && python -m socllm.scripts.serve_ttft [--reps 6]

Three prompts (~8, ~100, ~400 tokens), each rep with its own first word so that no prefix is
in the cache; 4 tokens, no drafts. Prints min/median/max ms per prompt (the first rep is a
warm-up) and the service's plan, and the steps each program ran (`status`'s steps_by_program).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import socllm

PROMPTS = {"short": "Hi, who are you?",
           "mid": "Summarise: " + "The quick brown fox jumps over the lazy dog. " * 9,
           "long": "Summarise: " + "The quick brown fox jumps over the lazy dog. " * 40}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args(argv)
    c = socllm.connect()
    before = c.status()["steps_by_program"]
    out = {"plan": c.status()["plan"], "ttft_ms": {}}
    for name, prompt in PROMPTS.items():
        ts = []
        for r in range(a.reps):
            t = time.perf_counter()
            for _ in c.generate(f"{r * 7919} {prompt}", stream=True, max_tokens=4, speculate="off"):
                ts.append(1e3 * (time.perf_counter() - t))
                break
        ts = ts[1:]
        out["ttft_ms"][name] = {"min": min(ts), "median": statistics.median(ts), "max": max(ts)}
        print(f"{name:<6} ttft ms {min(ts):6.1f} / {statistics.median(ts):6.1f} / {max(ts):6.1f}")
    after = c.status()["steps_by_program"]
    out["steps_by_program"] = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    print(f"plan {out['plan']}; steps {out['steps_by_program']}")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
