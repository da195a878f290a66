"""Plans: which processor runs each op, per phase (DESIGN.md §4; HeteroLLM §4.1 layer-level).

  cpu | gpu | npu   every tensor op on that one processor
  hetero            disaggregated phases (Agent.xpu §4.3) with the "Hetero-layer" split
                    (HeteroLLM §4.1) where it pays: prefill chunks of HETERO_NPU_FROM rows or
                    more on the NPU, smaller chunks and decode on the GPU, sharing the KV cache
                    in place. The layer split — token-wise ops (norms, projections, rope, FFN,
                    lm-head) on the NPU, the dynamic-length attention on the GPU — runs for
                    chunks of HETERO_SPLIT_FROM rows or more; on this device it never paid
                    (measured below), so it is off here (None) and runs only when asked for
                    (bucket None: the split whatever the size, as the tests build it).
  tensor            tensor-level (HeteroLLM §4.1, "Hetero-tensor"): every cuttable linear row-cut
                    between the GPU and the NPU (graph/partition.py, rows from policies/rowcut.py),
                    the rest of a layer on the dominant processor — the GPU in decode, the NPU in
                    prefill (§4.2, Figure 11). On this device both processors are the same two
                    cores, so it never pays here (measured below); `auto` does not pick it.
  auto              the control-plane decider (HeteroLLM §4.3): the service times a whole
                    prompt chunk on the GPU and the NPU at start (actors/service.py, NPU_MARGIN).

The one engine runs each plan as paged programs (SERVE_PLANS below, policies/planner.py
paged_program); `placement` is the layer-level placement of the planner's step programs for one
bucket (socllm plan, the simulator, the kernel tests).
"""
from __future__ import annotations

from socllm.models.quant import MATRIX_TYPES

from .buckets import PREFILL_BUCKETS

PLANS = ("cpu", "gpu", "npu", "hetero", "tensor", "seqcut", "hybrid", "hcmp", "auto")

# The weight formats each processor's kernels read (models/quant.py): the layers' matrices, and
# the token embedding / output table. A processor that cannot read every weight of a model is not
# started for it; the CPU actor (numpy, dequantizing one matrix per op) reads them all.
MATRIX_FORMATS = {"cpu": MATRIX_TYPES, "gpu": MATRIX_TYPES, "npu": MATRIX_TYPES}
TABLE_FORMATS = {"cpu": MATRIX_TYPES, "gpu": MATRIX_TYPES, "npu": MATRIX_TYPES}
TABLES = ("token_embd.weight", "output.weight")


def weight_problem(proc: str, types: dict) -> str | None:
    """types: matrix name -> GGUF type name (f32 vectors: every processor reads them). -> why
    `proc` cannot run these matrices, or None."""
    bad: dict = {}
    for name, kind in types.items():
        allowed = TABLE_FORMATS[proc] if name in TABLES else MATRIX_FORMATS[proc]
        if kind not in allowed:
            bad.setdefault(kind, name)
    if not bad:
        return None
    kind, name = next(iter(bad.items()))
    more = f" and {', '.join(list(bad)[1:])}" if len(bad) > 1 else ""
    return f"the {proc} kernels do not read {kind}{more} weights yet (e.g. {name})"
LAYER_LEVEL = ("cpu", "gpu", "npu", "hetero")   # a placement per op; `tensor` is a graph pass


def placement(plan: str, phase: str, bucket: int | None = None):
    """-> function(op) -> processor name, for one phase and chunk bucket (None: any size, and
    hetero's layer split)."""
    if plan not in LAYER_LEVEL:
        raise ValueError(f"unknown plan {plan!r} (layer-level plans: {', '.join(LAYER_LEVEL)})")
    if plan in ("cpu", "gpu", "npu"):
        return lambda op: plan
    if phase == "decode" or (bucket is not None and bucket < HETERO_NPU_FROM):
        return lambda op: "gpu"
    if bucket is None or (HETERO_SPLIT_FROM is not None and bucket >= HETERO_SPLIT_FROM):
        return lambda op: "gpu" if op.kind == "attention" else "npu"
    return lambda op: "npu"


