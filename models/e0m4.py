"""E0M4 FP4 weights (Transformer-Lite §2.3): 4-bit codes that become floats by two bitwise ops.

Each group of 32 weights w0 (one row, 32 columns: the Q4_1 block) is mapped affinely into
w1 = w0 / scale + bias, all of it inside [2, 4) (the paper's [2^n, 2^(n+1) - eps] with n = 1), so
every w1 shares the sign and exponent bits and differs only in the fraction. The code is the top
4 fraction bits y1, rounded by the next bit y2: q = min(y1 + y2, 15). Dequantization ORs q into
the constant sign/exponent bits and reinterprets (the paper's as_half), then undoes the map:

    w1 = as_float(0x40000000 | q << 19)        # 2 + q/8: exponent 1, q the top 4 fraction bits
    w0 = (w1 - bias) * scale                    # = w1 * scale + (-bias * scale): one FMA a weight

Layout, planar like models/quant.py's Q4_1 (the same 5 bits a weight, so speed compares fairly):

    qs    uint8 [M, K/2]   byte i = q[2i] | q[2i+1] << 4  (sequential nibbles)
    scale f16   [M, K/32]  w0 per unit of w1, 8x the code step (rounded up: the group still fits)
    bias  f16   [M, K/32]  the image of w0 = 0 in w1, in [2, 4) with only its top 4 fraction bits

Why f16 for both: bias is 2 + z/8 (z = 0..15, the paper zeroes its other fraction bits so that
zero weights quantize exactly), 5 significant bits, so f16 holds it exactly; scale needs no more
than f16's 11 bits next to a 4-bit code. And with both in f16, w1 * scale and bias * scale are exact
in f32 (at most 11 + 11 bits), so w1 * scale + (-bias * scale) rounds once, as (w1 - bias) * scale.
Why f32 bit patterns: the code is the same in f16 and f32 (the top 4 fraction bits of a number in
[2, 4)), only the constant differs (0x4000 | q << 6 for f16); this CPU (and PoCL on it) has no f16
arithmetic, so its kernels build the f32 pattern and accumulate in f32.

The model file holds no original float weights: E0M4 weights here are a requantization of the
GGUF's Q4_1 values (from_q4_1), so they carry Q4_1's error plus E0M4's own.
"""
from __future__ import annotations

import numpy as np

from .quant import QK, dequant_q4_1, unpack_nibbles

EXP_BITS = np.uint32(0x40000000)   # f32 sign 0, exponent 1 (biased 128): the numbers [2, 4)
SHIFT = 19                         # 23 fraction bits, the top 4 kept: q << 19


