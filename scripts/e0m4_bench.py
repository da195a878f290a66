"""Decode GEMV speed, E0M4 FP4 vs Q4_1, on the OpenCL device (Transformer-Lite §3.4, Table 1).

    .venv/bin/python -m socllm.scripts.e0m4_bench [--reps 15] [--inner 200] [--json]

Both sides read the same layer's weights of the model (blk.0: attn_q 576x576, ffn_gate 1536x576,
ffn_down 576x1536; E0M4 requantized from the Q4_1 values) from one zero-copy arena. Q4_1 runs as the
engine's unfused linear op runs it: CLKernels.run("linear", ..., N=1), f32 activations (linear_gemv);
E0M4 runs E0M4Kernels.gemv, the same kernel but for the dequantization, with the same LIN_T / LIN_R.
(The fused decode, graph/fuse.py's linear_act over a prepared activation row, is not compared.) A
timing is the wall time of `inner` back-to-back launches and one finish, divided by `inner`; the
two formats alternate rep by rep so that load from other processes falls on both.
Threads: PoCL's POCL_MAX_PTHREAD_COUNT as set in the environment (its default: all cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from socllm.models.e0m4 import from_q4_1
from socllm.models.gguf_file import default_model_path, open_gguf
from socllm.models.quant import repack_q4_1

SHAPES = {"attn_q": "blk.0.attn_q.weight", "ffn_gate": "blk.0.ffn_gate.weight",
          "ffn_down": "blk.0.ffn_down.weight"}
ARENA = 16 << 20


class Arena:
    """A page-aligned uint8 arena and a 64-byte bump allocator over it (the pool's alignment)."""

    def __init__(self, nbytes: int):
        raw = np.zeros(nbytes + 4096, np.uint8)
        start = -raw.ctypes.data % 4096
        self.a, self.top, self._raw = raw[start: start + nbytes], 0, raw

    def put(self, x: np.ndarray) -> int:
        b = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        off = self.top
        self.a[off: off + b.size] = b
        self.top = (off + b.size + 63) // 64 * 64
        return off


def timings(launch, finish, reps_out: list, inner: int):
    t0 = time.perf_counter()
    for _ in range(inner):
        launch()
    finish()
    reps_out.append((time.perf_counter() - t0) / inner * 1e6)   # us a GEMV


def stats(xs: list) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from socllm.actors.gpu.device import make_context, wrap_arena
    from socllm.actors.gpu.kernels import CLKernels
    from socllm.actors.gpu.e0m4 import E0M4Kernels
    tensors = {t.name: t for t in open_gguf(default_model_path()).tensors}
    ctx, queue, device = make_context()
    arena = Arena(ARENA)
    buf = wrap_arena(ctx, arena.a)
    q4 = CLKernels(ctx, queue, buf)                 # the engine's GPU kernels, f32 activations
    e4 = E0M4Kernels(ctx, queue, buf)
    assert (q4.lin_t, q4.lin_r) == (e4.lin_t, e4.lin_r), "both GEMVs must split rows alike"
    rng = np.random.default_rng(0)
    res = {"device": f"{device.name} ({device.platform.name}, {device.platform.version})",
           "pocl_threads": os.environ.get("POCL_MAX_PTHREAD_COUNT", "PoCL default (all cores)"),
           "lin_t": q4.lin_t, "lin_r": q4.lin_r, "inner": a.inner, "reps": a.reps, "shapes": {}}
    for key, name in SHAPES.items():
        t = tensors[name]
        K, M = (int(n) for n in t.shape)            # GGUF lists the input width first
        p = repack_q4_1(np.asarray(t.data), M, K)
        qs, scale, bias = from_q4_1(p)
        x = arena.put(rng.standard_normal(K).astype(np.float32))
        w4 = ("w4", arena.put(p["qs"]), arena.put(p["d"]), arena.put(p["m"]))
        we = (arena.put(qs), arena.put(scale), arena.put(bias))
        out4, oute = arena.put(np.zeros(M, np.float32)), arena.put(np.zeros(M, np.float32))
        lin = {"x": ("a", x), "w": w4, "out": ("a", out4), "K": K, "M": M}
        run4 = lambda: q4.run("linear", lin, 1, 0)                          # noqa: E731
        rune = lambda: e4.gemv(x, we, oute, K, M)                           # noqa: E731
        for f in (run4, rune):                      # warm: PoCL compiles per work-group size
            f()
        q4.finish()
        t4, te = [], []
        for _ in range(a.reps):
            timings(run4, q4.finish, t4, a.inner)
            timings(rune, e4.finish, te, a.inner)
        y4, ye = (arena.a[o: o + 4 * M].view(np.float32) for o in (out4, oute))
        res["shapes"][f"{M}x{K}"] = {
            "tensor": name, "q4_1_us": stats(t4), "e0m4_us": stats(te),
            "speedup_median": statistics.median(t4) / statistics.median(te),
            "speedup_min": min(t4) / min(te),
            "out_rel_diff": float(np.abs(y4 - ye).max() / np.abs(y4).max())}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['device']}; POCL threads: {res['pocl_threads']}; "
          f"LIN_T={q4.lin_t} LIN_R={q4.lin_r}")
    print(f"{'W [M, K]':<10}{'Q4_1 us min/med/max':>26}{'E0M4 us min/med/max':>26}"
          f"{'Q4_1/E0M4 med':>15}{'min':>7}")
    for shape, r in res["shapes"].items():
        f = lambda s: f"{s['min']:.1f}/{s['median']:.1f}/{s['max']:.1f}"   # noqa: E731
        print(f"{shape:<10}{f(r['q4_1_us']):>26}{f(r['e0m4_us']):>26}"
              f"{r['speedup_median']:>15.3f}{r['speedup_min']:>7.3f}")


if __name__ == "__main__":
    main()
