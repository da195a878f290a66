"""NPU processor backend: OpenVINO graphs compiled ahead of time under NPU rules (DESIGN.md §1).

Consecutive tasks with no synchronization between them are fused into one static-shape graph (a
segment) per shape bucket; a segment's inputs and outputs are OpenVINO tensors over the pool.
Compile times are recorded; compiled blobs are cached on disk (OpenVINO's CACHE_DIR).
"""
from __future__ import annotations

import functools
import os
import time

from socllm.graph.program import StepProgram, segment_live_out
from socllm.graph.seqcut import part_rows
from socllm.policies.buckets import NPU_DQ_GROUP, const_weights, npu_prefill_act, whole_graph

from socllm.actors.npu.experts import GroupedExperts, moe_ffn_runs, moe_plan
from socllm.actors.worker import Unit

PREFILL_PHASES = ("prefill", "chunk")     # one-shot prefill, a serving chunk (actors/planner.py)

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "socllm", "openvino")


def segments(tasks: list, per_layer: bool = True) -> list:
    """Split a task list where the NPU must stop: before a task that waits, after one that
    signals, at layer boundaries, and around each attention. Per-layer segments have the same
    structure in every layer, so one compiled graph per bucket serves all layers (weights are
    graph inputs, npu/segment.py), and the weights dequantized inside a graph are one layer's, not
    the model's. The attention alone in its segment is the only graph compiled per KV-length
    bucket (npu/segment.py): the weight-bearing graphs are compiled once, whatever pos0."""
    segs, cur = [], []
    for i, t in enumerate(tasks):
        layer_break = per_layer and t.layer != cur[-1].layer if cur else False
        # a sequence-cut part's rows are a graph of their own (graph/seqcut.py)
        layer_break = layer_break or bool(cur) and t.args.get("seq_lo") != cur[-1].args.get("seq_lo")
        att_break = cur and (t.op == "attention" or cur[-1].op == "attention")
        # the final norm + lm-head: the one-row tail every bucket shares (ov_segment last_row)
        tail = t.op == "lm_head" and cur[-1].op != "rmsnorm" or \
            t.op == "rmsnorm" and i + 1 < len(tasks) and tasks[i + 1].op == "lm_head"
        if cur and (t.waits or layer_break or att_break or tail):
            segs.append(cur)
            cur = []
        cur.append(t)
        if t.signals:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    return segs


