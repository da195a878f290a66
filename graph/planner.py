"""Compilation: a model graph -> step programs over the pool's offsets (graph/lower.py), cached,
one per plan, phase and bucket (DESIGN.md §3, "Step programs").

The pool's layout comes in as plain data (PoolMap, from memory/layout.py PoolLayout.to_dict()),
and where each op runs as a function chosen by the caller (policies/planner.py): graph/ imports
neither memory/ nor policies/.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .build import build_graph
from .hcmp import with_part_slots
from .ir import Graph
from .liveness import assign_slots
from .lower import lower
from .seqcut import base_name


@dataclass(frozen=True)
class PoolMap:
    """What compilation reads of the pool's layout (memory/layout.py PoolLayout): offsets are
    bytes from the arena's start."""
    weights: dict       # name -> ref tuple ("w4", qs, d, m) etc. (graph/program.py)
    kv: dict            # "kcache.3" -> offset
    slots: list         # slot id -> offset
    io: dict            # "ids" | "logits" | "pos" | ... -> offset
    double: dict        # the second activation buffer: "slots" -> [offset], io name -> offset
    locations: dict     # location key -> its ready word
    done_words: dict    # processor -> its done word
    max_rows: int       # rows of a step in the first activation buffer
    double_rows: int    # rows of a step in the second (0: none)
    block_rows: int     # paged KV: rows of a block
    max_blocks: int     # a block table's length
    max_seqs: int       # sequences a serving step may hold

    @classmethod
    def of(cls, layout: dict) -> "PoolMap":
        """From a PoolLayout's to_dict() (its other fields are not read)."""
        d = {f.name: layout[f.name] for f in fields(cls)}
        d["weights"] = {k: tuple(v) for k, v in d["weights"].items()}
        return cls(**d)


class Compiler:
    """The model's graph and activation slots, and the step programs compiled from them over one
    pool (set_layout), each under a key: programs[key] = (id, msgpack bytes, its processors)."""

    def __init__(self, cfg, n_layers: int | None = None):
        self.cfg, self.n_layers = cfg, n_layers
        self.graph = build_graph(cfg, n_layers)
        self.slots = with_part_slots(assign_slots(self.graph), self.graph)   # + hcmp's parts
        self.programs: dict = {}
        self.pool: PoolMap | None = None

    def pid(self) -> int:
        return os.getpid()

    def slot_bytes(self, max_rows: int) -> list:
        return [self.slots.nbytes(i, max_rows) for i in range(len(self.slots.sizes))]

    def set_layout(self, layout: dict):
        """layout: memory/layout.py PoolLayout.to_dict()."""
        self.pool = PoolMap.of(layout)

    def paged_graph(self, all_rows: bool) -> Graph:
        """The serving step's graph (graph/build.py, paged) over this pool's block tables."""
        pool = self.pool
        return build_graph(self.cfg, self.n_layers, paged={
            "block_rows": pool.block_rows, "max_blocks": pool.max_blocks,
            "max_seqs": pool.max_seqs, "all_rows": all_rows})

    def refs(self, graph: Graph, buffer: int = 0) -> dict:
        """Each tensor's place in the pool; buffer 1: activations and the step's rows in the
        pool's second activation buffer."""
        pool, refs = self.pool, {}
        io, slots = pool.io, pool.slots
        if buffer:
            if not pool.double:
                raise ValueError("this pool has no second activation buffer")
            io, slots = {**pool.io, **pool.double}, pool.double["slots"]
        for name, t in graph.tensors.items():
            base, lo = base_name(name)      # a sequence-cut part's rows: from row lo (graph/seqcut.py)
            if t.kind == "weight":
                refs[name] = pool.weights[name]
            elif t.kind == "kv":
                refs[name] = ("kv", pool.kv[name])
            elif t.kind in ("input", "output"):
                refs[name] = ("a", io[base] + lo * t.nbytes(N=1))
            else:
                refs[name] = ("a", slots[self.slots.assign[base]] + lo * t.nbytes(N=1))
        return refs

    def compile(self, key, graph: Graph, place, phase: str, bucket: int, buffer: int = 0):
        """graph lowered with place(op) -> processor, for `bucket` rows in activation buffer
        `buffer`, kept under key -> (id, msgpack bytes, its processors)."""
        prog = lower(graph, self.slots, self.refs(graph, buffer), self.pool.locations,
                     self.pool.done_words, place, phase, bucket)
        prog.buffer = buffer
        self.programs[key] = (len(self.programs) + 1, prog.to_bytes(), sorted(prog.tasks))
        return self.programs[key]
