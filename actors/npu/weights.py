"""The weights of an NPU graph: Parameters over the pool's arena (or, for the compressed-
FullyConnected pattern, Constants sharing its bytes), dequantized inside the graph, one method per
weight format (models/quant.py). A mixin of Graph (npu/graph.py), whose view, params, inputs,
const_weights and B it uses.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from socllm.models.quant import FORMATS, QK, codes

F32 = np.float32


def f32(x) -> ov.Node:
    return ops.constant(np.asarray(x, F32))


class Weights:
    """Weights enter the graph as inputs over the arena, not as Constants: OpenVINO then keeps no
    copy of them (measured: a compiled model repacks its Constants, ~2.4 bytes per Q4_1 weight,
    per bucket), and segments that differ only in which layer's weights they read (every layer
    of a hetero prefill) share one compiled graph. The lm-head table is the exception (w8_const)."""

    def weight(self, name, view: np.ndarray, ov_type=None, shape=None) -> ov.Node:
        if ov_type is None:
            p = ops.parameter(list(view.shape), view.dtype, name=name)
            tensor = ov.Tensor(view, shared_memory=True)
        else:
            p = ops.parameter(shape, ov_type, name=name)
            tensor = ov.Tensor(view, shape, ov_type)      # shares the arena bytes (u4 packed)
        self.params.append(p)
        self.inputs.append(tensor)
        return p

    def wf(self, ref, D: int) -> ov.Node:
        return self.weight(f"wf{ref[1]}", self.view(ref[1], (D,), F32))

    def w4(self, ref, M: int, K: int) -> ov.Node:
        """Q4_1 [M, K]: w = d*q + m per 32-block, dequantized inside the graph (W4A16)."""
        if self.const_weights:
            return self.w4_const(ref, M, K)
        _, qs, d, m = ref
        nb = K // QK
        q = self.weight(f"q{qs}", self.view(qs, (M * K // 2,), np.uint8), ov.Type.u4, [M, nb, QK])
        dd = ops.convert(self.weight(f"d{d}", self.view(d, (M, nb, 1), np.float16)), F32)
        mm = ops.convert(self.weight(f"m{m}", self.view(m, (M, nb, 1), np.float16)), F32)
        w = ops.add(ops.multiply(ops.convert(q, F32), dd), mm)
        return ops.reshape(w, np.array([M, K], np.int64), False)

    def w4_const(self, ref, M: int, K: int) -> ov.Node:
        """Q4_1 [M, K] as Constants over the arena in the pattern the CPU plugin runs as a
        compressed FullyConnected: u4 -> Convert -> Subtract(zp) -> Multiply(d) -> Reshape,
        w = d*q + m = (q - zp)*d. The plugin keeps its own ~1 byte/weight copy per compiled graph,
        but runs a one-row step 3-4x faster than dequantizing inputs in the graph (measured)."""
        _, qs, d, m = ref
        nb = K // QK
        q = self._codes_const(qs, M, K)
        d32 = self.view(d, (M, nb, 1), np.float16).astype(F32)
        m32 = self.view(m, (M, nb, 1), np.float16).astype(F32)
        # d == 0 (w = m for the whole block): a tiny scale and a zero point of -+2^15 give
        # w = m * (1 + q/2^15), within 5e-4 of m.
        scale = np.where(d32 != 0, d32, np.abs(m32) * F32(2.0 ** -15))
        zp = np.divide(-m32, scale, out=np.zeros_like(m32), where=scale != 0)
        w = ops.multiply(ops.subtract(ops.convert(q, F32), f32(zp)), f32(scale))
        return ops.reshape(w, np.array([M, K], np.int64), False)

    def linear(self, x: ov.Node, ref, M: int, K: int) -> ov.Node:
        """x [B, K] times the weight [M, K] transposed -> [B, M]. Where the graph quantizes its
        activations (split_min: the compile config's DYNAMIC_QUANTIZATION_GROUP_SIZE), a Q4_1
        constant weight is split as w = (q - 8) d + (m + 8 d): a compressed FullyConnected with an
        integer zero point, which the CPU plugin runs on int8 activations, and the exact f32
        product of x's 32-column group sums with each group's offset (m + 8 d) [M, K/32]."""
        if not (self.split_min and self.const_weights and ref[0] == "w4"):
            return ops.matmul(x, self.matrix(ref, M, K), False, True)
        _, qs, d, m = ref
        nb = K // QK
        q = self._codes_const(qs, M, K)
        d32 = self.view(d, (M, nb, 1), np.float16).astype(F32)
        off = self.view(m, (M, nb), np.float16).astype(F32) + 8 * d32[:, :, 0]
        zp = ops.constant(np.array(8, np.uint8))
        w = ops.multiply(ops.subtract(ops.convert(q, F32), ops.convert(zp, F32)), f32(d32))
        y = ops.matmul(x, ops.reshape(w, np.array([M, K], np.int64), False), False, True)
        sums = ops.reduce_sum(ops.reshape(x, np.array([-1, nb, QK], np.int64), False),
                              np.array([2], np.int64), False)                  # [B, K/32]
        return ops.add(y, ops.matmul(sums, f32(off), False, True))

    def _codes_const(self, qs: int, M: int, K: int) -> ov.Node:
        """A Q4_1 weight's u4 codes [M, K/32, 32] as a Constant sharing the arena's bytes."""
        view = self.view(qs, (M * K // 2,), np.uint8)
        return ov.op.Constant(ov.Tensor(view, [M, K // QK, QK], ov.Type.u4), shared_memory=True)

    def matrix(self, ref, M: int, K: int) -> ov.Node:
        """A weight [M, K] of any block format: Q4_1 / Q4_0 as w4; the others (models/quant.py)
        w = d * (lo + 16 hi) + m per group, as graph inputs over the arena (wq_rows), or,
        const_weights, as Constants in the compressed-FullyConnected pattern: u8 codes ->
        Convert -> Subtract(zp) -> Multiply(d)."""
        if ref[0] == "w4":
            return self.w4(ref, M, K)
        if ref[0] == "wt":
            return self.wt_rows(ref, M, K, None)
        if ref[0] != "wq":
            raise ValueError(f"the NPU graphs do not read {ref[0]} weights")
        if not self.const_weights:
            return self.wq_rows(ref, M, K, None)
        _, fmt, qs, dm, qh = ref
        f = FORMATS[fmt]
        g = f.group
        qh_view = self.view(qh, (M, K // QK * f.hb), np.uint8) if f.hb else None
        q = codes(fmt, self.view(qs, (M, K // 2), np.uint8), qh_view)   # the plugin copies them anyway
        pairs = self.view(dm, (M, K // g, 2), np.float16 if f.scale == "f16" else F32).astype(F32)
        d32, m32 = pairs[:, :, 0:1], pairs[:, :, 1:2]
        scale = np.where(d32 != 0, d32, np.abs(m32) * F32(2.0 ** -15))       # as w4_const
        zp = np.divide(-m32, scale, out=np.zeros_like(m32), where=scale != 0)
        w = ops.multiply(ops.subtract(ops.convert(ops.constant(q.reshape(M, K // g, g)), F32),
                                      f32(zp)), f32(scale))
        return ops.reshape(w, np.array([M, K], np.int64), False)

    def wt_rows(self, ref, M: int, K: int, ids) -> ov.Node:
        """A float weight [M, K] (F32, F16, BF16 as in the file) as a graph input over the arena;
        ids [B]: only those rows -> [B, K] f32."""
        _, kind, off = ref
        if kind == "BF16":
            w = self.weight(f"t{off}", self.view(off, (M * K,), np.uint16), ov.Type.bf16, [M, K])
        else:
            w = self.weight(f"t{off}", self.view(off, (M, K), np.float16 if kind == "F16" else F32))
        if ids is not None:
            w = ops.gather(w, ids, 0)
        return ops.convert(w, F32)

    def wq_rows(self, ref, M: int, K: int, ids) -> ov.Node:
        """A block-format weight [M, K] as graph inputs over the arena, dequantized in the graph;
        ids [B]: only those rows (an embedding's gather before the dequantization) -> [B, K]."""
        _, fmt, qs, dm, qh = ref
        f = FORMATS[fmt]
        nb, g, words = K // QK, f.group, max(0, f.bits - 4)
        parts = [self.weight(f"q{qs}", self.view(qs, (M * K // 2,), np.uint8), ov.Type.u4, [M, nb, QK]),
                 self.weight(f"d{dm}", self.view(dm, (M, K // g, 2), np.float16 if f.scale == "f16" else F32))]
        if f.bits == 8:            # the high nibbles, sequential like the low ones
            parts.append(self.weight(f"h{qh}", self.view(qh, (M * K // 2,), np.uint8), ov.Type.u4, [M, nb, QK]))
        elif f.hb:                 # one u32 of bits per block and bit, lane j's at bit j
            parts.append(self.weight(f"h{qh}", self.view(qh, (M, nb, words, 4), np.uint8)))
        rows = M
        if ids is not None:
            parts, rows = [ops.gather(p, ids, 0) for p in parts], self.B
        q, pairs = ops.convert(parts[0], F32), ops.convert(parts[1], F32)
        if f.bits == 8:
            q = ops.add(q, ops.multiply(ops.convert(parts[2], F32), f32(16.0)))
        elif f.hb:
            lanes = ops.convert(ops.reshape(ops.gather(_high_table(words), _high_index(parts[2], words), 0),
                                            np.array([rows, nb, QK], np.int64), False), F32)  # [rows, nb, 32]
            high = ops.transpose(ops.reshape(lanes, np.array([rows, nb, 2, 16], np.int64), False),
                                 np.array([0, 1, 3, 2], np.int64))             # lane -> weight order
            q = ops.add(q, ops.multiply(ops.reshape(high, np.array([rows, nb, QK], np.int64), False), f32(16.0)))
        q = ops.reshape(q, np.array([rows, K // g, g], np.int64), False)
        dd = ops.gather(pairs, np.array([0], np.int64), 2)
        mm = ops.gather(pairs, np.array([1], np.int64), 2)
        return ops.reshape(ops.add(ops.multiply(q, dd), mm), np.array([rows, K], np.int64), False)

    def w8_rows(self, ref, V: int, D: int):
        """Q8_0 [V, D] as inputs (qs i8 [V, D/32, 32], d f16 [V, D/32, 1]), for row gathers."""
        _, qs, d = ref
        return (self.weight(f"q{qs}", self.view(qs, (V, D // QK, QK), np.int8)),
                self.weight(f"d{d}", self.view(d, (V, D // QK, 1), np.float16)))

    def w8_const(self, ref, V: int, D: int):
        """Q8_0 [V, D] as Constants over the arena: the lm-head multiplies the whole table each
        step, and only the compressed-FullyConnected pattern keeps that from materialising a
        float table per run (so this one weight is copied into its compiled graph, ~65 MB)."""
        _, qs, d = ref
        q = ov.op.Constant(ov.Tensor(self.view(qs, (V, D // QK, QK), np.int8)), shared_memory=True)
        s = ov.op.Constant(ov.Tensor(self.view(d, (V, D // QK, 1), np.float16)), shared_memory=True)
        return q, s


def _high_table(words: int) -> ov.Node:
    """The codes' high bits of 8 lanes from one byte of each bit's u32 (words 1: byte b; 2: b +
    256 * b', bit 4's byte and bit 5's) -> u8 [256 ** words, 8], lane i's high bits (0 .. 3).
    A Gather of this table replaces per-weight shifts and ands: the CPU plugin's integer bitwise
    ops are slow (measured, a Q6_K [640, 2048] one-row linear: 54 ms with shifts, 3.6 ms so)."""
    byte = np.arange(256 ** words)
    lane_bits = sum(((byte >> (8 * w))[:, None] >> np.arange(8) & 1) << w for w in range(words))
    return ops.constant(lane_bits.astype(np.uint8))


def _high_index(qh: ov.Node, words: int) -> ov.Node:
    """qh u8 [rows, nb, words, 4] -> the table's row per 8 lanes, i32 [rows, nb, 4]
    ([rows, nb, 1, 4] for one word: the reshape after the Gather is the same)."""
    idx = ops.convert(qh, np.int32)
    if words == 1:
        return idx
    w0, w1 = ops.split(idx, np.int64(2), 2).outputs()                     # [rows, nb, 1, 4] each
    return ops.add(w0, ops.multiply(w1, np.int32(256)))
