"""The row-cut profiler (HeteroLLM §4.3, real-execution mode): each cuttable linear's time on the
GPU and the NPU actor's kernels by rows, the solver's cut, and that cut run for real, both halves
at once, against the best single processor.

    python -m socllm.scripts.profile_rowcut [--bucket 128] [--reps 20] [--out FILE.json]

In this process, on the default model's layer-0 weights in a pool laid out as the engine lays it
out (scripts/profile_decode.pool_program). Decode is one row (GPU-dominant); prefill is `--bucket`
rows (NPU-dominant). The JSON it writes is the profile policies/rowcut.plan_rows reads
(`Pool(rowcut_profile=FILE)`; by default the engine loads policies/rowcut.PROFILE_PATH, where
this script writes, when it exists). Both halves at once are measured, not only predicted: on a machine
whose "GPU" and "NPU" are the same cores (PoCL and OpenVINO's CPU device) they contend, which a
profile of each alone cannot see.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from socllm.policies.rowcut import PROFILE_PATH
from .profile_decode import apply_budget

PARTS = {"attn_q": "blk.0.attn_q.weight", "attn_k": "blk.0.attn_k.weight",
         "attn_output": "blk.0.attn_output.weight", "ffn_gate": "blk.0.ffn_gate.weight",
         "ffn_up": "blk.0.ffn_up.weight", "ffn_down": "blk.0.ffn_down.weight"}


def _time(run, reps: int) -> float:
    run()                                  # compile / warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", type=int, default=128, help="prefill rows")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=PROFILE_PATH)
    args = ap.parse_args(argv)
    budget = apply_budget()
    import openvino as ov

    from socllm.actors.gpu.backend import GPUBackend
    from socllm.actors.npu.segment import OVSegment
    from socllm.graph.partition import ALIGN, DOMINANT
    from socllm.graph.program import cut_rows
    from socllm.policies.rowcut import contention, solve_part
    from socllm.scripts.profile_decode import pool_program
    arena, lay, prog = pool_program("gpu", "decode", 1)
    sizes = {t.args["w"]: (t.args["M"], t.args["K"]) for t in prog.tasks["gpu"] if t.op == "linear"}
    try:
        gpu = GPUBackend(arena.buf, lay, budget)
        core, shared = ov.Core(), {}
        config = {"INFERENCE_NUM_THREADS": budget}
        x_off, out_off = sorted(lay.slots)[-2:]           # two slots that hold [1024, 1536] f32
        sync_s = _hop_s()

        def runner(proc, args, n, bucket):
            if proc == "gpu":
                return lambda: (gpu.kernels.run("linear", args, n, 0), gpu.finish())
            seg = OVSegment(core, [("linear", args)], arena.buf, bucket, {args["out"][1]},
                            lay.kv_rows, "f32", config, None, shared)
            return lambda: seg.run(n, 0)

        profile = {"device": gpu.describe()["device"], "threads": budget,
                   "command": "python -m socllm.scripts.profile_rowcut", "sync_s": sync_s}
        for phase, n in (("decode", 1), ("prefill", args.bucket)):
            dom = DOMINANT[phase]
            other = "npu" if dom == "gpu" else "gpu"
            p = profile[phase] = {"rows": n, "sync_s": sync_s, "dominant": {}, "other": {},
                                  "cut": {}}
            for part, name in PARTS.items():
                w = lay.weights[name]
                M, K = sizes[w]
                whole = {"x": ("a", x_off), "w": w, "out": ("a", out_off), "K": K, "M": M}
                points = sorted({r for r in (ALIGN, M // 4, M // 2, 3 * M // 4, M) if r % ALIGN == 0 and r})
                for proc, key in ((dom, "dominant"), (other, "other")):
                    p[key][part] = {str(r): _time(runner(proc, cut_rows(whole, 0, r), n, n), args.reps)
                                    for r in points}
                alone = solve_part(p, part, M)                 # each processor measured alone
                forced = solve_part(p, part, M, cut_only=True)
                r = forced.rows_other
                both = _time(_at_once(runner(dom, cut_rows(whole, 0, M - r), n, n),
                                      runner(other, cut_rows(whole, M - r, M), n, n)), args.reps)
                p["cut"][part] = {"cut_rows_other": r, "cut_predicted_s": forced.seconds,
                                  "cut_measured_s": both}
                choice = solve_part(p, part, M)                # under the measured contention
                p["cut"][part].update(contention=contention(p, part), solver_rows_other=choice.rows_other,
                                      solver_pays=choice.pays, single_best_s=choice.single_s)
                print(f"{phase:7s} {part:11s} M={M:4d}: {dom} {p['dominant'][part][str(M)] * 1e6:7.1f} us, "
                      f"{other} {p['other'][part][str(M)] * 1e6:7.1f} us; cut {M - r}/{r}: predicted "
                      f"{forced.seconds * 1e6:7.1f}, measured {both * 1e6:7.1f} us (contention "
                      f"{contention(p, part):.2f}); solver alone: {_says(alone)}, under contention: "
                      f"{_says(choice)}", flush=True)
    finally:
        arena.unlink()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"profile written to {args.out}")
    return profile


def _says(c) -> str:
    return f"cut {c.rows_other} rows" if c.pays else "no cut"


def _at_once(a, b):
    """Run two halves concurrently (the dominant one in this thread), like two actors would."""
    def run():
        t = threading.Thread(target=b)
        t.start()
        a()
        t.join()
    return run


def _hop_s() -> float:
    """One synchronisation through a ready word between two threads (store, futex wake), median."""
    from socllm.memory.ready import ReadyWords
    import numpy as np
    words = ReadyWords(np.zeros(64, np.uint8))
    hops = []

    def pong():
        for i in range(1, 201):
            words.wait_change(0, 2 * i - 2, 1.0)
            words.store(1, i)
    t = threading.Thread(target=pong)
    t.start()
    for i in range(1, 201):
        t0 = time.perf_counter()
        words.store(0, 2 * i - 1)
        while words.get(1) < i:
            pass
        hops.append((time.perf_counter() - t0) / 2)
        words.store(0, 2 * i)
    t.join()
    return statistics.median(hops)


if __name__ == "__main__":
    main()
