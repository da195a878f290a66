"""What one kernel launch costs the host on an OpenCL device: enqueues of an empty kernel with 1
and with 20 arguments (a fused decode kernel takes ~20), timed from Python, with and without
setting one argument again per launch (a bound decode launch sets those that move with pos0).

    python -m socllm.scripts.launch_cost [--n 2000]

A decode step is one launch per unit (GPUBackend); when the host cost per launch exceeds the
kernel's own time, the step is bound by it (scripts/profile_decode.py: "outside kernels").
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

SRC = """
__kernel void one(__global uchar* a) { if (get_global_id(0) == 1u << 30) a[0] = 1; }
__kernel void twenty(__global uchar* a, ulong b, ulong c, ulong d, ulong e, ulong f, ulong g,
                     ulong h, ulong i, ulong j, ulong k, ulong l, ulong m, int n, int o, int p,
                     int q, float r, int s, ulong t)
{ if (get_global_id(0) == 1u << 30) a[0] = (uchar)(b + t + n + s); }
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    n = ap.parse_args().n
    from socllm.actors.gpu.device import make_context
    from socllm.actors.gpu.device import cl
    ctx, queue, device = make_context()
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 64)
    prg = cl.Program(ctx, SRC).build()
    one, twenty = cl.Kernel(prg, "one"), cl.Kernel(prg, "twenty")
    one.set_arg(0, buf)
    twenty.set_arg(0, buf)
    for i in range(1, 13):
        twenty.set_arg(i, np.uint64(i))
    for i, v in zip(range(13, 20), (np.int32(1),) * 4 + (np.float32(1),) + (np.int32(1), np.uint64(1))):
        twenty.set_arg(i, v)
    cases = {"1 argument": (one, None), "20 arguments": (twenty, None),
             "20 arguments, one set again": (twenty, 17)}
    print(f"{device.name} ({device.platform.name}): host time per launch, {n} launches, 5 rounds")
    for name, (knl, again) in cases.items():
        per = []
        for _ in range(5):
            queue.finish()
            t0 = time.perf_counter()
            for k in range(n):
                if again is not None:
                    knl.set_arg(again, np.int32(k))
                cl.enqueue_nd_range_kernel(queue, knl, (256, 4), (32, 4))
            t1 = time.perf_counter()
            queue.finish()
            t2 = time.perf_counter()
            per.append(((t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6))
        enq, done = zip(*per)
        print(f"  {name:28s} enqueue {statistics.median(enq):6.2f} us (min {min(enq):.2f}), "
              f"until done {statistics.median(done):6.2f} us")


if __name__ == "__main__":
    main()
