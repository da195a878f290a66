"""Hetero-core model parallelism (Ghidorah §III-B), a pass over a decode batch's paged graph, like
row_cut (graph/partition.py) and seq_cut (graph/seqcut.py).

A verifying step (speculative decoding: a sequence's drafted rows, policies/drafting.py) has two
kinds of attention work in every head: the dense part, each row against the KV cache, the same
long run of keys for all of a sequence's rows, and the sparse part, each row against the few keys
of the draft tree it descends from (its tree entry, actors/gpu/cl/paged.cl tree_row). HCMP puts
the dense part on the processor with the most parallelism (the GPU) and the sparse part on the
one with the least (the CPU), each with its own softmax (online softmax: a part's outputs
normalized, plus each head's log-sum-exp), then merges them with one rescale on the GPU
(§III-B2). The linears are split by output columns between the two (§III-B1: row_cut over the
weights' rows, each half writing its columns of the same output; no all-reduce), at a share the
caller chooses (policies/hcmp.py profiles it). Kernels never ask whether they are split: a part
is an attention op with attrs part and cols, whose output is a part's row (PARTS).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:              # processor actors import PARTS: not the graph's machinery
    from .ir import Graph
    from .liveness import SlotPlan

PARTS = ("dense", "sparse")      # attrs["part"] of an attention op: its kernels' part 0 and 1
SUFFIX = {"dense": "attd", "sparse": "atts"}       # a part's output: l{i}.attd, l{i}.atts


def part_cols(heads: int, head_dim: int) -> int:
    """A part's row: heads * head_dim outputs, then the heads' log-sum-exps, padded to 8 floats
    (the GPU's kernels read rows as float8)."""
    return heads * head_dim + -(-heads // 8) * 8


def hcmp(g: "Graph", dense: str = "gpu", sparse: str = "cpu", rows_on_sparse: dict | None = None) -> "Graph":
    """A decode batch's paged graph (graph/build.py, all_rows: it has the tree entries, tmask)
    -> every attention op as its dense part on `dense`, its sparse part on `sparse` and their
    merge on `dense`; the linears of rows_on_sparse (part -> rows, partition.row_cut) split, the
    rest of the step on `dense`. Every op carries its processor (attrs["on"])."""
    from .ir import Graph
    from .partition import row_cut
    if "tmask" not in g.tensors:
        raise ValueError("hcmp splits a decode batch's attention (a paged graph with tree entries)")
    g = row_cut(g, rows_on_sparse or {}, dense, sparse)
    out = Graph(dict(g.tensors), [])
    for op in g.ops:
        if op.kind != "attention":
            out.ops.append(op)
            continue
        H, hd = op.attrs["heads"], op.attrs["head_dim"]
        cols, parts = part_cols(H, hd), {}
        for part in PARTS:
            name = f"l{op.layer}.{SUFFIX[part]}"
            out.tensor(name, (g.tensors[op.inputs["q"]].shape[0], cols))
            on = dense if part == "dense" else sparse
            out.ops.append(replace(op, outputs={"out": name},
                                   attrs={**op.attrs, "on": on, "part": part, "cols": cols}))
            parts["a" if part == "dense" else "b"] = name
        out.ops.append(replace(op, kind="attn_merge", inputs=parts,
                               attrs={"heads": H, "head_dim": hd, "cols": cols, "on": dense}))
    return out


def with_part_slots(slots: "SlotPlan", g: "Graph") -> "SlotPlan":
    """The slot plan of graph g (graph/liveness.py) with two more slots, one for every layer's
    dense part and one for every layer's sparse part (a layer's parts die at its merge), so the
    same pool serves the graph and its hcmp pass (memory/layout.py makes a slot's ready word)."""
    from .ir import N, Tensor
    att = next((op for op in g.ops if op.kind == "attention"), None)
    if att is None:
        return slots
    cols = part_cols(att.attrs["heads"], att.attrs["head_dim"])
    size = Tensor("part", (N, cols), "f32", "act").size_expr()
    assign, sizes = dict(slots.assign), list(slots.sizes)
    for part in PARTS:
        sizes.append(size)
        for op in g.ops:
            if op.kind == "attention":
                assign[f"l{op.layer}.{SUFFIX[part]}"] = len(sizes) - 1
    return replace(slots, assign=assign, sizes=sizes)