# Measured on the 2-core dev machine (PoCL's OpenCL and OpenVINO both on the CPU;
# `python -m socllm.scripts.measure`, median of 3, tok/s, while other work ran on the machine):
#   before the NPU's KV-length buckets and u4 decode weights:
#     prefill 128: gpu 389, hetero 358, npu 190;  512: hetero 403, gpu 344, npu 202
#     decode 128 after 512: gpu 58, hetero 58 (it decodes on the GPU), npu 11, cpu 1.2
#   after (`--plans gpu,npu` in one run; hetero in the run before):
#     prefill 128: gpu 355, npu 353, hetero 136;  512: npu 436, gpu 309, hetero 237
#     decode after 512: npu 33 (after 128: 37), hetero 71 (the GPU's)
#   The NPU's attention now reads only the KV rows the step needs, so moving it to the GPU
#   (hetero) no longer pays for its synchronisation and for PoCL's threads on the same cores.
#   (The hetero figures of that run were slowed by a predicted sleep, since turned off.)
#   quiet machine, q16, `--plans gpu,npu,hetero,auto`, hetero splitting every chunk:
#     prefill 128: gpu 393, hetero 321, npu 304;  512: hetero 411, npu 407, gpu 360
#     decode after 128 / 512: gpu 99.8 / 82.4, hetero 96.2 / 84.0, npu 40.0 / 34.9
#   hetero with the GPU alone below 256-row chunks (`--decode 16`): prefill 128: gpu 404,
#   hetero 399, npu 392;  512 (plans in the other order, min/median/max): npu 455/464/464,
#   hetero 416/424/425, gpu 360/362/365 — at 512 the GPU's attention and two hops a layer cost
#   hetero 9 % against the NPU alone, whose attention now reads only its KV bucket.
#   The same, median of 3, tok/s: prefill 512: npu 468, hetero (split) 437 (-6.6 %).
#   With the NPU's whole-model first-chunk graph (policies/buckets.whole_graph), the split — a
#   processor hop before and after every layer's attention — also cuts that graph into 61 pieces.
#   On this machine both "processors" are the same two cores, so no split can overlap work.
HETERO_NPU_FROM = 256    # bucket from which hetero prefills on the NPU (below: the GPU alone)
HETERO_SPLIT_FROM = None  # bucket from which hetero splits a layer (attention on the GPU)
#   tensor (row-cut, `--plans gpu,npu,tensor --reps 3`, median): prefill 128: gpu 400, tensor 318;
#   512: npu 597, tensor 374; decode after 128 / 512: gpu 112.7 / 93.0, tensor 14.2 / 13.5. Its
#   halves contend 2-4.7x for the same cores (scripts/profile_rowcut.py), so auto never picks it.


SEQ_MARGIN = 64   # rows the GPU takes beside the NPU's static chunks in a sequence-length cut


def seq_parts(rows: int) -> list:
    """HeteroLLM §4.1.1: a prefill step's rows as [(lo, hi, processor)]: static NPU chunks of the
    prefill buckets, one after the other, and a margin of at most SEQ_MARGIN rows on the GPU at
    the same time. Each NPU chunk is the largest bucket that fits, unless a smaller one leaves a
    margin the GPU takes: 300 -> 256 + 44 (gpu), 600 -> 512 + 32 + 56 (gpu), 256 -> 256."""
    parts, lo = [], 0
    while rows - lo > SEQ_MARGIN:
        fits = [b for b in PREFILL_BUCKETS if b <= rows - lo]
        if not fits:
            break
        take = next((b for b in fits if rows - lo - b <= SEQ_MARGIN), fits[-1])
        parts.append((lo, lo + take, "npu"))
        lo += take
    if lo < rows:
        parts.append((lo, rows, "gpu"))
    return parts












# Serving plans (`socllm serve --plan`, policies/config.py): what each runs a decode batch and a
# prefill chunk on, as paged programs (policies/planner.py paged_program). A chunk the plan's
# program cannot take (the NPU's static graphs: a chunk from a block boundary, at most its bucket;
# a chunk stopped between layers, in the second buffer) runs on the plan's base processor.
PAGED_PROGRAMS = ("cpu", "gpu", "npu", "tensor", "seqcut", "hcmp")
# a program that cuts one step between processors, and the processors it runs on (hcmp: Ghidorah
# §III-B's hetero-core model parallelism of a decode batch, graph/hcmp.py)
PROCESSORS_OF = {"tensor": ("gpu", "npu"), "seqcut": ("gpu", "npu"), "hybrid": ("gpu", "npu"),
                 "hcmp": ("gpu", "cpu")}
# auto prefills on the NPU only where its static graphs ran a whole chunk this much faster than the
# base processor: they cost memory the GPU's kernels do not (the default model, 128-row chunks at
# q16 on the 2-core dev machine: NPU 155 ms against the GPU's 168, for 573 MB more PSS idle, 1172
# against 635 MB; at 512 rows 394 against 700 ms, where it pays)
NPU_MARGIN = 1.25
SERVE_PLANS = {            # plan -> (decode batches, prefill chunks)
    "cpu": ("cpu", "cpu"), "gpu": ("gpu", "gpu"), "npu": ("npu", "npu"),
    "hetero": ("gpu", "npu"),         # disaggregated: prefill on the NPU, decode on the GPU
    "tensor": ("tensor", "tensor"),   # HeteroLLM's tensor level in both phases
    "seqcut": ("gpu", "seqcut"),      # a chunk's rows cut NPU + GPU margin; decode on the GPU
    "hybrid": ("gpu", "hybrid"),      # a chunk padded to an NPU bucket, linears row-cut
    "hcmp": ("hcmp", "gpu"),          # decode batches split GPU + CPU (Ghidorah); prefill: GPU
}
