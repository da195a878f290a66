"""Quantized weight formats: GGUF blocks -> socllm's planar layout, and their dequantization.

socllm keeps weights 4-bit in memory (W4A16). GGUF stores Q4_1 as 20-byte blocks of 32 weights
(f16 d, f16 m, 16 bytes of nibbles: low nibbles are elements 0..15, high nibbles 16..31). Every
backend reads one planar repacking of it instead, so that each array is a plain typed array:

  Q4_1 weight W [M, K]  ->  qs uint8 [M, K/2]  byte i = q[2i] | q[2i+1] << 4  (sequential nibbles,
                                                  OpenVINO's u4 order, so it wraps the pool as is)
                            d  f16   [M, K/32]   block scale
                            m  f16   [M, K/32]   block minimum      w = f32(d) * q + f32(m)
  Q8_0 weight W [V, D]  ->  qs int8  [V, D]
                            d  f16   [V, D/32]                      w = f32(d) * q
"""
from __future__ import annotations

import numpy as np

QK = 32  # weights per block in both formats


def repack_q4_1(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """GGUF Q4_1 bytes [rows, cols/32*20] -> {"qs": [rows, cols/2] u8, "d", "m": [rows, cols/32] f16}."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK, 20)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    nib = blocks[:, :, 4:20]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=2)  # [rows, blocks, 32] in element order
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8).reshape(rows, cols // 2)
    return {"qs": qs, "d": np.ascontiguousarray(d), "m": np.ascontiguousarray(m)}


def repack_q8_0(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """GGUF Q8_0 bytes [rows, cols/32*34] -> {"qs": [rows, cols] i8, "d": [rows, cols/32] f16}."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK, 34)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    qs = blocks[:, :, 2:34].copy().view(np.int8).reshape(rows, cols)
    return {"qs": qs, "d": np.ascontiguousarray(d)}


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., K/2] u8 -> [..., K] u8 (sequential nibble order)."""
    out = np.empty(qs.shape[:-1] + (qs.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = qs & 0x0F
    out[..., 1::2] = qs >> 4
    return out


def dequant_q4_1(qs: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Planar Q4_1 -> f32 [M, K]."""
    rows = qs.shape[0]
    q = unpack_nibbles(qs).reshape(rows, -1, QK).astype(np.float32)
    w = q * d.astype(np.float32)[:, :, None] + m.astype(np.float32)[:, :, None]
    return w.reshape(rows, -1)


def dequant_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Planar Q8_0 -> f32 [V, D] (works on any subset of rows)."""
    rows = qs.shape[0]
    w = qs.reshape(rows, -1, QK).astype(np.float32) * d.astype(np.float32)[:, :, None]
    return w.reshape(rows, -1)
