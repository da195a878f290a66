"""Quantized weight formats: GGUF blocks -> socllm's planar layout, and their dequantization.

socllm keeps every matrix in the bits its file gives it. GGUF's block formats all dequantize as
an affine map per group of weights, w = d * q + m with an unsigned integer code q, so every
backend reads one planar repacking of them, whose arrays are plain typed arrays. Q4_1 and Q4_0
(4-bit codes, f16 d and m: the layout the fast kernels were written for, "w4" refs):

  qs u8 [M, K/2]    byte i = q[2i] | q[2i+1] << 4 (sequential nibbles, OpenVINO's u4 order)
  d, m f16 [M, K/32]                                     w = f32(d) * q + f32(m)

Every other block format ("wq" refs, FORMATS gives each its code width, group g, scale type):

  qs u8 [M, K/2]          the codes' low nibbles, as above
  dm [M, K/g, 2]          (d, m) per group, f16 or f32 side by side
  qh u8 [M, K/32 * HB]    the codes' high bits, per 32-weight block (none for 4-bit codes):
                          5-bit codes: one u32, bit j = lane j's bit 4; 6-bit: two u32 (bit 4,
                          then bit 5); 8-bit: 16 bytes of high nibbles in sequential order.
                          Lane j < 16 is weight 2j, lane 16 + j weight 2j + 1: the order of the
                          kernels' prepared activations (evens, then odds)

The layout keeps the file's bits for the codes (5-bit: 5 bits a weight, not 8); the scales are
wider where the file derives them (the K-quants' 6-bit sub-scales times an f16 super-scale are
stored as their f32 products). Every map is exact: for the given GGUF block, f32(d) * q + f32(m)
equals what gguf's reference dequantizer computes (the tests compare them on random blocks),
because d * q is exact in f32 and the sum rounds once:

  Q4_0  q = nibble,          d,  m = -8 d      (f16: -8 d is exact)
  Q4_1  q = nibble,          d,  m
  Q5_0  q = 5 bits,          d,  m = -16 d
  Q5_1  q = 5 bits,          d,  m
  Q8_0  q = int8 + 128,      d,  m = -128 d
  Q4_K  q = nibble,          d = d_super * sc6,  m = -dmin * mn6       (f32: the products are
  Q5_K  q = 5 bits,          d = d_super * sc6,  m = -dmin * mn6        not f16 numbers)
  Q6_K  q = 6 bits, g = 16,  d = d_super * sc8,  m = -32 d

F32, F16 and BF16 matrices stay as they are ("wt" refs). The token embedding keeps Q8_0 in its
natural order (qs int8 [V, D], d f16 [V, D/32]): the embedding gathers rows of it and the lm-head
reads it with activations in natural order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import Q4_K as _GGUF_Q4_K

QK = 32  # weights per block of the planar layout (and of the 32-weight GGUF formats)
QK_K = 256


@dataclass(frozen=True)
class Format:
    name: str
    bits: int       # width of the code q
    group: int      # weights per (d, m) pair
    scale: str      # "f16" | "f32": d's and m's type
    block: int      # weights per GGUF block
    block_bytes: int
    zero: int = 0   # m = -zero * d in every group (a symmetric format: codes - zero are signed)

    @property
    def hb(self) -> int:
        """Bytes of qh per 32-weight block: the codes' bits above the low nibble."""
        return {4: 0, 5: 4, 6: 8, 8: 16}[self.bits]

    def bits_per_weight(self) -> float:
        scale_bytes = 2 if self.scale == "f16" else 4
        return 8 * ((16 + self.hb) / QK + 2 * scale_bytes / self.group)


