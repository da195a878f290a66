"""Measure socllm's plans on this machine: prefill and decode tokens/s, TTFT, memory, NPU compile.

    .venv/bin/python -m socllm.scripts.measure [--plans gpu,npu,hetero,cpu] [--reps 3] [--json FILE]

Plans alternate within each repetition, so the machine's noise falls on all alike. Prints one
JSON object (and writes it to --json FILE). Every figure names the device it came from (PoCL is OpenCL on the CPU;
the NPU actor runs OpenVINO's CPU device under NPU rules on a machine without an NPU). The
comparison with llama.cpp and OpenVINO GenAI is `socllm bench` (the speed issue).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import psutil


def memory(pids: list) -> dict:
    rss = pss = 0
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            continue
        rss += m.rss
        pss += m.pss
    return {"rss_mb": rss / 1e6, "pss_mb": pss / 1e6}


def stats(xs: list) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", default="gpu,npu,hetero,cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    from socllm.actors.pool import Pool
    t0 = time.perf_counter()
    eng = Pool(context=2048)
    out = {"engine_start_s": time.perf_counter() - t0, "threads": eng.threads, "plans": {}}
    try:
        info = eng.info()
        out["devices"] = {d["processor"]: d.get("device", d.get("api")) for d in info}
        text = open(__file__).read()                      # a fixed, ordinary English/code text
        base = eng.tokenizer.encode(text)
        plans = a.plans.split(",")
        for plan in plans:                                 # warm: compile, install; memory so far
            for n in [int(x) for x in a.prompts.split(",")]:
                eng.generate_ids(base[:n], plan=plan, max_tokens=2)
            out["plans"][plan] = {"memory_after_warmup": memory(eng.pids())}
        for n in [int(x) for x in a.prompts.split(",")]:
            runs = {plan: [] for plan in plans}
            for rep in range(a.reps):                      # plans alternate: noise falls on all alike
                for plan in plans:
                    if plan == "cpu" and rep:
                        continue
                    n_dec = a.decode if plan != "cpu" else 16
                    runs[plan].append(eng.generate_ids(base[:n], plan=plan, max_tokens=n_dec,
                                                       ignore_eos=True)["timings"])
            for plan, rs in runs.items():
                res = {k: stats([r[k] for r in rs]) for k in rs[0]}
                res["decode_tokens"] = a.decode if plan != "cpu" else 16
                out["plans"][plan][f"prompt_{n}"] = res
                print(json.dumps({plan: {f"prompt_{n}": res}}), flush=True)
        out["npu_compile_s"] = next((d["compile_s"] for d in eng.info() if d["processor"] == "npu"), None)
        out["memory_all_plans"] = memory(eng.pids())
        out["gguf_mb"] = os.path.getsize(eng.model_path) / 1e6
        out["kv_mb"] = len(eng.layout.kv) * eng.layout.kv_rows * eng.layout.kv_cols * 4 / 1e6
    finally:
        eng.close()
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
