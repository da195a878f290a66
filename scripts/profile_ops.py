"""The op profiler (HeteroLLM §4.3, real-execution mode): each op of a prefill layer timed on the
GPU actor's OpenCL kernels and on the NPU actor's compiled OpenVINO graphs, over a grid of row
counts. policies/sim/predict.py fits its prediction mode to this file; `socllm plan` reads it.

    python -m socllm.scripts.profile_ops [--rows 32,64,96,128,192,256,384,512] [--reps 5]
        [--out ~/.cache/socllm/op-profile.json]

In this process, on the default model's layer-0 tasks in a pool laid out as the engine lays it out
(scripts/profile_decode.pool_program), f32 activations, attention at pos0 = 0. The median of
`--reps` runs after a warm-up; each NPU op is a graph of its own, compiled per row count (cached
on disk).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from socllm.policies.sim.predict import PROFILE_PATH
from .profile_decode import apply_budget


def shape_args(args: dict) -> dict:
    """A task's sizes (K, M, heads, ...) and its weight's kind: what a prediction needs."""
    out = {k: v for k, v in args.items() if isinstance(v, (int, float))}
    for k in ("w", "table"):
        if k in args:
            out[k] = [args[k][0]]
    return out


def _contention(gpu, core, shared, config, arena, lay, tasks, reps, n=256) -> float:
    """The widest linear cut in halves, the halves on the GPU and the NPU at once, over the
    slower half alone (>= 1): what running two processors at once costs on this device."""
    from socllm.actors.npu.segment import OVSegment
    from socllm.graph.program import cut_rows
    from socllm.scripts.profile_rowcut import _at_once
    t = max((t for t in tasks if t.op == "linear"), key=lambda t: t.args["M"] * t.args["K"])
    M = t.args["M"]
    top, low = cut_rows(t.args, 0, M // 2), cut_rows(t.args, M // 2, M)
    seg = OVSegment(core, [("linear", low)], arena.buf, n, {low["out"][1]}, lay.kv_rows, "f32",
                    config, None, shared)
    on_gpu = lambda: (gpu.kernels.run("linear", top, n, 0), gpu.finish())
    on_npu = lambda: seg.run(n, 0)
    alone = max(_time(on_gpu, lambda: None, reps), _time(on_npu, lambda: None, reps))
    return max(1.0, _time(_at_once(on_gpu, on_npu), lambda: None, reps) / alone)


def _time(run, finish, reps: int) -> float:
    run()
    finish()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        finish()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,64,96,128,192,256,384,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=PROFILE_PATH)
    a = ap.parse_args(argv)
    budget = apply_budget()
    import openvino as ov

    from socllm.actors.gpu.backend import GPUBackend
    from socllm.actors.npu.segment import OVSegment
    from socllm.scripts.profile_decode import pool_program
    rows = [int(r) for r in a.rows.split(",")]
    arena, lay, prog = pool_program("gpu", "prefill", max(rows))
    layer0, seen = [], set()
    for t in prog.tasks["gpu"]:          # every op, one per shape
        key = (t.op, json.dumps(shape_args(t.args), sort_keys=True))
        if t.layer <= 0 and key not in seen:   # the embedding, layer 0, the final norm and lm-head
            seen.add(key)
            layer0.append(t)
    points = []
    try:
        gpu = GPUBackend(arena.buf, lay, budget)
        gpu.begin_step("f32", 0)
        core, shared = ov.Core(), {}
        config = {"INFERENCE_NUM_THREADS": budget}
        for t in layer0:
            for n in rows:
                seg = OVSegment(core, [(t.op, t.args)], arena.buf, n, {t.args["out"][1]}, lay.kv_rows,
                                "f32", config, None, shared)
                runs = {"gpu": (lambda: gpu.kernels.run(t.op, t.args, n, 0), gpu.finish),
                        "npu": (lambda: seg.run(n, 0), lambda: None)}
                for proc, (run, finish) in runs.items():
                    points.append({"proc": proc, "op": t.op, "n": n, "args": shape_args(t.args),
                                   "s": _time(run, finish, a.reps)})
                print(f"{t.op:9s} {json.dumps(shape_args(t.args))[:40]:40s} n={n:4d}: gpu "
                      f"{points[-2]['s'] * 1e6:9.1f} us, npu {points[-1]['s'] * 1e6:9.1f} us", flush=True)
        device = {"gpu": gpu.describe()["device"], "npu": "OpenVINO " + core.get_property("CPU", "FULL_DEVICE_NAME")}
        contention = _contention(gpu, core, shared, config, arena, lay, layer0, a.reps)
        print(f"contention: two halves of the widest linear at once take {contention:.2f}x the slower alone")
    finally:
        arena.unlink()
    from socllm.policies.sim.predict import held_out_error
    from socllm.scripts.profile_rowcut import _hop_s
    test = set(rows[2::3])
    profile = {"device": device, "threads": budget, "rows": rows, "reps": a.reps,
               "command": "python -m socllm.scripts.profile_ops", "sync_s": _hop_s(),
               "contention": contention,
               "held_out_rows": sorted(test), "held_out_error": held_out_error(points, test),
               "points": points}
    for proc, e in profile["held_out_error"].items():
        print(f"prediction mode, {proc}: fitted without rows {sorted(test)}, error on them mean "
              f"{100 * e['mean']:.0f} %, largest {100 * e['max']:.0f} % ({e['points']} ops)")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"profile written to {a.out}")
    return profile


if __name__ == "__main__":
    main()
