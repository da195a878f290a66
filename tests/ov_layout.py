"""The NPU kernel tests' model pieces (tests/test_kernels_ov.py, tests/test_npu_buckets.py):
random SmolLM2-sized weights and activation slots in one arena, whole decoder layers and single
ops as task lists, and the comparison against the numpy specification."""
from __future__ import annotations

import numpy as np
import openvino as ov

from socllm.actors.cpu.kernels import NumpyKernels
from socllm.actors.npu.segment import OVSegment

D, H, KVH, HD, F, V = 576, 9, 3, 64, 1536, 4096   # SmolLM2-135M sizes; V cut from 49152 for speed
EPS, THETA = 1e-5, 10000.0
CAP = 640                                         # KV capacity rows: pos0 37 + bucket 512 fits
CONFIG = {"INFERENCE_NUM_THREADS": 2}
RTOL = 1e-4


class Layout:
    """Random model weights and activation slots in one uint8 arena, 64-byte aligned."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.parts, self.size = [], 0

    def put(self, arr: np.ndarray) -> int:
        off = self.size
        self.parts.append((off, np.ascontiguousarray(arr)))
        self.size = (off + arr.nbytes + 63) // 64 * 64
        return off

    def slot(self, rows, cols, dtype=np.float32) -> int:
        return self.put(np.zeros((rows, cols), dtype))

    def w4(self, M, K):
        r = self.rng
        d = r.uniform(0.002, 0.01, (M, K // 32)).astype(np.float16)
        m = (-8 * d.astype(np.float32) * r.uniform(0.9, 1.1, d.shape)).astype(np.float16)
        return ("w4", self.put(r.integers(0, 256, (M, K // 2), dtype=np.uint8)), self.put(d), self.put(m))

    def wq(self, fmt, M, K):
        """A block-format weight (models/quant.py) from random GGUF blocks, finite scales."""
        from socllm.models.quant import planar
        from socllm.models.synthetic import random_blocks
        size = {"Q4_K": 2e-3, "Q5_K": 1e-3, "Q6_K": 5e-4}.get(fmt, 0.01)
        raw = random_blocks(fmt, M, K, self.rng, lambda n: self.rng.uniform(-1, 1, n) * size)
        p = planar(fmt, raw, M, K)
        return ("wq", fmt, self.put(p["qs"]), self.put(p["dm"]), self.put(p["qh"]) if "qh" in p else 0)

    def w8(self, rows, cols):
        d = self.rng.uniform(0.001, 0.005, (rows, cols // 32)).astype(np.float16)
        return ("w8", self.put(self.rng.integers(-127, 128, (rows, cols), dtype=np.int8)), self.put(d))

    def wf(self, n):
        return ("wf", self.put((1 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)))

    def arena(self) -> np.ndarray:
        a = np.zeros(self.size, np.uint8)
        for off, arr in self.parts:
            a[off: off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        return a


def f32(arena, off, rows, cols):
    return arena[off: off + rows * cols * 4].view(np.float32).reshape(rows, cols)


def run_both(tasks, arena, bucket, N, pos0, live_out, shared=None):
    """-> (arena after OVSegment, arena after the numpy kernels, segment)."""
    ref = arena.copy()
    for op, args in tasks:
        NumpyKernels(ref).run(op, args, N, pos0)
    seg = OVSegment(ov.Core(), tasks, arena, bucket, live_out, CAP, config=CONFIG, shared=shared)
    seg.run(N, pos0)
    return arena, ref, seg


def close(got, want, rtol=RTOL):
    """Relative to the tensor's scale: error / max|want| <= rtol."""
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert np.all(np.isfinite(got)) and err <= rtol, f"relative error {err:.2e}"
    return err


def slots(L: Layout) -> dict:
    """Activation slots for up to 512 rows, shared by all layers (Transformer-Lite §2.1)."""
    return dict(ids=L.put(np.zeros(512, np.int32)), x=L.slot(512, D), h=L.slot(512, D),
                q=L.slot(512, H * HD), k=L.slot(512, KVH * HD), att=L.slot(512, H * HD),
                g=L.slot(512, F), u=L.slot(512, F), logits=L.slot(1, V))