class NPUBackend:
    name = "npu"

    def __init__(self, arena_buf, lay, threads: int, config=None):
        """config: the engine's (policies/config.py: whole_graph); None: the environment's."""
        import openvino as ov

        from socllm.policies.config import EngineConfig
        from socllm.actors.npu.segment import pick_device
        self.core = ov.Core()
        self.device = pick_device(self.core)
        self.caps = set(self.core.get_property(self.device, "OPTIMIZATION_CAPABILITIES"))
        if "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in self.core.get_property(self.device, "SUPPORTED_PROPERTIES"):
            self.caps.discard("INT8")      # int8 activations come only from dynamic quantization
        self.prefill_hint = None
        self.arena = arena_buf
        self.kv_rows, self.kv_dtype = lay.kv_rows, lay.kv_dtype
        # a paged step's graphs (a serving prefill chunk): the KV region and the block tables
        self.pool = {"kv_dtype": lay.kv_dtype, "kv_rows": lay.kv_rows, "max_seqs": lay.max_seqs,
                     "block_rows": lay.block_rows}
        self.context_rows = lay.max_blocks * lay.block_rows     # a block table's rows
        self.threads = threads
        # a prompt's first chunk as one whole-model graph (policies/buckets.whole_graph)
        self.whole_graph = (EngineConfig.from_env() if config is None else config).whole_graph
        self.compile_s: dict = {}          # "phase/bucket/precision" -> seconds
        self.shared: dict = {}             # segment signature -> compiled graph (ov_segment)
        self.segments: list = []           # every OVSegment built (lazy KV-length compiles)
        self.config = EngineConfig.from_env() if config is None else config
        self.moe: dict = {}                # bucket -> (MoE plan, its source) (npu/experts.py)
        self.experts: list = []            # every GroupedExperts unit built
        os.makedirs(CACHE_DIR, exist_ok=True)

    def build_units(self, prog: StepProgram, precision: str) -> list:
        t0 = time.perf_counter()
        config = {"INFERENCE_NUM_THREADS": self.threads}
        tasks = prog.tasks.get(self.name, [])
        dense = not any(t.op.startswith("moe") for t in tasks)
        hint = npu_prefill_act(precision, self.caps) if prog.phase in PREFILL_PHASES and dense \
            else "f32"
        if prog.phase in PREFILL_PHASES:
            self.prefill_hint = hint           # the last prefill program's (describe, tests)
        # int8 activations (q8): OpenVINO's dynamic quantization in the whole-model graph, whose
        # constant weights it can take (npu/weights.py linear), f32 elsewhere and in the lm-head
        whole_config = {**config, "DYNAMIC_QUANTIZATION_GROUP_SIZE": NPU_DQ_GROUP} \
            if hint == "i8" else config
        hint = "f32" if hint == "i8" else hint
        paged = any("btab" in t.args for t in tasks)
        if tasks and self.kv_dtype != "f32" and not paged:
            raise ValueError(f"the NPU's contiguous graphs read an f32 KV cache, this pool's is "
                             f"{self.kv_dtype}")
        # row-cut halves (the tensor plan) are one linear per segment: weights as inputs let all
        # layers share one compiled graph per shape instead of compiling each half's constants
        const = const_weights(prog.phase, prog.bucket) and not any(t.rows for t in tasks)
        # constants cannot be shared across layers: a decode graph spans from one attention to
        # the next instead (the attentions, weightless, share one graph per KV-length bucket)
        segs = segments(tasks, per_layer=not const)
        grouped = self._grouped_moe(prog, tasks)
        if grouped:                        # MoE FFNs: units of their own (npu/experts.py)
            segs = [part for seg in segs for part in _cut_moe(seg)]
        tail = segs[-1:] if segs and _is_tail(segs[-1]) else []
        body = segs[:len(segs) - len(tail)]
        seq_cut = any("seq_n" in t.args for t in tasks)
        if grouped:
            units = [self._experts_unit(prog, seg, hint, config, grouped)
                     if moe_ffn_runs(seg) == [0] and len(seg) == 4 else
                     self._unit(prog, seg, hint, config, const) for seg in body]
        elif self.whole_graph and whole_graph(prog.phase, prog.bucket) and len(body) > 1 \
                and _straight(body) and not seq_cut:
            # a prompt's first chunk: the whole model as one graph (policies/buckets.const_weights);
            # the per-layer graphs of later chunks are compiled when one first comes
            whole = self._unit(prog, [t for seg in body for t in seg], hint, whole_config, True,
                               cache=False, whole=True)
            per_layer = functools.cache(lambda: [self._unit(prog, seg, hint, config, const) for seg in body])
            run = _first_chunk(whole.run, per_layer)
            units = [Unit(whole.waits, run, whole.signals, whole.seqs)]
        else:
            units = [self._unit(prog, seg, hint, config, const) for seg in body]
        units += [self._unit(prog, seg, hint, config, const) for seg in tail]
        key = f"{prog.phase}/{prog.bucket}/{precision}"
        self.compile_s[key] = self.compile_s.get(key, 0.0) + time.perf_counter() - t0
        return units

    def _grouped_moe(self, prog: StepProgram, tasks: list):
        """The MoE plan (policies/moe.py) a prefill chunk's MoE FFNs run by, None where they run in
        the segments' graphs (decode steps, config moe_graphs "dense", no MoE)."""
        moe = [t for t in tasks if t.op == "moe_linear"]
        if self.config.moe_graphs == "dense" or prog.phase not in PREFILL_PHASES or not moe \
                or any(t.args["w"][0] != "w4" for t in moe):      # the grouped graphs read Q4
            return None
        if prog.bucket not in self.moe:
            self.moe[prog.bucket] = moe_plan(self.config, tasks, prog.bucket)
        return self.moe[prog.bucket][0]

    def _experts_unit(self, prog, seg, hint, config, plan) -> Unit:
        from socllm.actors.npu.segment import _compile_props
        layer = next(lp for lp in plan.layers if lp.layer == seg[0].layer)
        props = _compile_props(self.core, hint, config)
        unit = GroupedExperts(self.core, self.device, self.arena, seg, layer,
                              plan.overflow, props, self.shared)
        self.experts.append(unit)
        return Unit(seg[0].waits, unit.run, seg[-1].signals, tuple(t.seq for t in seg))

    def _unit(self, prog, seg, hint, config, const, cache=True, whole=False) -> Unit:
        """hint: OpenVINO's inference precision for this segment's graph (npu_prefill_act).
        whole: a prompt's first chunk as one graph, which reads no KV region."""
        from socllm.actors.npu.segment import OVSegment
        seqs = {t.seq for t in seg}
        paged = any("btab" in t.args for t in prog.tasks[self.name])
        if paged and self.kv_dtype == "f32" and not whole and any(t.op == "attention" for t in seg):
            # a bf16 graph converts an f32 KV region it reads whole, at every run (measured: 1.45
            # GB more for a 16-sequence pool, and slower); f16 regions enter as their bytes
            hint = "f32"
        # a whole-model graph is not cached on disk: its blob carries the weights (~105 MB), and
        # importing it costs ~80 MB more than compiling over the pool's weights (measured)
        # a sequence-cut part (graph/seqcut.py) is a static graph of its own rows
        bucket = seg[0].args.get("seq_n", prog.bucket)
        live = segment_live_out(prog, seqs)
        if _decode_batch(prog):      # the rows' final-normed hidden state: the draft heads read it
            live |= {t.args["x"][1] for t in seg if t.op == "lm_head"}
        ov_seg = OVSegment(self.core, [(t.op, t.args) for t in seg], self.arena, bucket,
                           live, self.context_rows if paged else self.kv_rows,
                           hint, config, CACHE_DIR if cache else None,
                           self.shared, last_row=_is_tail(seg), const_weights=const,
                           pool=self.pool if paged else None, per_row=paged and _decode_batch(prog))
        # compile_kv compiles its KV-length buckets ahead of use
        ov_seg.later_chunk = prog.phase in PREFILL_PHASES and not whole and not ov_seg.per_row \
            and "seq_n" not in seg[0].args
        self.segments.append(ov_seg)
        run = ov_seg.run
        if "seq_n" in seg[0].args:
            run = lambda n, pos0, a=seg[0].args: ov_seg.run(*part_rows(a, n, pos0))
        return Unit(seg[0].waits, run, seg[-1].signals, tuple(sorted(seqs)))

    def compile_kv(self, positions: list) -> int:
        """Every later-chunk segment's graph for the KV-length buckets of chunks at `positions`
        (each otherwise compiled by the first chunk that reads one): the runner's warm_npu at
        start, which ran a 128-row chunk at each bucket for it (0.3-0.5 s a run on 2 cores, ~2.7
        s of a hetero service's start). -> graphs compiled (or imported from CACHE_DIR)."""
        return sum(seg.prepare(pos0) for seg in self.segments if seg.later_chunk for pos0 in positions)

    def release(self):
        """Forget every compiled graph (no program uses them any more), and give their memory
        back to the system (glibc keeps freed pages otherwise)."""
        import ctypes
        import gc
        self.shared.clear()
        self.segments.clear()
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):      # not glibc
            pass

    def begin_step(self, precision: str, pos0: int):
        pass

    def finish(self):
        pass

    def describe(self) -> dict:
        return {"processor": "npu", "api": "OpenVINO", "device": self.device,
                "rules": "NPU rules (static shapes, ahead-of-time compiled buckets)"
                + ("" if self.device == "NPU" else f" on OpenVINO's {self.device} device"),
                "threads": self.threads, "whole_graph": self.whole_graph,
                "prefill_precision": self.prefill_hint,
                "compile_s": self.compile_s,
                # KV-length buckets compiled on first use, after install (npu/segment.py)
                "compile_s_all": sum(s.compile_s for s in self.segments),
                "compiled_graphs": len(self.shared),
                **({"moe": self._moe_describe()} if self.moe else {})}

    def _moe_describe(self) -> dict:
        """How prefill chunks run their MoE layers: the plan's source and shape, and what the
        grouped units did so far (rows on the NPU's graphs, on the CPU, pruned; NPU calls)."""
        done = {k: round(sum(u.done[k] for u in self.experts), 1) for k in self.experts[0].done} \
            if self.experts else {}
        plans = {b: {"source": src, "overflow": p.overflow, "group_size": p.group_size,
                     "tiers": p.tiers, "npu_groups": sum(g.processor == "npu" for lp in p.layers for g in lp.groups),
                     "cpu_groups": sum(g.processor != "npu" for lp in p.layers for g in lp.groups)}
                 for b, (p, src) in self.moe.items()}
        return {"graphs": self.config.moe_graphs, "grouped_layers": len(self.experts),
                "plans": plans, **done}