FORMATS = {f.name: f for f in (
    Format("Q4_0", 4, 32, "f16", 32, 18),
    Format("Q4_1", 4, 32, "f16", 32, 20),
    Format("Q5_0", 5, 32, "f16", 32, 22, 16),
    Format("Q5_1", 5, 32, "f16", 32, 24),
    Format("Q8_0", 8, 32, "f16", 32, 34, 128),
    Format("Q4_K", 4, 32, "f32", 256, 144),
    Format("Q5_K", 5, 32, "f32", 256, 176),
    Format("Q6_K", 6, 16, "f32", 256, 210, 32),
)}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}   # BF16 kept as its bits
# byte offsets of each GGUF block's f16 scale fields (d; d and m or dmin)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
W4_FORMATS = ("Q4_0", "Q4_1")     # the 4-bit, f16, 32-group layout: "w4" refs
MATRIX_TYPES = tuple(FLOAT_TYPES) + tuple(FORMATS)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes of a 32-block [n, 16] -> codes [n, 32]: low nibbles 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes [n, 4] -> bit 4 of each of the 32 codes [n, 32]."""
    h = qh.copy().view("<u4")[:, :1]
    return ((h >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def _decode(fmt: Format, blocks: np.ndarray):
    """GGUF blocks [n, block_bytes] -> codes q u8 [n, block], d, m f32 [n, block / group] (Q4_0 and
    Q4_1: _planar_w4)."""
    n = blocks.shape[0]
    b = blocks
    if fmt.name == "Q5_0":
        d = _f16(b[:, 0:2])
        return _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6]), d[:, None], -16 * d[:, None]
    if fmt.name == "Q5_1":
        return (_nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8]),
                _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None])
    if fmt.name == "Q8_0":
        d = _f16(b[:, 0:2])
        q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d[:, None], -128 * d[:, None]
    if fmt.name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _GGUF_Q4_K.get_scale_min(b[:, 4:16])                   # [n, 8] each
        qs = b[:, 16:144] if fmt.name == "Q4_K" else b[:, 48:176]
        # 4 chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j+1
        q = np.stack([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, 8, 32)
        if fmt.name == "Q5_K":                 # bit i of byte l: high bit of sub-block i, weight l
            qh = b[:, 16:48]
            q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        return (q.reshape(n, QK_K), d[:, None] * sc.astype(np.float32),
                -(dmin[:, None] * mn.astype(np.float32)))
    if fmt.name == "Q6_K":
        ql, qh = b[:, 0:128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        lo = ((ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
        hi = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
        s = d[:, None] * sc
        return (lo | (hi << 4)).reshape(n, QK_K), s, -32 * s
    raise ValueError(f"no planar layout for {fmt.name}")


LANES = np.concatenate([np.arange(0, QK, 2), np.arange(1, QK, 2)])   # lane j -> its weight


def planar(fmt_name: str, raw: np.ndarray, rows: int, cols: int) -> dict:
    """GGUF bytes of a [rows, cols] matrix -> {"fmt", "qs", "dm", "qh" (codes wider than 4 bits)}
    (module doc); Q4_0 and Q4_1 -> {"fmt", "qs", "d", "m"}."""
    fmt = FORMATS[fmt_name]
    if cols % fmt.block:
        raise ValueError(f"{fmt.name} rows of {cols} weights are not whole {fmt.block}-weight blocks")
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // fmt.block, fmt.block_bytes)
    if fmt.name in W4_FORMATS:
        return _planar_w4(fmt, blocks, rows, cols)
    q, d, m = _decode(fmt, blocks)
    q = q.reshape(rows, cols // QK, QK)
    dtype = np.float16 if fmt.scale == "f16" else np.float32
    d, m = d.reshape(rows, cols // fmt.group), m.reshape(rows, cols // fmt.group)
    dd, mm = d.astype(dtype), m.astype(dtype)
    if dtype is np.float16 and not (np.array_equal(dd.astype(np.float32), d, equal_nan=True)
                                    and np.array_equal(mm.astype(np.float32), m, equal_nan=True)):
        raise ValueError(f"{fmt.name} scales outside f16's range")   # |d| > 65504 / 128
    qs = _pack(q & 0x0F).reshape(rows, cols // 2)
    if fmt.name in W4_FORMATS:
        return {"fmt": fmt.name, "qs": qs, "d": np.ascontiguousarray(dd), "m": np.ascontiguousarray(mm)}
    out = {"fmt": fmt.name, "qs": qs, "dm": np.ascontiguousarray(np.stack([dd, mm], axis=-1))}
    if fmt.hb:
        out["qh"] = _pack_high(q >> 4, fmt.bits).reshape(rows, -1)
    return out


def _planar_w4(fmt: Format, blocks: np.ndarray, rows: int, cols: int) -> dict:
    """planar() of Q4_0 / Q4_1 without unpacking the codes (~3x faster: the default model's
    start): GGUF's code byte j holds codes j (low nibble) and j + 16 (high), the sequential
    order's byte j codes 2j and 2j + 1."""
    w = blocks[:, fmt.block_bytes - QK // 2:].view("<u2")      # byte pairs: 2i | 2i + 1 << 8
    qs = np.empty((len(blocks), QK // 2), np.uint8)
    qs[:, :QK // 4] = (w & 0x0F) | ((w >> 4) & 0xF0)             # low nibbles of 2i, 2i + 1
    qs[:, QK // 4:] = ((w >> 4) & 0x0F) | ((w >> 8) & 0xF0)      # their high nibbles
    d = blocks[:, 0:2].copy().view(np.float16).reshape(rows, cols // QK)
    if fmt.name == "Q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).reshape(rows, cols // QK)
    else:
        m32 = -8 * d.astype(np.float32)
        m = m32.astype(np.float16)
        if not np.array_equal(m.astype(np.float32), m32, equal_nan=True):
            raise ValueError(f"{fmt.name} scales outside f16's range")   # |d| > 65504 / 8
    return {"fmt": fmt.name, "qs": qs.reshape(rows, cols // 2), "d": d, "m": m}


def _pack(nib: np.ndarray) -> np.ndarray:
    """codes' nibbles [rows, nb, 32] -> bytes [rows, nb, 16], sequential order."""
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def _pack_high(hi: np.ndarray, bits: int) -> np.ndarray:
    """The codes' bits above the low nibble [rows, nb, 32] -> qh bytes [rows, nb, hb]."""
    if bits == 8:
        return _pack(hi)
    lanes = hi[..., LANES].astype(np.uint32)                        # [rows, nb, 32] lane order
    weights = np.uint32(1) << np.arange(32, dtype=np.uint32)
    words = [((lanes >> k) & 1) @ weights for k in range(bits - 4)]  # u32 per bit, per block
    return np.stack(words, axis=-1).astype("<u4").view(np.uint8)


def repack_q4_1(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """GGUF Q4_1 bytes [rows, cols/32*20] -> {"qs": [rows, cols/2] u8, "d", "m": [rows, cols/32] f16}."""
    p = planar("Q4_1", raw, rows, cols)
    return {"qs": p["qs"], "d": p["d"], "m": p["m"]}


def repack_q8_0(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """GGUF Q8_0 bytes [rows, cols/32*34] -> {"qs": [rows, cols] i8, "d": [rows, cols/32] f16}
    (the natural-order table layout of the token embedding)."""
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


def codes(fmt_name: str, qs: np.ndarray, qh: np.ndarray | None = None) -> np.ndarray:
    """Planar codes (qs [rows, K/2] and, for codes wider than 4 bits, qh) -> q u8 [rows, K]."""
    fmt = FORMATS[fmt_name]
    rows = qs.shape[0]
    q = unpack_nibbles(qs).reshape(rows, -1, QK)
    if fmt.bits == 8:
        q |= unpack_nibbles(qh.reshape(rows, -1, 16)) << 4
    elif fmt.hb:
        words = np.ascontiguousarray(qh).view("<u4").reshape(rows, -1, fmt.bits - 4)
        hi = np.zeros(q.shape, np.uint8)
        lanes = np.arange(32, dtype=np.uint32)
        for k in range(fmt.bits - 4):
            hi[..., LANES] |= (((words[..., k:k + 1] >> lanes) & 1) << k).astype(np.uint8)
        q |= hi << 4
    return q.reshape(rows, -1)


def dequant(fmt_name: str, qs: np.ndarray, dm: np.ndarray, qh: np.ndarray | None = None) -> np.ndarray:
    """Planar matrix of any "wq" format -> f32 [rows, K] (works on any subset of rows); dm
    [rows, K/g, 2] (a Q4_0 / Q4_1 dict's d and m stacked)."""
    g = FORMATS[fmt_name].group
    q = codes(fmt_name, qs, qh)
    rows = q.shape[0]
    dm = dm.reshape(rows, -1, 2).astype(np.float32)
    w = q.reshape(rows, -1, g).astype(np.float32) * dm[:, :, 0:1] + dm[:, :, 1:2]
    return w.reshape(rows, -1)


def dequant_planar(p: dict) -> np.ndarray:
    """planar()'s dict -> f32 [rows, K]."""
    if "d" in p:
        return dequant_q4_1(p["qs"], p["d"], p["m"])
    return dequant(p["fmt"], p["qs"], p["dm"], p.get("qh"))


def dequant_q4_1(qs: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Planar Q4_1 (or Q4_0) -> f32 [M, K]."""
    return dequant("Q4_1", qs, np.stack([d, m], axis=-1))


def dequant_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Natural-order Q8_0 table -> f32 [V, D] (works on any subset of rows)."""
    rows = qs.shape[0]
    w = qs.reshape(rows, -1, QK).astype(np.float32) * d.astype(np.float32)[:, :, None]
    return w.reshape(rows, -1)


def float_matrix(type_name: str, raw: np.ndarray, rows: int, cols: int) -> dict:
    """An F32 / F16 / BF16 matrix as it is in the file: {"fmt", "w": [rows, cols]}."""
    raw = np.ascontiguousarray(raw)
    dtype = FLOAT_TYPES[type_name]
    w = raw.view(dtype) if raw.dtype == np.uint8 else raw.astype(dtype)   # gguf gives BF16 as bytes
    return {"fmt": type_name, "w": w.reshape(rows, cols).copy()}          # a copy: off the mmap


def dequant_float(type_name: str, w: np.ndarray) -> np.ndarray:
    if type_name == "BF16":
        return (w.astype(np.uint32) << 16).view(np.float32)
    return w.astype(np.float32)