def decoder_layer(L: Layout, s: dict, window: int = 0, act: str = "silu"):
    """One Llama layer over reused slots (h written three times, q twice: rope in place) with its
    own weights and KV caches; s["kc"], s["vc"] name this layer's caches afterwards. window, act:
    Gemma 3's sliding-window attention and GeGLU."""
    s["kc"], s["vc"] = L.slot(CAP, KVH * HD), L.slot(CAP, KVH * HD)
    a = lambda name: ("a", s[name])
    kv = lambda name: ("kv", s[name])
    tasks = [
        ("rmsnorm", dict(x=a("x"), w=L.wf(D), out=a("h"), D=D, eps=EPS)),
        ("linear", dict(x=a("h"), w=L.w4(H * HD, D), out=a("q"), K=D, M=H * HD)),
        ("linear", dict(x=a("h"), w=L.w4(KVH * HD, D), out=a("k"), K=D, M=KVH * HD)),
        ("linear", dict(x=a("h"), w=L.w4(KVH * HD, D), out=kv("vc"), K=D, M=KVH * HD)),
        ("rope", dict(x=a("q"), out=a("q"), heads=H, head_dim=HD, theta=THETA)),
        ("rope", dict(x=a("k"), out=kv("kc"), heads=KVH, head_dim=HD, theta=THETA)),
        ("attention", dict(q=a("q"), k=kv("kc"), v=kv("vc"), out=a("att"), heads=H, kv_heads=KVH,
                           head_dim=HD, **({"window": window} if window else {}))),
        ("linear", dict(x=a("att"), w=L.w4(D, H * HD), out=a("h"), K=H * HD, M=D)),
        ("add", dict(a=a("x"), b=a("h"), out=a("x"), D=D)),
        ("rmsnorm", dict(x=a("x"), w=L.wf(D), out=a("h"), D=D, eps=EPS)),
        ("linear", dict(x=a("h"), w=L.w4(F, D), out=a("g"), K=D, M=F)),
        ("linear", dict(x=a("h"), w=L.w4(F, D), out=a("u"), K=D, M=F)),
        (f"{act}_mul", dict(g=a("g"), u=a("u"), out=a("g"), F=F)),
        ("linear", dict(x=a("g"), w=L.w4(D, F), out=a("h"), K=F, M=D)),
        ("add", dict(a=a("x"), b=a("h"), out=a("x"), D=D)),
    ]
    return tasks


def model(L: Layout, s: dict, layers: int):
    """embed -> layers -> final norm -> lm_head (tied table), and each layer's (kc, vc) caches."""
    table, caches = L.w8(V, D), []
    tasks = [("embed", dict(ids=("a", s["ids"]), table=table, out=("a", s["x"]), V=V, D=D))]
    for _ in range(layers):
        tasks += decoder_layer(L, s)
        caches.append((s["kc"], s["vc"]))
    tasks += [("rmsnorm", dict(x=("a", s["x"]), w=L.wf(D), out=("a", s["h"]), D=D, eps=EPS)),
              ("lm_head", dict(x=("a", s["h"]), table=table, out=("a", s["logits"]), D=D, V=V))]
    return tasks, caches


def rand_rows(arena, off, rows, cols, rng):
    f32(arena, off, rows, cols)[:] = rng.standard_normal((rows, cols))


# -- one op per segment --------------------------------------------------------------------------
def single_op(op: str, L: Layout, s: dict):
    a = lambda name: ("a", s[name])
    return {
        "embed": ("embed", dict(ids=a("ids"), table=L.w8(V, D), out=a("x"), V=V, D=D)),
        "rmsnorm": ("rmsnorm", dict(x=a("x"), w=L.wf(D), out=a("h"), D=D, eps=EPS)),
        "linear": ("linear", dict(x=a("g"), w=L.w4(D, F), out=a("h"), K=F, M=D)),
        "rope": ("rope", dict(x=a("q"), out=a("att"), heads=H, head_dim=HD, theta=THETA)),
        "attention": ("attention", dict(q=a("q"), k=("kv", s["kc"]), v=("kv", s["vc"]), out=a("att"),
                                        heads=H, kv_heads=KVH, head_dim=HD)),
        "silu_mul": ("silu_mul", dict(g=a("g"), u=a("u"), out=a("g"), F=F)),
        "gelu_mul": ("gelu_mul", dict(g=a("g"), u=a("u"), out=a("g"), F=F)),
        "embed_scaled": ("embed", dict(ids=a("ids"), table=L.w8(V, D), out=a("x"), V=V, D=D, scale=24.0)),
        "attention_window": ("attention", dict(q=a("q"), k=("kv", s["kc"]), v=("kv", s["vc"]),
                                               out=a("att"), heads=H, kv_heads=KVH, head_dim=HD, window=5)),
        "add": ("add", dict(a=a("x"), b=a("h"), out=a("h"), D=D)),
        "lm_head": ("lm_head", dict(x=a("x"), table=L.w8(V, D), out=a("logits"), D=D, V=V)),
    }[op]
