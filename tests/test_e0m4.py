"""E0M4 FP4 weights (models/e0m4.py) and their OpenCL GEMV (actors/gpu/cl/e0m4.cl), as specifications.

Numerics: dequantization is exact (the bitwise decode equals (q - z) * scale / 8 in f64, rounded
once); quantization errs by at most half a code step; the OpenCL GEMV agrees with the numpy one at
|cl - np| <= 1e-5 * (max|np| + |np|) (f32 sums in another order), on the model's own weights.
"""
from __future__ import annotations

import os

os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", "2")  # before pyopencl starts PoCL

import numpy as np
import pytest

from socllm.models.e0m4 import (dequantize_e0m4, encode_e0m4, from_q4_1, linear_e0m4,
                                quantize_e0m4)
from socllm.models.quant import QK, dequant_q4_1, repack_q4_1, unpack_nibbles

RTOL = 1e-5


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def random_e0m4(rng, M, K):
    """Random codes, f16 scales (subnormal ones too) and zero codes z: bias = 2 + z/8."""
    qs = rng.integers(0, 256, (M, K // 2), dtype=np.uint8)
    scale = rng.uniform(1e-3, 0.5, (M, K // QK)).astype(np.float16)
    scale.flat[::7] = 3e-6                                          # f16 subnormal
    bias = (2 + rng.integers(0, 16, (M, K // QK)) / 8).astype(np.float16)
    return qs, scale, bias


def reference_weights(qs, scale, bias):
    """The format's arithmetic definition in f64: w = (q - z) * scale / 8, z = 8 * (bias - 2)."""
    M = qs.shape[0]
    q = unpack_nibbles(qs).reshape(M, -1, QK).astype(np.float64)
    z = 8 * (bias.astype(np.float64) - 2)
    return ((q - z[:, :, None]) * scale.astype(np.float64)[:, :, None] / 8).reshape(M, -1)


def step(scale):
    """Each weight's code step, scale / 8 (scale is w0 per unit of w1; codes are 1/8 apart)."""
    return np.repeat(scale.astype(np.float32) / 8, QK, axis=1)


# -- the format ---------------------------------------------------------------------------------
def test_bitwise_decode_is_the_arithmetic_definition_exactly(rng):
    qs, scale, bias = random_e0m4(rng, 64, 256)
    want = reference_weights(qs, scale, bias).astype(np.float32)   # one rounding, from f64
    assert np.array_equal(dequantize_e0m4(qs, scale, bias), want)


def test_grid_values_round_trip_exactly(rng):
    """Values on a scale/bias's grid encode to the codes they came from, bit for bit."""
    qs, scale, bias = random_e0m4(rng, 64, 256)
    w = dequantize_e0m4(qs, scale, bias)
    assert np.array_equal(encode_e0m4(w, scale, bias), qs)
    assert np.array_equal(dequantize_e0m4(encode_e0m4(w, scale, bias), scale, bias), w)


def test_bias_keeps_only_the_code_bits(rng):
    """§2.3: bias = 2 + z/8 (no fraction bits past the top 4), so zero weights stay exactly 0."""
    w = rng.standard_normal((32, 256)).astype(np.float32) * 0.05
    w[rng.random(w.shape) < 0.2] = 0.0
    qs, scale, bias = quantize_e0m4(w)
    b = bias.astype(np.float32)
    assert ((b >= 2) & (b < 4)).all() and np.array_equal(b * 8, np.round(b * 8))
    assert (dequantize_e0m4(qs, scale, bias)[w == 0] == 0).all()


@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform_positive", "outliers"])
def test_quantization_errs_at_most_half_a_step(rng, dist):
    M, K = 64, 512
    w = {"normal": lambda: rng.standard_normal((M, K)),
         "laplace": lambda: rng.laplace(size=(M, K)),
         "uniform_positive": lambda: rng.uniform(0.5, 1.0, (M, K)),
         "outliers": lambda: rng.standard_normal((M, K)) * (1 + 50 * (rng.random((M, K)) < 0.01)),
         }[dist]().astype(np.float32) * 0.05
    w[0, :QK] = 0.0                                                # an all-zero group
    w[1, :QK] = -0.3                                               # a constant group
    qs, scale, bias = quantize_e0m4(w)
    err = np.abs(dequantize_e0m4(qs, scale, bias) - w)
    assert (err <= step(scale) * (0.5 + 1e-5)).all()
    assert (err[0, :QK] == 0).all()


def test_error_is_that_of_int4_with_an_integer_zero_point(rng):
    """The paper's comparison (§3.4, Table 2) is against INT4 with a zero point; with the eps slack
    used (16/15 of the range per 16 codes) E0M4's mean error is no larger on Gaussian weights."""
    w = rng.standard_normal((256, 1024)).astype(np.float32) * 0.05
    e0m4 = np.abs(dequantize_e0m4(*quantize_e0m4(w)) - w).mean()
    g = w.reshape(256, -1, QK)
    lo, hi = np.minimum(g.min(2, keepdims=True), 0), np.maximum(g.max(2, keepdims=True), 0)
    d = (hi - lo) / 15
    z = np.round(-lo / d)
    int4 = np.abs((np.clip(np.round(g / d) + z, 0, 15) - z) * d - g).mean()
    assert e0m4 <= int4


def test_requantized_q4_1_weight_errs_at_most_half_a_step(q4_weights):
    t = q4_weights["ffn_down"]
    qs, scale, bias = from_q4_1(t)
    w = dequant_q4_1(t["qs"], t["d"], t["m"])
    err = np.abs(dequantize_e0m4(qs, scale, bias) - w)
    assert (err <= step(scale) * (0.5 + 1e-5)).all()


def test_unsnapped_bias_decodes_q4_1_codes_as_they_are(q4_weights):
    """from_q4_1(snap_bias=False) keeps the Q4_1 codes: only the f16 bias's rounding moves them."""
    t = q4_weights["ffn_down"]
    qs, scale, bias = from_q4_1(t, snap_bias=False)
    assert np.array_equal(qs, t["qs"])
    w = dequant_q4_1(t["qs"], t["d"], t["m"])
    err = np.abs(dequantize_e0m4(qs, scale, bias) - w)
    assert (err <= step(scale) / 128 + 1e-6 * np.abs(w)).all()


def test_numpy_matmul_matches_the_f64_reference(rng):
    qs, scale, bias = random_e0m4(rng, 37, 576)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    want = x.astype(np.float64) @ reference_weights(qs, scale, bias).T
    np.testing.assert_allclose(linear_e0m4(x, qs, scale, bias), want,
                               rtol=RTOL, atol=RTOL * float(np.abs(want).max()))


@pytest.mark.parametrize("bad", [np.zeros((4, 40)), np.zeros(64), np.full((2, 64), np.nan)])
def test_bad_input_raises(bad):
    with pytest.raises(ValueError, match="multiple of 32|finite"):
        quantize_e0m4(bad)


# -- the OpenCL GEMV ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def q4_weights(gguf_reader):
    """blk.0's Q4_1 matrices of SmolLM2-135M, repacked planar (not the whole model: fast)."""
    names = {"attn_q": "blk.0.attn_q.weight", "attn_k": "blk.0.attn_k.weight",
             "ffn_gate": "blk.0.ffn_gate.weight", "ffn_down": "blk.0.ffn_down.weight"}
    by_name = {t.name: t for t in gguf_reader.tensors}
    out = {}
    for key, name in names.items():
        t = by_name[name]
        K, M = (int(n) for n in t.shape)                            # GGUF lists the input width first
        out[key] = repack_q4_1(np.asarray(t.data), M, K)
    return out


@pytest.fixture(scope="module")
def cl_dev():
    import pyopencl as cl
    from socllm.actors.gpu.device import make_context, wrap_arena
    ctx, queue, _ = make_context()
    raw = np.zeros((8 << 20) + 4096, np.uint8)
    start = -raw.ctypes.data % 4096                                 # page-aligned, as the pool's
    arena = raw[start: start + (8 << 20)]
    return cl, ctx, queue, arena, wrap_arena(ctx, arena)


def put(arena, top, a) -> tuple[int, int]:
    """Copy a into the arena at top; -> (its offset, the next 64-aligned top)."""
    a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    arena[top: top + a.size] = a
    return top, (top + a.size + 63) // 64 * 64


@pytest.fixture(scope="module", params=["", "-DLIN_T=4 -DLIN_R=2 -DSOCLLM_PORTABLE"],
                ids=["cpu", "gpu-split"])
def e0m4_kernels(cl_dev, request):
    """This device's build, and the one a GPU gets (rows split over 4 work-items, vload_half)."""
    from socllm.actors.gpu.e0m4 import E0M4Kernels
    _, ctx, queue, _, buf = cl_dev
    return E0M4Kernels(ctx, queue, buf, request.param)


@pytest.mark.parametrize("name,rows", [("attn_q", None), ("attn_k", None), ("ffn_gate", None),
                                       ("ffn_down", None), ("ffn_down", 37)])
def test_cl_gemv_matches_numpy_on_model_weights(cl_dev, e0m4_kernels, q4_weights, rng, name,
                                                 rows):
    """576x576, 192x576, 1536x576, 576x1536, and 37 rows (M not a multiple of LIN_R)."""
    arena, kern = cl_dev[3], e0m4_kernels
    qs, scale, bias = (a[:rows] for a in from_q4_1(q4_weights[name]))
    M, K = qs.shape[0], qs.shape[1] * 2
    x = rng.standard_normal(K).astype(np.float32)
    arena[:] = 0
    top = 0
    offs = []
    for a in (x, qs, scale, bias, np.zeros(M, np.float32)):
        off, top = put(arena, top, a)
        offs.append(off)
    before = arena.copy()
    kern.gemv(offs[0], tuple(offs[1:4]), offs[4], K, M)
    kern.finish()
    want = linear_e0m4(x[None], qs, scale, bias)[0]
    got = arena[offs[4]: offs[4] + 4 * M].view(np.float32)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))
    after = arena.copy()
    after[offs[4]: offs[4] + 4 * M] = before[offs[4]: offs[4] + 4 * M]
    assert np.array_equal(after, before), "bytes outside the output changed"


def test_cl_gemv_rejects_bad_shapes_and_misalignment(e0m4_kernels):
    kern = e0m4_kernels
    with pytest.raises(ValueError, match="multiple of 32"):
        kern.gemv(0, (1024, 2048, 3072), 4096, 40, 8)
    with pytest.raises(ValueError, match="multiples of 32"):
        kern.gemv(4, (1024, 2048, 3072), 4096, 64, 8)
