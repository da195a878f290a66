"""Which processor's kernels run a decode batch fastest, per batch size: the GPU actor's OpenCL
programs (the gpu plan's paged batch) against the NPU actor's static batch graphs (the npu plan's),
on one pool, a decode step of B rows at position 0 for B = 1 .. --max-seqs, after a warm-up;
the fastest of 3 per size and repetition, the plans alternating within each repetition.

    python -m socllm.scripts.decode_placement [--precision q16] [--reps 3] [--json FILE]

This is the measurement behind the service's choice to decode on the GPU in every plan but
`npu` (policies/placement.py SERVE_PLANS): a processor is picked per batch size where it is the
faster at that size.
"""
from __future__ import annotations

import argparse
import json
import statistics

SIZES = (1, 2, 4, 8, 16)


def main(argv=None) -> int:
    from socllm.actors.pool import Pool
    from socllm.policies.config import EngineConfig
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="q16", choices=("f32", "q16", "q8"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    c = EngineConfig.from_env(precision=a.precision, context=1024, max_seqs=a.max_seqs, kv_mb=64)
    runs: dict = {"gpu": [], "npu": []}
    with Pool(c, processors_=("gpu", "npu"), kv_dtype="f16" if a.precision != "f32" else "f32") as p:
        for rep in range(a.reps):
            for plan in ("gpu", "npu") if rep % 2 == 0 else ("npu", "gpu"):
                r = p.runner(plan, a.precision)
                if rep < 2:
                    r.warm(a.max_seqs, chunks=(1,))
                prof = r.profile_batches(a.max_seqs)
                runs[plan].append({n: 1e3 * prof[n] for n in SIZES if n <= a.max_seqs})
    sizes = [n for n in SIZES if n <= a.max_seqs]
    from socllm.policies.plan_cache import cpu_name
    cpu = cpu_name()
    out = {"device": f"{cpu}, {c.budget} threads (the gpu actor: PoCL; the npu actor: OpenVINO CPU)",
           "precision": a.precision, "what": "ms of a decode step of B rows (min/median/max over "
           "repetitions of the fastest of 3)", "by_batch": {}}
    for n in sizes:
        row = {}
        for plan in ("gpu", "npu"):
            v = sorted(r[n] for r in runs[plan])
            row[plan] = [round(v[0], 1), round(statistics.median(v), 1), round(v[-1], 1)]
        row["faster"] = min(("gpu", "npu"), key=lambda q: row[q][1])
        out["by_batch"][n] = row
        print(f"B={n:2d}  gpu {row['gpu']}  npu {row['npu']}  -> {row['faster']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
