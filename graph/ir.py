"""The model graph: ops over named tensors whose shapes are sympy expressions
(Transformer-Lite §2.1). N = rows (tokens) of this step, P = tokens already in the KV cache.

Tensor kinds say where a tensor lives once lowered:
  act     an activation: gets a reusable slot (graph/liveness.py)
  weight  a model weight: the pool's read-only weight region
  kv      one layer's K or V cache: the pool's KV region, written in place at rows P..P+N
  input   token ids of the step (the pool's io region)
  output  logits of the step (the pool's io region)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

N, P = sympy.symbols("N P", integer=True, positive=True)


@dataclass
class Tensor:
    name: str
    shape: tuple            # sympy expressions / ints
    dtype: str              # f32 | i32 | q4_1 | q8_0
    kind: str               # act | weight | kv | input | output

    def nbytes(self, **dims) -> int:
        size = {"f32": 4, "i32": 4}[self.dtype]
        n = sympy.Integer(1)
        for s in self.shape:
            n *= s
        return int(sympy.sympify(n * size).subs({N: dims.get("N", 1), P: dims.get("P", 0)}))

    def size_expr(self):
        n = sympy.Integer({"f32": 4, "i32": 4}.get(self.dtype, 1))
        for s in self.shape:
            n *= s
        return n


@dataclass
class Op:
    kind: str                # one of graph.program.OPS
    inputs: dict             # role -> tensor name
    outputs: dict            # role -> tensor name
    attrs: dict = field(default_factory=dict)
    layer: int = -1


@dataclass
class Graph:
    tensors: dict = field(default_factory=dict)   # name -> Tensor
    ops: list = field(default_factory=list)       # [Op] in a valid execution order

    def tensor(self, name, shape, dtype="f32", kind="act") -> str:
        if name in self.tensors:
            raise ValueError(f"tensor {name} defined twice")
        self.tensors[name] = Tensor(name, tuple(shape), dtype, kind)
        return name

    def add(self, kind, inputs, outputs, layer=-1, **attrs) -> Op:
        from .ops import infer_shapes
        op = Op(kind, inputs, outputs, attrs, layer)
        infer_shapes(self, op)
        self.ops.append(op)
        return op
