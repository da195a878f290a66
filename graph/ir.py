"""The model graph: ops over named tensors whose shapes are symbolic in N, the rows (tokens) of
this step (Transformer-Lite §2.1).

Tensor kinds say where a tensor lives once lowered:
  act     an activation: gets a reusable slot (graph/liveness.py)
  weight  a model weight: the pool's read-only weight region
  kv      one layer's K or V cache: the pool's KV region, written in place at the step's rows
  input   token ids of the step (the pool's io region)
  output  logits of the step (the pool's io region)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sym:
    """c * N**p: every dimension and size of the graph has this form (a dimension is N or a
    number; a size is their product). A sympy expression did the same work; its import alone
    cost ~0.3 s and ~32 MB in each process that builds a graph (the service's, at every start)."""
    c: int = 1
    p: int = 1

    def __mul__(self, other):
        o = sym(other)
        return Sym(self.c * o.c, self.p + o.p)

    __rmul__ = __mul__

    def __truediv__(self, other):
        """A ratio of sizes: a number when both have the same power of N, else None."""
        o = sym(other)
        return self.c / o.c if self.p == o.p else None

    def __eq__(self, other):
        try:
            o = sym(other)
        except TypeError:
            return NotImplemented
        return (self.c, self.p if self.c else 0) == (o.c, o.p if o.c else 0)

    def __hash__(self):
        return hash((self.c, self.p if self.c else 0))

    def at(self, rows: int) -> int:
        return self.c * rows ** self.p

    def __repr__(self):
        n = "N" if self.p == 1 else f"N**{self.p}"
        return str(self.c) if self.p == 0 else n if self.c == 1 else f"{self.c}*{n}"


def sym(x) -> Sym:
    """A dimension or size as c * N**p (an int: p = 0)."""
    if isinstance(x, Sym):
        return x
    if int(x) != x:
        raise TypeError(f"a dimension must be N or an integer, got {x!r}")
    return Sym(int(x), 0)


N = Sym()


@dataclass
class Tensor:
    name: str
    shape: tuple            # Sym / ints
    dtype: str              # f32 | i32 | q4_1 | q8_0
    kind: str               # act | weight | kv | input | output

    def nbytes(self, N: int = 1) -> int:
        return self.size_expr().at(N)

    def size_expr(self) -> Sym:
        n = Sym({"f32": 4, "i32": 4}.get(self.dtype, 1), 0)
        for s in self.shape:
            n = n * s
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
