"""Plans: which processor runs each op, per phase (DESIGN.md §4; HeteroLLM §4.1 layer-level).

  cpu | gpu | npu   every tensor op on that one processor
  hetero            "Hetero-layer" with disaggregated phases (Agent.xpu §4.3): in prefill chunks
                    of HETERO_NPU_FROM rows or more the token-wise ops (norms, projections,
                    rope, FFN, lm-head) run on the NPU in static bucketed chunks and the
                    dynamic-length attention on the GPU; smaller chunks and decode run on the
                    GPU. Both phases share the KV cache in place.
  auto              the control-plane decider (HeteroLLM §4.3): per phase and chunk size, the
                    plan measured fastest on this device (`resolve`: NPU prefill from 256 rows,
                    GPU otherwise); the default.
"""
from __future__ import annotations

PLANS = ("cpu", "gpu", "npu", "hetero", "auto")
CONCRETE = PLANS[:-1]


def placement(plan: str, phase: str, bucket: int | None = None):
    """-> function(op) -> processor name. hetero's prefill splits only chunks of
    HETERO_NPU_FROM rows or more (bucket None: always): below, the NPU's small matmuls and a hop
    per layer cost more than they give (measured below), so the partition is the GPU alone."""
    if plan not in CONCRETE:
        raise ValueError(f"unknown plan {plan!r} (choose from {', '.join(PLANS)})")
    if plan in ("cpu", "gpu", "npu"):
        return lambda op: plan
    if phase == "decode" or (bucket is not None and bucket < HETERO_NPU_FROM):
        return lambda op: "gpu"
    return lambda op: "gpu" if op.kind == "attention" else "npu"


def processors(plan: str, available: set = frozenset()) -> set:
    if plan == "auto":
        return {"gpu", "npu"} & set(available) or {"cpu"}
    return {"hetero": {"gpu", "npu"}}.get(plan, {plan})


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
NPU_PREFILL_FROM = 256   # bucket from which the NPU alone prefills faster than the GPU
HETERO_NPU_FROM = 256    # bucket from which hetero's NPU+GPU split beats the GPU alone


def resolve(plan: str, phase: str, bucket: int, available: set) -> str:
    """A concrete plan for one step: `auto` picks, per phase and chunk bucket, the plan measured
    fastest here; it never picks a plan measured slower than the best single processor."""
    if plan != "auto":
        return plan
    if phase == "prefill" and bucket >= NPU_PREFILL_FROM and "npu" in available:
        return "npu"
    if "gpu" in available:
        return "gpu"
    return "npu" if "npu" in available else "cpu"


def default_plan(available: set) -> str:
    return "auto"
