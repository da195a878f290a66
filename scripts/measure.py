"""Measure socllm's plans on this machine: prefill and decode tokens/s, TTFT, memory, NPU compile.

    .venv/bin/python -m socllm.scripts.measure [--plans gpu,npu,hetero,cpu] [--reps 3]

Prints one JSON object. Every figure names the device it came from (PoCL is OpenCL on the CPU;
the NPU actor runs OpenVINO's CPU device under NPU rules on a machine without an NPU). The
comparison with llama.cpp and OpenVINO GenAI is `socllm bench` (the speed issue).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
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
    a = ap.parse_args(argv)
    from socllm.actors.engine import Engine
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    eng = Engine(context=2048)
    out = {"engine_start_s": time.perf_counter() - t0, "threads": eng.threads, "plans": {}}
    try:
        info = eng.info()
        out["devices"] = {d["processor"]: d.get("device", d.get("api")) for d in info}
        text = open(__file__).read()                      # a fixed, ordinary English/code text
        base = eng.tokenizer.encode(text)
        for plan in a.plans.split(","):
            reps = a.reps if plan != "cpu" else 1
            n_dec = a.decode if plan != "cpu" else 16
            res = {}
            for n in [int(x) for x in a.prompts.split(",")]:
                ids = base[:n]
                eng.generate_ids(ids, plan=plan, max_tokens=2)          # warm: compile, install
                runs = [eng.generate_ids(ids, plan=plan, max_tokens=n_dec, ignore_eos=True)["timings"]
                        for _ in range(reps)]
                res[f"prompt_{n}"] = {k: stats([r[k] for r in runs]) for k in runs[0]}
                res[f"prompt_{n}"]["decode_tokens"] = n_dec
            res["memory"] = memory(eng.pids())
            out["plans"][plan] = res
            print(json.dumps({plan: res}), flush=True)
        out["npu_compile_s"] = next((d["compile_s"] for d in eng.info() if d["processor"] == "npu"), None)
        out["memory_all_plans"] = memory(eng.pids())
        out["gguf_mb"] = os.path.getsize(eng.model_path) / 1e6
        out["kv_mb"] = len(eng.layout.kv) * eng.layout.kv_rows * eng.layout.kv_cols * 4 / 1e6
    finally:
        eng.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
