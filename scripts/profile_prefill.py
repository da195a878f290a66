"""Where an NPU prefill chunk's time goes: per segment (one compiled OpenVINO graph each).

    python -m socllm.scripts.profile_prefill [--bucket 512] [--pos0 0] [--reps 4] [--precision q16]

Runs the npu plan's prefill program for one bucket in this process, on a pool laid out as the
engine lays it out (no Ray), and times each unit. At pos0 = 0 a chunk of a whole-graph bucket
(policies/buckets.whole_graph) is one graph; at pos0 > 0, or with --per-layer, it runs as
per-layer graphs with the weights as inputs, and the table splits the time by segment kind
(norm + Q/K/V + rope, attention, o + FFN). Reports tok/s of the chunk and the process's USS.
--ops adds OpenVINO's own profile of the last run, by node type and kernel (PERF_COUNT).
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from socllm.policies.config import EngineConfig

from .profile_decode import apply_budget


def build(bucket: int, per_layer: bool, ops: bool = False, precision: str = "q16"):
    from socllm.actors.npu import backend as npu_mod
    if ops:                           # every graph compiled with OpenVINO's profiling on
        from socllm.actors.npu import segment
        props = segment._compile_props
        segment._compile_props = lambda *a: {**props(*a), "PERF_COUNT": True}
    from .profile_decode import pool_program
    config = EngineConfig.from_env(**({"whole_graph": False} if per_layer else {}))
    arena, lay, prog = pool_program("npu", "prefill", bucket)
    npu = npu_mod.NPUBackend(arena.buf, lay, config.budget, config=config)
    t = time.perf_counter()
    units = npu.build_units(prog, precision)
    names = [f"whole model, one graph ({len(seg.tasks)} ops)" if len(seg.tasks) > 20
             else "+".join(op for op, _ in seg.tasks) for seg in npu.segments]
    return arena, lay, units, names, time.perf_counter() - t, npu


def op_profile(npu) -> None:
    """ms of the last run by (node type, kernel), summed over the compiled graphs' requests."""
    total, count, seen = collections.Counter(), collections.Counter(), set()
    for slot in npu.shared.values():
        if id(slot["req"]) not in seen:
            seen.add(id(slot["req"]))
            for p in slot["req"].profiling_info:
                total[(p.node_type, p.exec_type)] += p.real_time.total_seconds() * 1e3
                count[(p.node_type, p.exec_type)] += 1
    print(f"  OpenVINO's profile of the last run: {sum(total.values()):.1f} ms in nodes")
    for (node, kernel), ms in total.most_common(8):
        print(f"  {ms:8.1f} ms  {node} ({kernel}) x{count[(node, kernel)]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", type=int, default=512)
    ap.add_argument("--pos0", type=int, default=0, help="KV rows before the chunk")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--per-layer", action="store_true", help="per-layer graphs even at pos0 = 0")
    ap.add_argument("--ops", action="store_true", help="OpenVINO's profile by node type")
    ap.add_argument("--precision", default="q16", help="f32, q16 or q8 (policies/buckets.py "
                    "npu_prefill_act: what the NPU's prefill computes in)")
    args = ap.parse_args(argv)
    apply_budget()
    import psutil
    arena, lay, units, names, build_s, npu = build(args.bucket, args.per_layer, args.ops, args.precision)
    try:
        B = args.bucket
        ids = arena.buf[lay.io["ids"]: lay.io["ids"] + B * 4].view(np.int32)
        ids[:] = np.arange(B) % 1000 + 10
        walls, per = [], collections.defaultdict(float)
        for rep in range(args.reps + 1):                       # the first run is a warm-up
            per.clear()
            t0 = time.perf_counter()
            for u, name in zip(units, names):
                t = time.perf_counter()
                u.run(B, args.pos0)
                per[name] += time.perf_counter() - t
            walls.append(time.perf_counter() - t0)
        best = min(walls[1:])
        uss = psutil.Process().memory_full_info().uss / 2**20
        print(f"npu prefill, bucket {B}, pos0 {args.pos0}: {len(units)} units, built in {build_s:.1f} s; "
              f"min {best * 1e3:.0f} ms ({B / best:.0f} tok/s), median "
              f"{sorted(walls[1:])[len(walls[1:]) // 2] * 1e3:.0f} ms; process USS {uss:.0f} MB")
        for name, t in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {t * 1e3:8.1f} ms  {name}")
        if args.ops:
            op_profile(npu)
    finally:
        arena.unlink()


if __name__ == "__main__":
    main()
