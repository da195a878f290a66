"""Shape inference of the op set (the semantics are actors/cpu/kernels.py).

Each rule checks its inputs' shapes symbolically and gives the output shape; outputs that the
builder declared beforehand (KV caches, io) are checked against it instead.
"""
from __future__ import annotations

import numpy as np

from .ir import Graph, Op, sym


def _shape(g: Graph, name):
    return g.tensors[name].shape


def _expect(cond, op: Op, what: str):
    if not cond:
        raise ValueError(f"{op.kind} (layer {op.layer}): {what}")


def _eq(a, b) -> bool:
    return sym(a) == sym(b)


def _rows(g, op, name):
    return _shape(g, op.inputs[name])[0]


RULES = {
    # op: (inputs, attrs) -> output shape
    "embed": lambda g, op: (_shape(g, op.inputs["ids"])[0], op.attrs["D"]),
    "rmsnorm": lambda g, op: _shape(g, op.inputs["x"]),
    "linear": lambda g, op: (_rows(g, op, "x"), op.attrs["M"]),
    "rope": lambda g, op: _shape(g, op.inputs["x"]),
    "attention": lambda g, op: (_rows(g, op, "q"), op.attrs["cols"]) if "part" in op.attrs
                               else _shape(g, op.inputs["q"]),
    # HCMP (graph/hcmp.py): an attention's dense and sparse parts' rows -> its output
    "attn_merge": lambda g, op: (_rows(g, op, "a"), op.attrs["heads"] * op.attrs["head_dim"]),
    "silu_mul": lambda g, op: _shape(g, op.inputs["g"]),
    "gelu_mul": lambda g, op: _shape(g, op.inputs["g"]),
    "add": lambda g, op: _shape(g, op.inputs["a"]),
    # MoE (graph/build.py _moe): route [N, 2k+1] = k expert ids (as floats), their weights, and
    # the row's saliency
    "moe_route": lambda g, op: (_rows(g, op, "x"), 2 * op.attrs["k"] + 1),
    "moe_linear": lambda g, op: (_rows(g, op, "x"), op.attrs["M"] * (1 if op.attrs["combine"] else op.attrs["k"])),
    "lm_head": lambda g, op: ((_rows(g, op, "x"), op.attrs["V"]) if op.attrs.get("all_rows")
                              else (op.attrs["V"],)),
}

CHECKS = {
    "linear": lambda g, op: _eq(_shape(g, op.inputs["x"])[1], op.attrs["K"]),
    "rmsnorm": lambda g, op: _eq(_shape(g, op.inputs["x"])[1], op.attrs["D"] * op.attrs.get("heads", 1)),
    "silu_mul": lambda g, op: all(_eq(a, b) for a, b in zip(_shape(g, op.inputs["g"]), _shape(g, op.inputs["u"]))),
    "gelu_mul": lambda g, op: all(_eq(a, b) for a, b in zip(_shape(g, op.inputs["g"]), _shape(g, op.inputs["u"]))),
    "add": lambda g, op: all(_eq(a, b) for a, b in zip(_shape(g, op.inputs["a"]), _shape(g, op.inputs["b"]))),
    "attention": lambda g, op: _eq(_shape(g, op.inputs["q"])[1], op.attrs["heads"] * op.attrs["head_dim"]),
    "moe_route": lambda g, op: _eq(_shape(g, op.inputs["x"])[1], op.attrs["E"])
                 and _eq(_shape(g, op.inputs["sal"])[1], op.attrs["D"]),
    "moe_linear": lambda g, op: _eq(_shape(g, op.inputs["x"])[1],
                                    op.attrs["K"] * (op.attrs["k"] if op.attrs["per_slot"] else 1))
                  and _eq(_shape(g, op.inputs["route"])[1], 2 * op.attrs["k"] + 1),
}


def infer_shapes(g: Graph, op: Op):
    for role, name in op.inputs.items():
        _expect(name in g.tensors, op, f"input {role}={name} is not defined")
    if op.kind in CHECKS:
        _expect(CHECKS[op.kind](g, op), op, "input shapes do not match the op's sizes")
    shape = tuple(RULES[op.kind](g, op))
    (role, name), = op.outputs.items()
    t = g.tensors.get(name)
    if t is None:
        g.tensor(name, shape)
    elif t.kind == "kv":
        # a KV cache is [L_cap, cols]; the op writes its rows P .. P+N
        _expect(_eq(t.shape[1], shape[1]), op, f"{name} has {t.shape[1]} columns, op makes {shape[1]}")
    else:
        _expect(all(_eq(a, b) for a, b in zip(t.shape, shape)), op, f"{name} shape mismatch")


def visible(pos: np.ndarray, L: int, window: int) -> np.ndarray:
    """[len(pos), L]: key l is seen by the row at pos: l <= pos, and pos - l < window if any."""
    dist = np.asarray(pos)[:, None] - np.arange(L)[None, :]
    return (dist >= 0) & (dist < window) if window else dist >= 0
