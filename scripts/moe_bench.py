"""Mixture-of-experts prefill and decode on this machine (issue 29's targets): the TTFT of a long
prompt with the NPU's grouped expert graphs (NPUMoE §4), against its two baselines on the NPU (a
graph per expert at the chunk's full size; one graph running every row through every expert), the
MoE layers on the CPU (the GPU actor's OpenCL kernels, which PoCL runs on this machine's CPU) and
llama.cpp on the same file; decode tokens/s against llama.cpp. One request at a time through
Pool.generate_ids (the service's paged programs), greedy; engines and peers alternate within a
repetition, each repetition on new prompt ids.

    python -m socllm.scripts.moe_bench --model F.gguf [--prompt 1024] [--decode 64] [--reps 3]
                                       [--variants hetero,grouped,per_expert,dense,gpu]
                                       [--precision q16] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .bench import Socllm, prompt_ids, stats
from .peers import PeerMissing, PeerProcess

# variant -> (serving plan, the NPU's moe_graphs)
VARIANTS = {"hetero": ("hetero", "dense"),      # the service's default: NPU prefill, GPU decode
            "grouped": ("npu", "grouped"), "per_expert": ("npu", "per_expert"),
            "dense": ("npu", "dense"), "gpu": ("gpu", "grouped"), "cpu": ("cpu", "grouped")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="hetero,grouped,per_expert,dense,gpu")
    p.add_argument("--precision", default="q16")
    p.add_argument("--overflow", default="spill")
    p.add_argument("--peers", default="llama.cpp")
    p.add_argument("--json")
    a = p.parse_args(argv)
    from socllm.actors.front.cluster import _start_private_ray, stop_ray
    from socllm.actors.pool import Pool
    from socllm.actors.service import KV_DTYPE
    from socllm.actors.metrics import pss_mb
    # the private Ray that socllm.LLM and `socllm generate` start (actors/front/cluster.py): its
    # workers at nice 0, none idle. A plain ray.init ran the actors at Ray's nice 15 beside two
    # idle workers, and decode measured ~12 % slower for it
    _start_private_ray(2)
    names = [v for v in a.variants.split(",") if v]
    engines, runners = {}, []
    for name in names:
        plan, graphs = VARIANTS[name]
        if graphs not in engines:
            engines[graphs] = Pool(model=a.model, context=a.prompt + a.decode + 64, threads=2,
                                   moe_graphs=graphs, moe_overflow=a.overflow,
                                   kv_dtype=KV_DTYPE[a.precision])     # the service's
        r = Socllm(engines[graphs], f"{plan}/{a.precision}")
        r.name = f"socllm:{name}"
        runners.append(r)
    eng = next(iter(engines.values()))
    for peer in [x for x in a.peers.split(",") if x]:
        try:
            runners.append(PeerProcess(peer, a.model, 2, context=a.prompt + a.decode + 64))
        except PeerMissing as e:
            print(f"peer {peer}: MISSING ({e})", file=sys.stderr)
    ids = [prompt_ids(eng.tokenizer, a.prompt, v) for v in range(a.reps + 1)]
    for r in runners:                                        # warm-up: compiles, caches
        r.run(ids[0], 2)
    raw = {r.name: [] for r in runners}
    for rep in range(a.reps):
        for r in runners:
            res = r.run(ids[rep + 1], a.decode)
            raw[r.name].append(res)
            print(f"rep {rep + 1}/{a.reps} {r.name:20s} ttft {res['ttft_s'] * 1e3:8.1f} ms  "
                  f"decode {res['decode_tok_s']:6.1f} tok/s", flush=True)
    out = {"model": os.path.basename(a.model), "prompt": a.prompt, "decode": a.decode,
           "reps": a.reps, "precision": a.precision, "overflow": a.overflow, "threads": 2,
           "kv_dtype": KV_DTYPE[a.precision],
           "results": {name: {k: stats([x[k] for x in runs]) for k in ("ttft_s", "decode_tok_s")}
                       | {"first_tokens": runs[0]["tokens"][:8]} for name, runs in raw.items()},
           "npu_moe": {g: next((i.get("moe") for i in e.info() if i["processor"] == "npu"), None)
                       for g, e in engines.items()},
           "pss_mb": {g: pss_mb(e.pids()) for g, e in engines.items()}}
    for e in engines.values():
        e.close()
    for r in runners:
        if isinstance(r, PeerProcess):
            r.close()
    stop_ray()
    med = {n: r["ttft_s"]["median"] for n, r in out["results"].items()}
    for n, t in med.items():
        print(f"{n:20s} ttft median {t * 1e3:8.1f} ms"
              + (f"  grouped is {t / med['socllm:grouped']:.2f}x faster" if "socllm:grouped" in med else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
