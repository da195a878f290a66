"""Where a GPU decode step's time goes: kernels (OpenCL profiling events) vs everything else.

    python -m socllm.scripts.profile_decode [--pos 512] [--steps 30] [--precision f32|q16|q8]
                                            [--batch N] [--model FILE]

--batch N profiles a serving decode batch instead (the paged "batch" program the service runs):
N sequences, each at position --pos over its own blocks.

Runs the gpu plan's decode program in this process, on a pool laid out exactly as the engine lays
it out (no Ray: the step's own cost, without the hop to the control actor). Reports the step's wall
time, the time inside kernels (sum of event durations, per op) and the rest: Python dispatch,
launch overhead and queue gaps — issue 3's "time spent outside kernels". Profiling events cost a
little themselves; the wall time without them is reported too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from socllm.policies.config import EngineConfig
from socllm.policies.threads import actor_env


def apply_budget() -> int:
    """This machine's thread budget, given to this process's PoCL, OpenVINO and BLAS (as the
    actors get it: policies/threads.actor_env) unless the environment sets them already."""
    budget = EngineConfig.from_env().budget
    for k, v in actor_env(budget).items():
        os.environ.setdefault(k, v)
    return budget


def pool(model: str | None = None, context: int = 2048, paged: int = 0, kv_dtype: str = "f32"):
    """-> (arena, layout, planner, reader, cfg, weights): the model's pool (default: the default
    model) laid out and filled as the engine does it, in this process, its layout given to a
    PlannerCore. paged: that many sequences of a serving batch, over a KV cache of kv_dtype."""
    from socllm.memory.arena import Arena
    from socllm.memory.layout import plan_layout, write_weights
    from socllm.models.gguf_file import model_path, open_gguf
    from socllm.models.llama import load_config, load_weights
    from socllm.policies.buckets import MAX_CHUNK
    from socllm.policies.planner import PlannerCore
    reader = open_gguf(model_path(model))
    cfg = load_config(reader)
    weights = load_weights(reader, cfg)
    planner = PlannerCore(cfg)
    slot_bytes = [planner.slots.nbytes(i, MAX_CHUNK) for i in range(len(planner.slots.sizes))]
    lay = plan_layout(weights, cfg.n_layers, cfg.kv_dim, slot_bytes, MAX_CHUNK, context, cfg.vocab,
                      max(cfg.dim, cfg.ffn_dim), max_seqs=max(1, paged),
                      kv_blocks=max(1, paged) * context // 16, block_rows=16, kv_dtype=kv_dtype)
    arena = Arena.create(lay.size, lay.readonly_bytes)
    write_weights(arena.buf, lay, weights)
    planner.set_layout(lay.to_dict())
    return arena, lay, planner, reader, cfg, weights


def pool_program(proc: str, phase: str, bucket: int, paged: int = 0, kv_dtype: str = "f32",
                 chunk: bool = False, model: str | None = None):
    """-> (arena, layout, the proc's StepProgram) over pool(): paged, the serving batch's program
    (or, chunk, the paged prefill chunk program)."""
    from socllm.graph.program import StepProgram
    arena, lay, planner, *_ = pool(model, 2048, paged, kv_dtype)
    blob = planner.paged_program(proc, not chunk)[1] if paged else planner.program(proc, phase, bucket)[1]
    return arena, lay, StepProgram.from_bytes(blob)


def batch_rows(arena, lay, n: int, pos: int):
    """Row metadata of a decode batch: sequence s at position pos, its blocks s * MB .. in order."""
    def io(name, count):
        return arena.buf[lay.io[name]: lay.io[name] + 4 * count].view(np.int32)
    mb, br = lay.max_blocks, lay.block_rows
    io("btab", lay.max_seqs * mb)[:] = np.arange(lay.max_seqs * mb, dtype=np.int32)
    io("ids", n)[:] = 100 + np.arange(n)
    io("pos", n)[:] = pos
    io("seq", n)[:] = np.arange(n)
    io("rows", n)[:] = np.arange(n) * mb * br + pos


def build(precision: str, profile: bool, batch: int = 0, kv_dtype: str = "f32", model=None):
    from socllm.actors.gpu.backend import GPUBackend
    arena, lay, prog = pool_program("gpu", "decode", 1, batch, kv_dtype, model=model)
    gpu = GPUBackend(arena.buf, lay, EngineConfig.from_env().budget, profile=profile)
    units = gpu.build_units(prog, precision)
    return arena, lay, gpu, units


def run_steps(gpu, units, precision, pos, steps, batch=0):
    walls = []
    for s in range(steps):
        gpu.begin_step(precision, pos + s if not batch else pos if batch == 1 else 0)
        t0 = time.perf_counter()
        for u in units:
            if batch:
                u.run(batch, pos if batch == 1 else 0)     # one row: at its position in the pool
            else:
                u.run(1, pos + s)
        gpu.finish()
        walls.append(time.perf_counter() - t0)
    return walls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pos", type=int, default=512, help="KV rows before the step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", default="f32", choices=("f32", "q16", "q8"))
    ap.add_argument("--batch", type=int, default=0, help="profile a serving decode batch of N rows")
    ap.add_argument("--kv", choices=("f32", "f16"),
                    help="a serving batch's KV elements (default: the service's at --precision)")
    ap.add_argument("--model", help="a GGUF, or gemma3-270m (default: the default model)")
    args = ap.parse_args(argv)
    if args.batch:
        from socllm.actors.service import KV_DTYPE
    kv = args.kv or (KV_DTYPE[args.precision] if args.batch else "f32")
    apply_budget()
    out = {}
    for profile in (False, True):
        arena, lay, gpu, units = build(args.precision, profile, args.batch, kv, args.model)
        try:
            if args.batch:
                batch_rows(arena, lay, args.batch, args.pos)
            run_steps(gpu, units, args.precision, args.pos, 3, args.batch)   # compile, warm caches
            gpu.kernels.events.clear()
            walls = run_steps(gpu, units, args.precision, args.pos, args.steps, args.batch)
            out[profile] = (walls, gpu.kernels.kernel_times())
        finally:
            arena.unlink()
    plain, (walls, per_op) = out[False][0], out[True]
    launches = sum(n for n, _ in per_op.values()) / args.steps
    busy = sum(t for _, t in per_op.values()) / args.steps
    med = statistics.median(walls)
    print(f"decode {'batch of ' + str(args.batch) + ' rows ' if args.batch else ''}step at pos {args.pos}, precision {args.precision}, KV {kv}, {args.steps} steps, "
          f"{len(units)} units, {launches:.0f} launches/step")
    print(f"  wall without events: median {statistics.median(plain) * 1e3:.2f} ms "
          f"(min {min(plain) * 1e3:.2f}, max {max(plain) * 1e3:.2f})")
    print(f"  wall with events:    median {med * 1e3:.2f} ms; inside kernels {busy * 1e3:.2f} ms; "
          f"outside {(med - busy) * 1e3:.2f} ms = {(med - busy) / med:.0%}")
    for op, (n, t) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {op:16s} {n / args.steps:5.0f} launches  {t / args.steps * 1e3:6.2f} ms/step "
              f"{t / n * 1e6:7.1f} us each")


if __name__ == "__main__":
    main()
