"""Mixture-of-experts ops in OpenVINO graphs (graph/build.py _moe; semantics: actors/cpu/kernels.py).

Exact routing at static shapes, the simplest way: every row runs through every expert's rows
(the dense model's FLOPs, no gather of weights per row), then each row's k experts are picked
out (gate, up) or scattered in by their weights (down). It is the one-graph baseline NPUMoE §3
starts from; capacity tiers and grouped expert graphs (policies/moe.py) come on top of it.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

F32 = np.float32


def _i64(*v) -> np.ndarray:
    return np.array(v, np.int64)


def _route(g, a):
    """x [B, E] logits, sal [B, D] -> out [B, 2k+1]: k experts (as floats, ties to the lower
    id), their weights, the sal row's L2 norm."""
    E, k = a["E"], a["k"]
    z = g.read(a["x"], E)
    # the top k by logit (models/oracle.route says why), their probabilities from their logits:
    # p_j = exp(z_j - max z) / sum over all E of exp(z - max z)
    top = ov.opset11.topk(z, np.int64(k), 1, "max", "value", ov.Type.i32, stable=True)
    zmax = ops.reduce_max(z, _i64(1), True)
    total = ops.reduce_sum(ops.exp(ops.subtract(z, zmax)), _i64(1), True)
    w = ops.divide(ops.exp(ops.subtract(top.output(0), zmax)), total)
    if a.get("norm", 1):
        s = ops.maximum(ops.reduce_sum(w, _i64(1), True), ops.constant(F32(6.103515625e-5)))
        w = ops.divide(w, s)
    sal = ops.sqrt(ops.reduce_sum(ops.multiply(*[g.read(a["sal"], a["D"])] * 2), _i64(1), True))
    g.write(a["out"], ops.concat([ops.convert(top.output(1), F32), w, sal], 1))


def _slots(g, a):
    """The route's (experts [B, k] i32, weights [B, k])."""
    k = a["k"]
    rt = g.read(a["route"], 2 * k + 1)
    sel = ops.convert(ops.slice(rt, _i64(0), _i64(k), _i64(1), _i64(1)), ov.Type.i32)
    return sel, ops.slice(rt, _i64(k), _i64(2 * k), _i64(1), _i64(1))


def _linear(g, a):
    """moe_linear. Gate / up (x [B, K] shared by the slots): y = x @ W_all.T [B, E*M], each slot's
    expert's M columns gathered -> [B, k*M]. Down (per_slot, combine: x [B, k*K]): each slot's
    input times its weight, scattered to its expert's K columns of a [B, E*K] row (one-hot), then
    one matmul with W's experts side by side [M, E*K] -> [B, M]."""
    B, K, M, E, k = g.B, a["K"], a["M"], a["E"], a["k"]
    sel, w = _slots(g, a)
    W = g.matrix(a["w"], E * M, K)                                           # [E*M, K]
    if not a["per_slot"] and not a["combine"]:
        y = ops.reshape(ops.matmul(g.read(a["x"], K), W, False, True), _i64(B, E, M), False)
        picked = ops.gather(y, sel, 1, 1)                                    # [B, k, M]
        g.write(a["out"], ops.reshape(picked, _i64(B, k * M), False))
        return
    if not (a["per_slot"] and a["combine"]):
        raise ValueError("moe_linear: the NPU graphs take gate/up (shared input, slots out) or "
                         "down (slot inputs, combined)")
    x = ops.multiply(ops.reshape(g.read(a["x"], k * K), _i64(B, k, K), False),
                     ops.unsqueeze(w, _i64(2)))                              # [B, k, K] weighted
    onehot = ops.one_hot(sel, np.int64(E), F32(1), F32(0), -1)              # [B, k, E]
    spread = ops.matmul(onehot, x, True, False)                              # [B, E, K]
    W = ops.reshape(ops.transpose(ops.reshape(W, _i64(E, M, K), False), _i64(1, 0, 2)),
                    _i64(M, E * K), False)                                   # [M, E*K]
    g.write(a["out"], ops.matmul(ops.reshape(spread, _i64(B, E * K), False), W, False, True))


MOE_BUILDERS = {"moe_route": _route, "moe_linear": _linear}
