"""The plans as passes: which graph a plan compiles for a phase and bucket, and where its ops run
(policies/placement.py, rowcut.py), compiled over the pool by graph/planner.py. No Ray here:
actors/planner.py serves it as the planner actor; scripts and tests use it in process."""
from __future__ import annotations

from socllm.graph.hcmp import hcmp
from socllm.graph.partition import ALIGN, CUTTABLE, DOMINANT, part_of, placed, row_cut
from socllm.graph.planner import Compiler
from socllm.graph.program import StepProgram
from socllm.graph.seqcut import seq_cut
from socllm.policies.arca import KEY_UNITS
from socllm.policies.placement import PAGED_PROGRAMS, PROCESSORS_OF, placement, seq_parts
from socllm.policies.rowcut import plan_rows


class PlannerCore(Compiler):
    def __init__(self, cfg, n_layers: int | None = None, rowcut_profile: dict | None = None):
        super().__init__(cfg, n_layers)
        self.rowcut_profile = rowcut_profile    # policies/rowcut.py; None: its default share

    def hcmp_rows(self, share: float) -> dict:
        """hcmp: linear part -> its output columns (weight rows) on the CPU actor, `share` of each
        cuttable linear's, aligned down (graph/partition.py ALIGN); parts with none left out."""
        rows = {part: int(op.attrs["M"] * share) // ALIGN * ALIGN
                for op in self.graph.ops if (part := part_of(op)) in CUTTABLE}
        return {p: r for p, r in rows.items() if r}

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

    def program(self, plan: str, phase: str, bucket: int):
        """A one-shot step's program (graph/build.py, not paged) -> (id, msgpack bytes, its
        processors)."""
        key = (plan, phase, bucket)
        if key in self.programs:
            return self.programs[key]
        graph, place = self.graph, None
        if plan == "tensor":
            graph, place = self.partitioned(phase), placed
        elif plan == "seqcut":          # bucket: the step's rows, cut between NPU and GPU
            if phase != "prefill":
                raise ValueError("seqcut cuts a prefill step's rows")
            graph, place = seq_cut(self.graph, seq_parts(bucket)), placed
        return self.compile(key, graph, place or placement(plan, phase, bucket), phase, bucket)

    def placed_program(self, name: str, place, phase: str, bucket: int) -> StepProgram:
        """A program whose ops go where `place(op)` says (a layer-level placement chosen
        elsewhere: the simulated SoCs' per-op choice), cached under `name`."""
        key = (name, phase, bucket)
        if key not in self.programs:
            self.compile(key, self.graph, place, phase, bucket)
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
        which may stop between layers while other steps run (one processor: gpu or cpu).
          hcmp            a decode batch's attention split GPU (dense) + CPU (sparse), and its
                          linears' columns at the CPU's share bucket / KEY_UNITS (graph/hcmp.py;
                          policies/arca.py chooses the share)"""
        if plan not in PAGED_PROGRAMS:
            raise ValueError(f"paged programs: {', '.join(PAGED_PROGRAMS)}, not {plan!r}")
        static = "npu" in PROCESSORS_OF.get(plan, (plan,))     # the NPU takes part: a bucket of rows
        if static and (buffer or bucket <= 0):
            raise ValueError(f"a {plan} step runs in the first buffer, in a bucket of rows")
        if plan == "seqcut" and all_rows:
            raise ValueError("seqcut cuts a prefill chunk's rows, not a decode batch")
        phase = "batch" if all_rows else "chunk"
        key = (plan, phase, buffer, bucket)
        if key in self.programs:
            return self.programs[key]
        graph, place = self.paged_graph(all_rows), lambda op: plan
        if plan == "tensor":
            graph, place = self.partitioned("decode" if all_rows else "prefill", graph), placed
        elif plan == "seqcut":
            graph, place = seq_cut(graph, seq_parts(bucket)), placed
        elif plan == "hcmp":
            if not all_rows:
                raise ValueError("hcmp splits a decode batch, not a prefill chunk")
            graph, place = hcmp(graph, rows_on_sparse=self.hcmp_rows(bucket / KEY_UNITS)), placed
            bucket = 0                  # a share, not a static row count: any N rows, as gpu's
        rows = bucket or (self.pool.double_rows if buffer else self.pool.max_rows)
        return self.compile(key, graph, place, phase, rows, buffer)