def _cut_moe(seg: list) -> list:
    """A segment split so that each MoE FFN in it (gate, up, product, down) is one of its own."""
    out, lo = [], 0
    for i in moe_ffn_runs(seg):
        out += [seg[lo:i], seg[i:i + 4]]
        lo = i + 4
    return [s for s in out + [seg[lo:]] if s]


def _is_tail(seg) -> bool:
    """The final norm + lm-head (or the lm-head alone): the one-row tail (ov_segment last_row).
    A decode batch's lm-head gives every row's logits: no one-row tail."""
    return [t.op for t in seg] in (["lm_head"], ["rmsnorm", "lm_head"]) and \
        not seg[-1].args.get("all_rows")


def _decode_batch(prog: StepProgram) -> bool:
    """A paged decode batch (graph/build.py all_rows: every row's logits), whichever processor
    runs its lm-head: its rows are of different sequences, each at its own position."""
    return any(t.op == "lm_head" and t.args.get("all_rows") for ts in prog.tasks.values() for t in ts)


def _straight(segs) -> bool:
    """No processor waits or is signalled between these segments: they can be one graph."""
    return not any(seg[0].waits for seg in segs[1:]) and not any(seg[-1].signals for seg in segs[:-1])


def _first_chunk(whole, per_layer):
    """At pos0 = 0 the whole-model graph; later chunks read the KV cache, and per-layer graphs
    (one compiled graph per KV-length bucket for the attention alone) serve them."""
    def run(n, pos0):
        if pos0 == 0:
            whole(n, pos0)
        else:
            for u in per_layer():
                u.run(n, pos0)
    return run
