"""Liveness and slot assignment: a handful of activation slots serve every layer
(Transformer-Lite §2.1 memory reuse; HeteroLLM §4.2 reusable buffer slots).

Sizes are symbolic (N * 576 * 4 bytes, N * 1536 * 4, ...). A freed slot is reused by a later
tensor whose size is provably no larger (the ratio of the two expressions is a number <= 1);
otherwise a new slot is opened. Slot byte sizes are then fixed for the largest N the pool serves.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import Graph


@dataclass
class SlotPlan:
    assign: dict        # act tensor name -> slot id
    sizes: list         # slot id -> symbolic byte size (largest tensor it holds)

    def nbytes(self, slot: int, max_rows: int) -> int:
        return self.sizes[slot].at(max_rows)


def _fits(size, slot_size) -> bool:
    ratio = size / slot_size
    return ratio is not None and ratio <= 1


def last_uses(g: Graph) -> dict:
    last = {}
    for i, op in enumerate(g.ops):
        for name in op.inputs.values():
            last[name] = i
    return last


def assign_slots(g: Graph) -> SlotPlan:
    last = last_uses(g)
    assign, sizes, free = {}, [], []
    for i, op in enumerate(g.ops):
        for name in op.outputs.values():
            t = g.tensors[name]
            if t.kind != "act" or name in assign:   # written twice: halves of a row-cut
                continue
            size = t.size_expr()
            # the lowest free slot that fits: every layer then gets the same slot pattern (at most
            # two, alternating), so per-layer compiled graphs can be shared across layers
            pick = min((s for s in free if _fits(size, sizes[s])), default=None)
            if pick is None:
                # reuse a free slot that can grow to this size only when nothing fits; else open one
                pick = len(sizes)
                sizes.append(size)
            else:
                free.remove(pick)
            assign[name] = pick
        # free the slots whose tensors die at this op (after its outputs are placed: an op never
        # writes into the slot of its own input)
        for name in set(op.inputs.values()):
            if name in assign and last.get(name) == i:
                free.append(assign[name])
        for name in op.outputs.values():
            if name in assign and name not in last:
                free.append(assign[name])
    return SlotPlan(assign, sizes)
