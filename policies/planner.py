"""The planning core: model graph -> slots -> step programs, cached, one per plan/phase/bucket.
No Ray here: actors/planner.py serves it as the planner actor; scripts and tests use it in process."""
from __future__ import annotations

import os

from socllm.graph.build import build_graph
from socllm.graph.liveness import assign_slots
from socllm.graph.lower import lower
from socllm.graph.partition import DOMINANT, part_of, placed, row_cut
from socllm.graph.program import StepProgram
from socllm.graph.seqcut import base_name, seq_cut
from socllm.memory.layout import PROCESSORS, PoolLayout
from socllm.policies.placement import PAGED_PROGRAMS, placement, seq_parts
from socllm.policies.rowcut import plan_rows


class PlannerCore:
    def __init__(self, cfg, n_layers: int | None = None, rowcut_profile: dict | None = None):
        self.cfg, self.n_layers = cfg, n_layers
        self.graph = build_graph(cfg, n_layers)
        self.rowcut_profile = rowcut_profile    # policies/rowcut.py; None: its default share
        self.slots = assign_slots(self.graph)
        self.programs: dict = {}      # (plan, phase, bucket) -> (pid, msgpack bytes)
        self.lay = None

    def pid(self) -> int:
        return os.getpid()

    def slot_bytes(self, max_rows: int) -> list:
        return [self.slots.nbytes(i, max_rows) for i in range(len(self.slots.sizes))]

    def set_layout(self, layout: dict):
        self.lay = PoolLayout.from_dict(layout)

    def set_rowcut_profile(self, profile: dict | None):
        """Before the first tensor program is built (the engine calls it at start)."""
        if any(k[0] == "tensor" for k in self.programs):
            raise RuntimeError("tensor programs are already built with the old profile")
        self.rowcut_profile = profile

    def partitioned(self, phase: str, graph=None):
        """The `tensor` plan's graph (this one's, or `graph`) for a phase: linears row-cut
        between the GPU and the NPU, the rest on the phase's dominant processor
        (graph/partition.py)."""
        graph = self.graph if graph is None else graph
        sizes = {part_of(op): op.attrs["M"] for op in graph.ops if part_of(op)}
        dom = DOMINANT[phase]
        other = "npu" if dom == "gpu" else "gpu"
        return row_cut(graph, plan_rows(phase, sizes, self.rowcut_profile), dom, other)

    def _refs(self, graph, buffer: int = 0) -> dict:
        """buffer 1: activations and the step's rows in the pool's second activation buffer."""
        lay, refs = self.lay, {}
        io, slots = lay.io, lay.slots
        if buffer:
            if not lay.double:
                raise ValueError("this pool has no second activation buffer")
            io, slots = {**lay.io, **lay.double}, lay.double["slots"]
        for name, t in graph.tensors.items():
            base, lo = base_name(name)      # a sequence-cut part's rows: from row lo (graph/seqcut.py)
            if t.kind == "weight":
                refs[name] = lay.weights[name]
            elif t.kind == "kv":
                refs[name] = ("kv", lay.kv[name])
            elif t.kind in ("input", "output"):
                refs[name] = ("a", io[base] + lo * t.nbytes(N=1))
            else:
                refs[name] = ("a", slots[self.slots.assign[base]] + lo * t.nbytes(N=1))
        return refs

    def program(self, plan: str, phase: str, bucket: int):
        key = (plan, phase, bucket)
        if key not in self.programs:
            graph, place = self.graph, None
            if plan == "tensor":
                graph, place = self.partitioned(phase), placed
            elif plan == "seqcut":          # bucket: the step's rows, cut between NPU and GPU
                if phase != "prefill":
                    raise ValueError("seqcut cuts a prefill step's rows")
                graph, place = seq_cut(self.graph, seq_parts(bucket)), placed
            prog = lower(graph, self.slots, self._refs(graph), self.lay.locations,
                         {p: self.lay.done(p) for p in PROCESSORS},
                         place or placement(plan, phase, bucket), phase, bucket)
            self.programs[key] = (len(self.programs) + 1, prog.to_bytes(), sorted(prog.tasks))
        return self.programs[key]

    def placed_program(self, name: str, place, phase: str, bucket: int) -> StepProgram:
        """A program whose ops go where `place(op)` says (a layer-level placement chosen
        elsewhere: the simulated SoCs' per-op choice), cached under `name`."""
        key = (name, phase, bucket)
        if key not in self.programs:
            lay = self.lay
            prog = lower(self.graph, self.slots, self._refs(self.graph), lay.locations,
                         {p: lay.done(p) for p in PROCESSORS}, place, phase, bucket)
            self.programs[key] = (len(self.programs) + 1, prog.to_bytes(), sorted(prog.tasks))
        return StepProgram.from_bytes(self.programs[key][1])

    def paged_program(self, plan: str, all_rows: bool, buffer: int = 0, bucket: int = 0):
        """A serving step's program (graph/build.py, paged): any N rows of any sequences, each at
        its own position over its block table; all_rows: every row's logits (a decode batch),
        else the last row's (a prefill chunk). GPU and CPU kernels take N at run time, so one
        program serves every N. NPU graphs are static: a program the NPU takes part in runs up to
        `bucket` rows, padded to it (Agent.xpu §4.3: prefill on the NPU's static graphs, one KV
        cache). The plans (policies/placement.py PAGED_PLANS), as passes over the paged graph:
          cpu, gpu, npu   every op on that processor
          tensor          every cuttable linear row-cut between the GPU and the NPU
                          (graph/partition.py), the rest on the phase's dominant processor
          seqcut          a chunk's rows cut: the NPU's static parts and a GPU margin
                          (graph/seqcut.py; bucket: the chunk's rows, placement.seq_parts)
        buffer 1: a prefill chunk in the second activation buffer (memory/layout.py double),
        which may stop between layers while other steps run (one processor: gpu or cpu)."""
        if plan not in PAGED_PROGRAMS:
            raise ValueError(f"paged programs: {', '.join(PAGED_PROGRAMS)}, not {plan!r}")
        static = plan != "gpu" and plan != "cpu"      # the NPU takes part: a bucket of rows
        if static and (buffer or bucket <= 0):
            raise ValueError(f"a {plan} step runs in the first buffer, in a bucket of rows")
        if plan == "seqcut" and all_rows:
            raise ValueError("seqcut cuts a prefill chunk's rows, not a decode batch")
        phase = "batch" if all_rows else "chunk"
        key = (plan, phase, buffer, bucket)
        if key not in self.programs:
            lay = self.lay
            graph = build_graph(self.cfg, self.n_layers, paged={
                "block_rows": lay.block_rows, "max_blocks": lay.max_blocks,
                "max_seqs": lay.max_seqs, "all_rows": all_rows})
            place = lambda op: plan
            if plan == "tensor":
                graph, place = self.partitioned("decode" if all_rows else "prefill", graph), placed
            elif plan == "seqcut":
                graph, place = seq_cut(graph, seq_parts(bucket)), placed
            prog = lower(graph, self.slots, self._refs(graph, buffer), lay.locations,
                         {p: lay.done(p) for p in PROCESSORS}, place, phase,
                         bucket or (lay.double_rows if buffer else lay.max_rows))
            prog.buffer = buffer
            self.programs[key] = (len(self.programs) + 1, prog.to_bytes(), sorted(prog.tasks))
        return self.programs[key]
