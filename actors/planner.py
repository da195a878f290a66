"""The planner actor: model graph -> slots -> step programs, cached, one per plan/phase/bucket."""
from __future__ import annotations

import os

import ray

from socllm.graph.build import build_graph
from socllm.graph.liveness import assign_slots
from socllm.graph.lower import lower
from socllm.memory.layout import PROCESSORS, PoolLayout
from socllm.policies.placement import placement


class PlannerCore:
    def __init__(self, cfg, n_layers: int | None = None):
        self.graph = build_graph(cfg, n_layers)
        self.slots = assign_slots(self.graph)
        self.programs: dict = {}      # (plan, phase, bucket) -> (pid, msgpack bytes)
        self.lay = None

    def pid(self) -> int:
        return os.getpid()

    def slot_bytes(self, max_rows: int) -> list:
        return [self.slots.nbytes(i, max_rows) for i in range(len(self.slots.sizes))]

    def set_layout(self, layout: dict):
        self.lay = PoolLayout.from_dict(layout)

    def _refs(self) -> dict:
        lay, refs = self.lay, {}
        for name, t in self.graph.tensors.items():
            if t.kind == "weight":
                refs[name] = lay.weights[name]
            elif t.kind == "kv":
                refs[name] = ("kv", lay.kv[name])
            elif t.kind in ("input", "output"):
                refs[name] = ("a", lay.io[name])
            else:
                refs[name] = ("a", lay.slots[self.slots.assign[name]])
        return refs

    def program(self, plan: str, phase: str, bucket: int):
        key = (plan, phase, bucket)
        if key not in self.programs:
            prog = lower(self.graph, self.slots, self._refs(), self.lay.locations,
                         {p: self.lay.done(p) for p in PROCESSORS}, placement(plan, phase, bucket), phase, bucket)
            self.programs[key] = (len(self.programs) + 1, prog.to_bytes(), sorted(prog.tasks))
        return self.programs[key]


@ray.remote(num_cpus=0)
class Planner(PlannerCore):
    pass
