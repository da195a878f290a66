"""What a prefill chunk's precision costs: KL(oracle || chunk) of the last row's next-token
distribution, and top-1 agreement, over windows of a public-domain text, per processor and
precision; with the chunk's speed.

    python -m socllm.scripts.prefill_kl [--rows 256] [--windows 20] [--runs npu:f32,npu:q16,gpu:q8]
                                        [--json FILE]

Each window is one paged prefill chunk of --rows rows at position 0 (the serving chunk program,
in this process on a pool laid out as the engine lays it out, no Ray), against the numpy oracle
in f64 softmax. A run is PROC:PRECISION; npu's q16 and q8 chunks compute in bf16 where the device
computes bf16 (policies/buckets.npu_prefill_act; the result's "npu_hint" says which), the GPU's q16
and q8 chunks in int16 and int8 weight tiles, f32 on the oracle's path. tok/s: the median chunk of the windows (its rows / its wall time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from .perplexity import TEXT
from .profile_decode import apply_budget, pool


def _backend(proc: str, arena, lay, budget: int):
    if proc == "npu":
        from socllm.actors.npu.backend import NPUBackend
        return NPUBackend(arena.buf, lay, budget)
    if proc == "gpu":
        from socllm.actors.gpu.backend import GPUBackend
        return GPUBackend(arena.buf, lay, budget)
    raise ValueError(f"a run's processor is npu or gpu, not {proc!r}")


def measure(runs: list, rows: int, windows: int) -> dict:
    from socllm.graph.program import StepProgram
    from socllm.models.oracle import Oracle
    from socllm.models.tokenizer import Tokenizer
    budget = apply_budget()
    arena, lay, planner, reader, cfg, weights = pool(None, 2048, 1)
    ids = Tokenizer(reader).encode(open(TEXT).read())
    wins = [ids[i:i + rows] for i in range(0, len(ids) - rows, 97)][:windows]
    oracle = Oracle(cfg, weights)
    refs = [oracle.forward([int(t) for t in w], 0, oracle.new_cache(rows)).astype(np.float64)
            for w in wins]

    def io(name, count, dtype=np.int32):
        return arena.buf[lay.io[name]: lay.io[name] + np.dtype(dtype).itemsize * count].view(dtype)
    io("btab", lay.max_seqs * lay.max_blocks)[:] = np.arange(lay.max_seqs * lay.max_blocks,
                                                              dtype=np.int32)
    out = {}
    for run in runs:
        proc, precision = run.split(":")
        be = _backend(proc, arena, lay, budget)
        # the npu's static chunk graphs of `rows`; the gpu's kernels take any rows
        blob = planner.paged_program(proc, False, 0, rows if proc == "npu" else 0)[1]
        units = be.build_units(StepProgram.from_bytes(blob), precision)
        kls, top1, walls = [], 0, []
        for w, ref in zip(wins, refs):
            io("ids", rows)[:] = w
            io("pos", rows)[:] = io("rows", rows)[:] = np.arange(rows)
            io("seq", rows)[:] = 0
            t = time.perf_counter()
            be.begin_step(precision, 0)
            for u in units:
                u.run(rows, 0)
            be.finish()
            walls.append(time.perf_counter() - t)
            got = io("logits", lay.vocab, np.float32).astype(np.float64)
            lp = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
            lq = got - got.max() - np.log(np.exp(got - got.max()).sum())
            kls.append(float((np.exp(lp) * (lp - lq)).sum()))
            top1 += int(got.argmax() == ref.argmax())
        out[run] = {"kl_mean": statistics.fmean(kls), "kl_max": max(kls), "top1_equal": top1,
                    "windows": len(wins), "tok_s": rows / statistics.median(walls[1:] or walls),
                    "npu_hint": getattr(be, "prefill_hint", None)}
        print(f"{run:<10} KL mean {out[run]['kl_mean']:.2e} max {out[run]['kl_max']:.2e}  "
              f"top-1 = oracle {top1}/{len(wins)}  {out[run]['tok_s']:.0f} tok/s", flush=True)
        if hasattr(be, "release"):
            be.release()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="a window's rows: one prefill chunk")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--runs", default="npu:f32,npu:q16,npu:q8,gpu:f32,gpu:q16,gpu:q8")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args(argv)
    res = measure(a.runs.split(","), a.rows, a.windows)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"text": TEXT.name, "rows": a.rows, "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
