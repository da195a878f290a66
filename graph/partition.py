"""Tensor-level partitioning (HeteroLLM §4.1): a pass that rewrites a graph, like gpt-fast's tp.py.

row_cut splits a linear's output rows — the rows of its weight, M — between two processors:
rows [0, m) on one, [m, M) on the other. Both halves write their columns of the same output
tensor, straight into the consumer's slot (no merge copy), and the lowering joins them
(graph/lower.py: a reader waits for every half made on another processor). Kernels never ask
whether they are split: a half is lowered to a smaller linear whose weight starts at row lo and
whose output starts at column lo of rows ld = M wide (graph/program.cut_rows).

Which processor runs the rest of the layer decides the ordering (HeteroLLM §4.2, Figure 11):
  decode, GPU-dominant   everything else on the GPU: the GPU enqueues its half, and its next
                         kernel only waits for the NPU's half (queue order covers its own);
  prefill, NPU-dominant  everything else on the NPU: the GPU's half hides inside the NPU's, and
                         the GPU's next kernel waits until the NPU is done with the layer.
Linears that write the KV cache (V) are not cut: they stay whole on the dominant processor.
"""
from __future__ import annotations

from dataclasses import replace

from .ir import Graph, Op

ALIGN = 64                 # rows of a cut are multiples of this (HeteroLLM §4.3 prunes to aligned cuts)
CUTTABLE = ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
DOMINANT = {"decode": "gpu", "prefill": "npu"}


def part_of(op: Op) -> str | None:
    """The weight part a linear reads ("ffn_up", ...), None for other ops."""
    w = op.inputs.get("w", "") if op.kind == "linear" else ""
    return w.split(".")[2] if w.startswith("blk.") else None


def row_cut(g: Graph, rows_on_other: dict, dominant: str, other: str) -> Graph:
    """A new graph whose linears of the parts in `rows_on_other` (part -> rows for `other`, a
    multiple of ALIGN) are cut: the first M - r rows on `dominant`, the last r on `other`. Every
    op of the result carries the processor it runs on (attrs["on"])."""
    for part, r in rows_on_other.items():
        if part not in CUTTABLE:
            raise ValueError(f"cannot row-cut {part!r} (cuttable: {', '.join(CUTTABLE)})")
        if r % ALIGN or r < 0:
            raise ValueError(f"{part}: {r} rows are not a non-negative multiple of {ALIGN}")
    out = Graph(dict(g.tensors), [])
    for op in g.ops:
        r = rows_on_other.get(part_of(op), 0)
        M = op.attrs.get("M", 0)
        if r > M:
            raise ValueError(f"{part_of(op)}: {r} rows on {other}, but the weight has {M}")
        if not r:
            out.ops.append(replace(op, attrs={**op.attrs, "on": dominant}))
        elif r == M:
            out.ops.append(replace(op, attrs={**op.attrs, "on": other}))
        else:
            # the other processor's half first: it is the one the dominant processor will wait for
            out.ops.append(replace(op, attrs={**op.attrs, "on": other, "rows": (M - r, M)}))
            out.ops.append(replace(op, attrs={**op.attrs, "on": dominant, "rows": (0, M - r)}))
    return out


def placed(op: Op) -> str:
    """The processor a partitioned graph put an op on (a placement function for graph/lower)."""
    return op.attrs["on"]
