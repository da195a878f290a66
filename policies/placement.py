"""Plans: which processor runs each op, per phase (DESIGN.md §4; HeteroLLM §4.1 layer-level).

  cpu | gpu | npu   every tensor op on that one processor
  hetero            "Hetero-layer" with disaggregated phases (Agent.xpu §4.3): in prefill the
                    token-wise ops (norms, projections, rope, FFN, lm-head) run on the NPU in
                    static bucketed chunks and the dynamic-length attention on the GPU; decode
                    runs on the GPU. Both phases share the KV cache in place.
  auto              the control-plane decider (HeteroLLM §4.3): per phase and chunk size, the
                    plan measured fastest on this device (`resolve`); the default.
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
# `python -m socllm.scripts.measure`, median of 3, tok/s):
#   prefill  128 tokens: gpu 389, hetero 358, npu 190, cpu 106
#            512 tokens: hetero 403, gpu 344, npu 202, cpu 106
#   decode   128 tokens after 512: gpu 58, hetero 58 (it decodes on the GPU), npu 11, cpu 1.2
HETERO_PREFILL_FROM = 256   # bucket from which the NPU+GPU prefill beats the GPU alone


def resolve(plan: str, phase: str, bucket: int, available: set) -> str:
    """A concrete plan for one step: `auto` picks, per phase and chunk bucket, the plan measured
    fastest here; it never picks a plan measured slower than the best single processor."""
    if plan != "auto":
        return plan
    if "gpu" in available:
        if phase == "prefill" and bucket >= HETERO_PREFILL_FROM and "npu" in available:
            return "hetero"
        return "gpu"
    return "npu" if "npu" in available else "cpu"


def default_plan(available: set) -> str:
    return "auto"
