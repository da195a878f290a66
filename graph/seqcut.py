"""Sequence-length cutting (HeteroLLM §4.1.1): a pass that splits a prefill step's rows between
processors, like row_cut (graph/partition.py) splits a linear's weight rows.

A prompt of 300 rows runs as 256 rows on the NPU's static graph (a prepared bucket) and the
44-row margin on the GPU at the same time; 600 rows as 512 + 32 on the NPU, one after the other,
and 56 on the GPU beside them (multi-sequence-length cutting). Every op of the model runs once
per part, over that part's rows only: a part's activations are its own rows of the same slots
(renamed `name@lo`, so no part waits for another's use of a slot), the tokens it reads are its
rows of the step's ids (and of a paged step's row metadata), and its K/V rows go to their positions in the cache. The only exchange
between parts is causal attention: a later part's queries read the K/V rows the earlier parts
wrote in the same layer, so the lowering orders each layer's K/V writes (graph/lower.py, write
after write) and the later part's attention after them. The final norm and the lm-head (the last
row's logits) run in the last part only. Kernels never ask whether they are cut: a part's tasks
carry `seq_lo` and `seq_n` (the part's first row in the step and its row count), which the
processor actors apply to the step's pos0 and N (part_rows).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:              # the processor actors import part_rows: not sympy (~0.2 s a process)
    from .ir import Graph

SEP = "@"        # a part's activation: name@lo, its rows from lo in the same slot
ROW_INPUTS = ("ids", "pos", "rows", "seq", "tmask")    # a step's per-row inputs (tmask: [N, 4])


def base_name(name: str) -> tuple:
    """name@lo -> (name, lo); a name without a part -> (name, 0)."""
    base, _, lo = name.partition(SEP)
    return base, int(lo) if lo else 0


def seq_cut(g: Graph, parts: list) -> Graph:
    """parts: [(lo, hi, processor)] covering the step's rows 0 .. N in order. Returns a graph
    whose ops run once per part, each carrying its processor (attrs["on"]) and rows."""
    if not parts or parts[0][0] != 0 or any(a[1] != b[0] for a, b in zip(parts, parts[1:])) \
            or any(hi <= lo for lo, hi, _ in parts):
        raise ValueError(f"parts {parts} do not cover the rows in order")
    from .ir import Graph
    last_layer = max(i for i, op in enumerate(g.ops) if op.layer >= 0)
    out = Graph(dict(g.tensors), [])
    for k, (lo, hi, proc) in enumerate(parts):
        def rename(names: dict) -> dict:
            named = {}
            for role, name in names.items():
                t = g.tensors[name]
                if t.kind == "act" or (t.kind == "input" and name in ROW_INPUTS):
                    name = f"{name}{SEP}{lo}"
                    out.tensors.setdefault(name, replace(t, name=name))
                named[role] = name
            return named
        for i, op in enumerate(g.ops):
            if i > last_layer and k < len(parts) - 1:       # the last row's logits: last part
                continue
            out.ops.append(replace(op, inputs=rename(op.inputs), outputs=rename(op.outputs),
                                   attrs={**op.attrs, "on": proc, "seq_lo": lo, "seq_n": hi - lo}))
    return out


def part_rows(args: dict, n: int, pos0: int) -> tuple:
    """(N, pos0) of a task: the step's, or its sequence-cut part's rows of the step (seq_n rows
    from the step's row seq_lo)."""
    if "seq_n" in args:
        return args["seq_n"], pos0 + args["seq_lo"]
    return n, pos0
