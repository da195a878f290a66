"""Disaggregated pipelines on this device: prefill beside decode, or taking turns (Agent.xpu §4.3).

The service's loop takes turns: a prompt's prefill chunk, then a decode step of every running
sequence, on all the cores. The alternative runs the two pipelines at once, each on its share of
the cores: prefill chunks on the NPU actor's OpenVINO graphs (or a second GPU queue) while the
GPU actor decodes. This measures both with the engine's real kernels, each pipeline in its own
process with its own thread budget (PoCL's and OpenVINO's thread pools are fixed per process):

  alone    each pipeline alone with the whole budget: decode steps/s d, prefill chunks/s p
  beside   both at once, the budget split between them: d', p'

For a serving mix of one prefill chunk per k decode steps, taking turns needs 1/p + k/d seconds
per chunk, running beside needs max(1/p', k/d'); the faster is the right default for the device.

    python -m socllm.scripts.pipelines [--seconds 15] [--batch 8] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from socllm.policies.config import EngineConfig

CHUNK = 128       # rows of a prefill chunk (actors/service.py PREFILL_CHUNK)


def worker(role: str, threads: int, seconds: float, start_at: float, batch: int, pos: int):
    """One pipeline in this process: warm up, wait for start_at, loop for `seconds`; prints
    {"role", "threads", "rate" (steps or chunks per second), "step_ms" (median)}."""
    from .profile_decode import batch_rows, build, pool_program, run_steps
    if role == "decode":           # the service's decode batch: q8 tiles over an f16 paged cache
        arena, lay, gpu, units = build("q8", False, batch, "f16")
        batch_rows(arena, lay, batch, pos)

        def step():
            run_steps(gpu, units, "q8", pos, 1, batch)
    elif role == "prefill-npu":    # a 128-row prefill chunk on OpenVINO's static graph (q8:
        from socllm.actors.npu.backend import NPUBackend     # int8 dynamic quantization of activations)
        arena, lay, prog = pool_program("npu", "prefill", CHUNK)
        backend = NPUBackend(arena.buf, lay, threads)
        units = backend.build_units(prog, "q8")
    else:                          # the service's own chunk: paged, linears in q8 weight tiles
        from socllm.actors.gpu.backend import GPUBackend
        arena, lay, prog = pool_program("gpu", "chunk", CHUNK, 1, "f16", chunk=True)
        chunk_rows(arena, lay)
        backend = GPUBackend(arena.buf, lay, threads)
        units = backend.build_units(prog, "q8")
    if role != "decode":
        def step():
            for u in units:
                u.run(CHUNK, 0)
            backend.finish()
    try:
        for _ in range(3):
            step()
        time.sleep(max(0.0, start_at - time.time()))
        times, t_end = [], time.time() + seconds
        while time.time() < t_end:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"role": role, "threads": threads, "rate": len(times) / sum(times),
                          "step_ms": statistics.median(times) * 1e3, "n": len(times)}), flush=True)
    finally:
        arena.unlink()


def chunk_rows(arena, lay):
    """Row metadata of a prefill chunk: sequence 0's positions 0 .. CHUNK-1 over blocks 0, 1, .."""
    def io(name, count):
        return arena.buf[lay.io[name]: lay.io[name] + 4 * count].view("int32")
    io("btab", lay.max_blocks)[:] = range(lay.max_blocks)
    io("ids", CHUNK)[:] = [100 + i for i in range(CHUNK)]
    io("pos", CHUNK)[:] = range(CHUNK)
    io("seq", CHUNK)[:] = 0
    io("rows", CHUNK)[:] = range(CHUNK)


def run(roles: list, seconds: float, batch: int, pos: int) -> dict:
    """Starts one process per (role, threads), all looping over the same window."""
    start_at = time.time() + 40.0       # after every process has built and warmed its kernels
    procs = []
    for role, threads in roles:
        env = dict(os.environ, POCL_MAX_PTHREAD_COUNT=str(threads), OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "socllm.scripts.pipelines", "--role", role, "--threads",
             str(threads), "--seconds", str(seconds), "--start-at", str(start_at), "--batch",
             str(batch), "--pos", str(pos)], env=env, stdout=subprocess.PIPE, text=True))
    out = {}
    for p, (role, _) in zip(procs, roles):
        stdout, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{role} exited {p.returncode}")
        out[role] = json.loads(stdout.strip().splitlines()[-1])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window of each run")
    ap.add_argument("--batch", type=int, default=8, help="decode batch rows")
    ap.add_argument("--pos", type=int, default=160, help="KV rows before each decode row")
    ap.add_argument("--prefill", default="npu,gpu", help="prefill pipelines to try beside decode")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return worker(args.role, args.threads, args.seconds, args.start_at, args.batch, args.pos)
    budget = EngineConfig.from_env().budget
    half = max(1, budget // 2)
    result = {"device": "this machine's CPU (PoCL as the GPU, OpenVINO CPU as the NPU)",
              "threads": budget, "batch": args.batch, "pos": args.pos, "chunk": CHUNK, "runs": {}}
    alone_d = run([("decode", budget)], args.seconds, args.batch, args.pos)["decode"]
    result["runs"]["decode alone"] = alone_d
    print(f"decode alone, {budget} threads: {alone_d['rate']:.1f} steps/s "
          f"({alone_d['step_ms']:.1f} ms a {args.batch}-row step)")
    for proc in args.prefill.split(","):
        role = f"prefill-{proc}"
        alone_p = run([(role, budget)], args.seconds, args.batch, args.pos)[role]
        beside = run([("decode", half), (role, budget - half)], args.seconds, args.batch, args.pos)
        result["runs"][f"{role} alone"], result["runs"][f"{role} beside decode"] = alone_p, beside
        d2, p2, d1, p1 = alone_d["rate"], alone_p["rate"], beside["decode"]["rate"], beside[role]["rate"]
        print(f"{role} alone, {budget} threads: {p2:.2f} chunks/s; beside decode ({half} + "
              f"{budget - half} threads): decode {d1:.1f} steps/s, prefill {p1:.2f} chunks/s")
        for k in (4, 16, 64):
            turns, at_once = 1 / p2 + k / d2, max(1 / p1, k / d1)
            print(f"  one chunk per {k:3d} decode steps: taking turns {turns:.2f} s, beside "
                  f"{at_once:.2f} s -> {'beside' if at_once < turns else 'turns'} "
                  f"({turns / at_once:.2f}x)")
            result["runs"][f"{role} beside decode"][f"k{k}"] = {"turns_s": turns, "beside_s": at_once}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
