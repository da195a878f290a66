"""How fast this CPU's OpenCL device multiplies u8 weights by s8 activations with VNNI, at 256 and
at 512 bits: the ceiling of an int8 weight tile before its nibble split and scales.

    python -m socllm.scripts.vnni_peak [--m 1536] [--k 1536] [--rows 8,16,32] [--reps 30]

Two kernels on the GPU actor's device (PoCL, with socllm's naming of the CPU), on weights
pre-transposed so that one load gives the same dword of every row of a tile: 8 weight rows a
work-item with vpdpbusd256 (cl/batch.cl's q8 tiles use this form), and 16 rows with vpdpbusd512.
Each is checked against numpy's integer product, then timed (median and best of --reps batches
of 20 launches). x86 CPUs with AVX-512 VNNI only.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

SRC = r"""
typedef int v8si __attribute__((ext_vector_type(8)));
typedef int v16si __attribute__((ext_vector_type(16)));
// a work-item: R weight rows (tile t, its dword g of row j at W[(t K4 + g) R + j]) against TN
// activation rows (row n's dword g at X[n K4 + g]); out [TN, M] in int32
#define TILE(NAME, V, R, DOT, STORE)                                                           \
__kernel void NAME(__global const V* W, __global const int* X, __global int* out, int K4, int M) \
{                                                                                              \
    const int t = get_global_id(0);                                                            \
    const __global V* w = W + (size_t)t * K4;                                                  \
    V acc[TN];                                                                                 \
    for (int n = 0; n < TN; n++) acc[n] = (V)0;                                                \
    for (int g = 0; g < K4; g++) {                                                             \
        const V wg = w[g];                                                                     \
        _Pragma("unroll")                                                                      \
        for (int n = 0; n < TN; n++) acc[n] = DOT(acc[n], wg, (V)X[n * K4 + g]);               \
    }                                                                                          \
    for (int n = 0; n < TN; n++) STORE(acc[n], 0, out + (size_t)n * M + t * R);                \
}
TILE(k256, v8si, 8, __builtin_ia32_vpdpbusd256, vstore8)
TILE(k512, v16si, 16, __builtin_ia32_vpdpbusd512, vstore16)
"""


def run(ctx, q, M: int, K: int, tn: int, reps: int) -> dict:
    """{kernel: (median, best) G multiply-accumulates a second} for tn activation rows."""
    import pyopencl as cl
    prg = cl.Program(ctx, SRC).build(options=f"-DTN={tn}")
    rng = np.random.default_rng(0)
    w = rng.integers(0, 16, (M, K), dtype=np.uint8)            # 4-bit codes, as u8
    x = rng.integers(-127, 128, (tn, K), dtype=np.int8)
    want = x.astype(np.int32) @ w.T.astype(np.int32)
    mf, k4 = cl.mem_flags, K // 4
    xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x.view(np.int32).copy())
    out = cl.Buffer(ctx, mf.WRITE_ONLY, tn * M * 4)
    got = {}
    for rows, name in ((8, "k256"), (16, "k512")):
        wt = w.view(np.int32).reshape(M // rows, rows, k4).transpose(0, 2, 1).copy()
        wb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=wt)
        kern, args = getattr(prg, name), (wb, xb, out, np.int32(k4), np.int32(M))
        kern(q, (M // rows,), None, *args)
        y = np.empty((tn, M), np.int32)
        cl.enqueue_copy(q, y, out)
        if not np.array_equal(y, want):
            raise AssertionError(f"{name}: wrong products")
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(20):
                kern(q, (M // rows,), None, *args)
            q.finish()
            ts.append((time.perf_counter() - t0) / 20)
        got[name] = (M * K * tn / np.median(ts) / 1e9, M * K * tn / min(ts) / 1e9)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vnni_peak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=1536, help="weight rows (a multiple of 16)")
    ap.add_argument("--k", type=int, default=1536, help="columns (a multiple of 4)")
    ap.add_argument("--rows", default="8,16,32", help="activation rows, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    if a.m % 16 or a.k % 4:
        ap.error("--m must be a multiple of 16 and --k of 4")
    from socllm.actors.gpu.device import make_context
    from socllm.policies.config import EngineConfig
    from socllm.policies.threads import actor_env
    os.environ.update(actor_env(EngineConfig.from_env().budget))    # the GPU actor's thread budget
    ctx, q, dev = make_context("cpu")
    print(f"{dev.name.strip()}: M={a.m} K={a.k}, G multiply-accumulates a second, median (best) "
          f"of {a.reps}")
    for tn in (int(r) for r in a.rows.split(",")):
        got = run(ctx, q, a.m, a.k, tn, a.reps)
        print(f"  {tn:3d} rows: 256-bit {got['k256'][0]:6.1f} ({got['k256'][1]:6.1f})   "
              f"512-bit {got['k512'][0]:6.1f} ({got['k512'][1]:6.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
