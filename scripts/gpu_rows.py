"""What a GPU decode step of n rows of ONE sequence costs (speculative decoding's verification:
the last token and n-1 drafted ones, every row's logits), against a step of one row.

    python -m socllm.scripts.gpu_rows [--precision q16,q8] [--rows 1,2,3,4,6,8,12,16] [--reps 9]
                                      [--plans gpu,hcmp] [--hcmp-share S] [--pos P] [--json F]
                                      [--kernels]

Through the engine (Pool.runner(plan, precision).step(rows, tables, all_rows=True)), the
prompt's last n positions of one sequence (--pos: positions P-n .. P-1 instead, over KV rows no
prefill wrote: the cost, not the values), after one step of each n to build and record its
launches. --plans: the serving plans whose decode batches run (hcmp: Ghidorah's split of the
attention, GPU + CPU actor, graph/hcmp.py). The plans and precisions alternate rep by rep (on a
shared machine, load moves between them); prints each n's min and median ms. --kernels: also the kernels' own times per n, in this process
(scripts/profile_decode's pool and the paged batch program, n sequences at position 80: the same
linears and LM head, attention over other rows).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

PROMPT = "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps."


def steps(precisions: list, ns: list, reps: int, plans=("gpu",), pos: int = 0,
          hcmp_share: float = 0.0) -> dict:
    """(plan, precision, n) -> seconds of each rep's step of n rows."""
    from socllm.actors.pool import Pool
    from socllm.policies.plan_cache import processors_for
    procs = sorted({p for plan in plans for p in processors_for(plan)})
    eng = Pool(processors_=tuple(procs), context=max(640, pos + 64), max_seqs=max(ns),
               kv_dtype="f16", kv_mb=64, hcmp_share=hcmp_share)   # the service's KV at q16, q8
    try:
        ids = eng.encode_prompt(PROMPT, chat=True)
        L = max(pos or len(ids), max(ns))         # rows past the prompt: it repeats
        ids = (ids * (L // len(ids) + 1))[:L]
        runs = {(pl, p): eng.runner(pl, p) for pl in plans for p in precisions}
        blocks = list(range(-(-L // eng.layout.block_rows)))

        def rows(n):
            return [(ids[p], p, 0) for p in range(L - n, L)]
        for r in runs.values():
            for n in ns:
                r.step(rows(n), {0: blocks}, all_rows=True)
        out = {(*k, n): [] for k in runs for n in ns}
        for _ in range(reps):
            for n in ns:
                for k, r in runs.items():
                    t = time.perf_counter()
                    r.step(rows(n), {0: blocks}, all_rows=True)
                    out[(*k, n)].append(time.perf_counter() - t)
        return out
    finally:
        eng.close()


def kernel_times(precision: str, ns: list, n_steps: int = 10) -> dict:
    """n -> {kernel: ms a step} (profile_decode's serving batch of n rows, in process)."""
    from socllm.actors.gpu.backend import GPUBackend
    from socllm.policies.config import EngineConfig
    from socllm.scripts.profile_decode import apply_budget, batch_rows, pool_program, run_steps
    apply_budget()
    arena, lay, prog = pool_program("gpu", "decode", 1, max(ns), "f16")
    try:
        gpu = GPUBackend(arena.buf, lay, EngineConfig.from_env().budget, profile=True)
        units = gpu.build_units(prog, precision)
        out = {}
        for n in ns:
            batch_rows(arena, lay, n, 80)
            run_steps(gpu, units, precision, 80, 2, n)
            gpu.kernels.events.clear()
            run_steps(gpu, units, precision, 80, n_steps, n)
            out[n] = {k: t / n_steps * 1e3 for k, (_, t) in gpu.kernels.kernel_times().items()}
        return out
    finally:
        arena.unlink()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="q16,q8")
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--plans", default="gpu", help="serving plans (gpu, hcmp)")
    ap.add_argument("--pos", type=int, default=0, help="the rows' last position + 1 (0: the prompt's)")
    ap.add_argument("--hcmp-share", type=float, default=0.0,
                    help="the hcmp plan's share of each linear's columns on the CPU actor")
    ap.add_argument("--json", default=None, help="write every step's seconds here")
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args(argv)
    precisions, plans = args.precision.split(","), args.plans.split(",")
    ns = [int(n) for n in args.rows.split(",")]
    got = steps(precisions, ns, args.reps, plans, args.pos, args.hcmp_share)
    for pl in plans:
        for p in precisions:
            print(f"{pl} {p}: ms a step of n rows, min / median / max of {args.reps}")
            for n in ns:
                ts = got[(pl, p, n)]
                print(f"  n {n:2d}  {min(ts) * 1e3:6.2f} / {statistics.median(ts) * 1e3:6.2f}"
                      f" / {max(ts) * 1e3:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "cpus": os.cpu_count(),
                       "steps_s": {f"{pl} {p} {n}": ts for (pl, p, n), ts in got.items()}}, f, indent=1)
    if args.kernels:
        for p in precisions:
            for n, ks in kernel_times(p, [n for n in ns if n > 1]).items():
                top = sorted(ks.items(), key=lambda kv: -kv[1])[:8]
                print(f"{p} n {n:2d} kernels {sum(ks.values()):6.2f} ms: "
                      + ", ".join(f"{k} {t:.2f}" for k, t in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
