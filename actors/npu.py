"""NPU processor backend: OpenVINO graphs compiled ahead of time under NPU rules (DESIGN.md §1).

Consecutive tasks with no synchronization between them are fused into one static-shape graph (a
segment) per shape bucket; a segment's inputs and outputs are OpenVINO tensors over the pool.
Compile times are recorded; compiled blobs are cached on disk (OpenVINO's CACHE_DIR).
"""
from __future__ import annotations

import os
import time

from socllm.graph.program import StepProgram, segment_live_out

from socllm.policies.buckets import const_weights

from .worker import Unit

# q8 / q16 (int8 / int16 activations in the GPU's decode GEMVs) have no OpenVINO hint of their own:
# the NPU's graphs stay f32. q8 also turns on OpenVINO's dynamic quantization of FullyConnected
# inputs in groups of 32 (OV GenAI's CPU default); f32 keeps it off so results follow the oracle.
# On this AVX2 CPU without VNNI the plugin keeps its f32 brgemm kernels either way (measured).
OV_HINT = {"q8": "f32", "q16": "f32"}
DYNAMIC_QUANT_GROUP = {"q8": 32}
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "socllm", "openvino")


def segments(tasks: list, per_layer: bool = True) -> list:
    """Split a task list where the NPU must stop: before a task that waits, after one that
    signals, at layer boundaries, and around each attention. Per-layer segments have the same
    structure in every layer, so one compiled graph per bucket serves all layers (weights are
    graph inputs, ov_segment.py), and the weights dequantized inside a graph are one layer's, not
    the model's. The attention alone in its segment is the only graph compiled per KV-length
    bucket (ov_segment.py): the weight-bearing graphs are compiled once, whatever pos0."""
    segs, cur = [], []
    for i, t in enumerate(tasks):
        layer_break = per_layer and t.layer != cur[-1].layer if cur else False
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

    def __init__(self, arena_buf, lay, threads: int):
        import openvino as ov
        from .ov_segment import pick_device
        self.core = ov.Core()
        self.device = pick_device(self.core)
        self.arena = arena_buf
        self.kv_rows = lay.kv_rows
        self.threads = threads
        self.compile_s: dict = {}          # "phase/bucket/precision" -> seconds
        self.shared: dict = {}             # segment signature -> compiled graph (ov_segment)
        self.segments: list = []           # every OVSegment built (lazy KV-length compiles)
        os.makedirs(CACHE_DIR, exist_ok=True)

    def build_units(self, prog: StepProgram, precision: str) -> list:
        from .ov_segment import OVSegment
        units, t0 = [], time.perf_counter()
        const = const_weights(prog.phase, prog.bucket)
        config = {"INFERENCE_NUM_THREADS": self.threads,
                  "DYNAMIC_QUANTIZATION_GROUP_SIZE": DYNAMIC_QUANT_GROUP.get(precision, 0)}
        # constants cannot be shared across layers: a decode graph spans from one attention to
        # the next instead (the attentions, weightless, share one graph per KV-length bucket)
        for seg in segments(prog.tasks.get(self.name, []), per_layer=not const):
            seqs = {t.seq for t in seg}
            ops = [t.op for t in seg]
            ov_seg = OVSegment(self.core, [(t.op, t.args) for t in seg], self.arena, prog.bucket,
                               segment_live_out(prog, seqs), self.kv_rows, OV_HINT.get(precision, precision),
                               config, CACHE_DIR, self.shared,
                               last_row=ops in (["lm_head"], ["rmsnorm", "lm_head"]),
                               const_weights=const)
            self.segments.append(ov_seg)
            units.append(Unit(seg[0].waits, ov_seg.run, seg[-1].signals, tuple(sorted(seqs))))
        key = f"{prog.phase}/{prog.bucket}/{precision}"
        self.compile_s[key] = self.compile_s.get(key, 0.0) + time.perf_counter() - t0
        return units

    def begin_step(self, precision: str):
        pass

    def finish(self):
        pass

    def describe(self) -> dict:
        return {"processor": "npu", "api": "OpenVINO", "device": self.device,
                "rules": "NPU rules (static shapes, ahead-of-time compiled buckets)"
                + ("" if self.device == "NPU" else f" on OpenVINO's {self.device} device"),
                "threads": self.threads, "compile_s": self.compile_s,
                # KV-length buckets compiled on first use, after install (ov_segment.py)
                "compile_s_all": sum(s.compile_s for s in self.segments),
                "compiled_graphs": len(self.shared)}
