"""Plans: which processor runs each op, per phase (DESIGN.md §4; HeteroLLM §4.1 layer-level).

  cpu | gpu | npu   every tensor op on that one processor
  hetero            "Hetero-layer" with disaggregated phases (Agent.xpu §4.3): in prefill the
                    token-wise ops (norms, projections, rope, FFN, lm-head) run on the NPU in
                    static bucketed chunks and the dynamic-length attention on the GPU; decode
                    runs on the GPU. Both phases share the KV cache in place.
  auto              the control-plane decider (HeteroLLM §4.3): per phase and chunk size, the
                    plan measured fastest on this device (`resolve`: NPU prefill from 256 rows,
                    GPU otherwise); the default.
"""
from __future__ import annotations

PLANS = ("cpu", "gpu", "npu", "hetero", "auto")
CONCRETE = PLANS[:-1]


def placement(plan: str, phase: str):
    """-> function(op) -> processor name."""
    if plan not in CONCRETE:
        raise ValueError(f"unknown plan {plan!r} (choose from {', '.join(PLANS)})")
    if plan in ("cpu", "gpu", "npu"):
        return lambda op: plan
    if phase == "decode":
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
NPU_PREFILL_FROM = 256   # bucket from which the NPU alone prefills faster than the GPU


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
