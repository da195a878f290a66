"""What a GPU decode step of n rows of ONE sequence costs (speculative decoding's verification:
the last token and n-1 drafted ones, every row's logits), against a step of one row.

    python -m socllm.scripts.gpu_rows [--precision q16,q8] [--rows 1,2,3,4,6,8,12,16] [--reps 9]
                                      [--kernels]

Through the engine (Pool.runner("gpu", precision).step(rows, tables, all_rows=True)), the
prompt's last n positions of one sequence, after one step of each n to build and record its
launches. The precisions alternate rep by rep (on a shared machine, load moves between them);
prints each n's min and median ms. --kernels: also the kernels' own times per n, in this process
(scripts/profile_decode's pool and the paged batch program, n sequences at position 80: the same
linears and LM head, attention over other rows).
"""
from __future__ import annotations

import argparse
import statistics
import time

PROMPT = "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps."


def steps(precisions: list, ns: list, reps: int) -> dict:
    """(precision, n) -> seconds of each rep's step of n rows."""
    from socllm.actors.pool import Pool
    eng = Pool(processors_=("gpu",), context=640, max_seqs=max(ns))
    try:
        ids = eng.encode_prompt(PROMPT, chat=True)
        L = len(ids)
        runs = {p: eng.runner("gpu", p) for p in precisions}
        blocks = list(range(-(-L // runs[precisions[0]].lay.block_rows)))

        def rows(n):
            return [(ids[p], p, 0) for p in range(L - n, L)]
        for p in precisions:
            for n in ns:
                runs[p].step(rows(n), {0: blocks}, all_rows=True)
        out = {(p, n): [] for p in precisions for n in ns}
        for _ in range(reps):
            for n in ns:
                for p in precisions:
                    t = time.perf_counter()
                    runs[p].step(rows(n), {0: blocks}, all_rows=True)
                    out[(p, n)].append(time.perf_counter() - t)
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
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args(argv)
    precisions = args.precision.split(",")
    ns = [int(n) for n in args.rows.split(",")]
    got = steps(precisions, ns, args.reps)
    for p in precisions:
        print(f"{p}: ms a step of n rows, min / median of {args.reps}")
        for n in ns:
            ts = got[(p, n)]
            print(f"  n {n:2d}  {min(ts) * 1e3:6.2f} / {statistics.median(ts) * 1e3:6.2f}")
    if args.kernels:
        for p in precisions:
            for n, ks in kernel_times(p, [n for n in ns if n > 1]).items():
                top = sorted(ks.items(), key=lambda kv: -kv[1])[:8]
                print(f"{p} n {n:2d} kernels {sum(ks.values()):6.2f} ms: "
                      + ", ".join(f"{k} {t:.2f}" for k, t in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