def quantize_e0m4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """f32 W [M, K] -> (qs u8 [M, K/2], scale f16 [M, K/32], bias f16 [M, K/32])."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"E0M4 quantizes [M, K] matrices with K a multiple of {QK}, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("E0M4: weights must be finite")
    M, K = w.shape
    g = w.reshape(M, K // QK, QK)                               # [M, K/32, 32]
    # The range always holds 0, so its image (the bias) is a code: 2 + z/8, z = 0..15.
    lo = np.minimum(g.min(axis=2), 0)[:, :, None]               # [M, K/32, 1]
    hi = np.maximum(g.max(axis=2), 0)[:, :, None]
    # Code k stands for w1 in [k - 1/2, k + 1/2) steps; lo and hi must land inside codes 0 / 15,
    # 1/2 a step past them at most (the paper's eps: w1 <= 4 - 1/16, so y1 + y2 never carries
    # into the exponent). The step each zero code z needs; the smallest wins (16 / 15 of range).
    z = np.arange(16, dtype=np.float32)                         # [16]
    step = np.maximum(-lo / (z + np.float32(0.5)), hi / (np.float32(15.5) - z))  # [M, K/32, 16]
    zbest = step.argmin(axis=2)                                 # [M, K/32]
    scale = _f16_up(np.float32(8) * np.take_along_axis(step, zbest[:, :, None], 2)[:, :, 0])
    if np.isinf(scale).any():
        raise ValueError("E0M4: a group's range overflows the f16 scale")
    # §2.3: the bias has no fraction bits past the kept 4, so w0 = 0 quantizes exactly.
    bias = (np.float32(2) + zbest.astype(np.float32) / np.float32(8)).astype(np.float16)
    return encode_e0m4(w, scale, bias), scale, bias


def encode_e0m4(w: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """f32 W [M, K] -> qs u8 [M, K/2]: the codes of w under a given scale and bias [M, K/32]."""
    w = np.asarray(w, np.float32)
    M, K = w.shape
    s = scale.astype(np.float32)
    s = np.where(s > 0, s, np.float32(1))[:, :, None]                     # all-zero groups
    # w1 in [2 - 1/16, 2) would leave the exponent: clipped to 2, the code it rounds to anyway.
    w1 = w.reshape(M, K // QK, QK) / s + bias.astype(np.float32)[:, :, None]
    w1 = np.clip(w1, np.float32(2), np.nextafter(np.float32(4), np.float32(0)))
    q = _codes(w1)                                              # [M, K/32, 32] u8
    return (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(M, K // 2)


def dequantize_e0m4(qs: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """(qs u8 [M, K/2], scale, bias f16 [M, K/32]) -> f32 W [M, K], exactly as the kernel does."""
    M = qs.shape[0]
    q = unpack_nibbles(qs).reshape(M, -1, QK).astype(np.uint32)       # [M, K/32, 32]
    w1 = (EXP_BITS | (q << SHIFT)).view(np.float32)                    # the two bitwise ops
    s = scale.astype(np.float32)[:, :, None]
    b = -bias.astype(np.float32)[:, :, None] * s                       # exact: 11 x 11 bits
    return (w1 * s + b).reshape(M, -1)


def linear_e0m4(x: np.ndarray, qs: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x [N, K] f32, W E0M4 [M, K] -> [N, M] = x @ W.T (the numpy spec of the GEMV kernel)."""
    return np.asarray(x, np.float32) @ dequantize_e0m4(qs, scale, bias).T


def from_q4_1(t: dict, snap_bias: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A planar Q4_1 weight {"qs", "d", "m"} -> E0M4.

    snap_bias (the paper's E0M4): requantize the Q4_1 values; zero is exact, but the new grid
    sits across the old one, so it adds about a fresh 4-bit quantization's error.
    snap_bias=False: keep Q4_1's codes and grid, scale = 8d, bias = 2 - m / (8d) rounded to f16
    (not on the code grid, so §2.3's exact zero is given up): E0M4's decode of the same weights,
    off by at most 1/128 of a step where the block spans 0 (bias in [2, 4)).
    """
    if snap_bias:
        return quantize_e0m4(dequant_q4_1(t["qs"], t["d"], t["m"]))
    d, m = t["d"].astype(np.float32), t["m"].astype(np.float32)            # [M, K/32]
    qs = t["qs"].copy()
    flat = d == 0                                   # a constant group: code 0 carries m alone
    qs.reshape(*d.shape, QK // 2)[flat] = 0
    d = np.where(flat, np.where(m != 0, np.abs(m), 1), d)
    bias = (np.float32(2) - m / (np.float32(8) * d)).astype(np.float16)
    if not np.isfinite(bias).all():
        raise ValueError("E0M4: a Q4_1 block's m / d overflows the f16 bias")
    return qs, (np.float32(8) * d).astype(np.float16), bias


def _codes(w1: np.ndarray) -> np.ndarray:
    """w1 f32 in [2, 4) -> q = min(y1 + y2, 15): y1 the top 4 fraction bits, y2 the next one."""
    bits = w1.view(np.uint32)
    y1 = (bits >> SHIFT) & 0xF
    y2 = (bits >> (SHIFT - 1)) & 1
    return np.minimum(y1 + y2, 15).astype(np.uint8)


def _f16_up(s: np.ndarray) -> np.ndarray:
    """f32 -> f16 rounded up (never below s): a larger step still covers the range."""
    h = s.astype(np.float16)
    low = h.astype(np.float32) < s
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h
