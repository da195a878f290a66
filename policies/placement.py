"""Plans: which processor runs each op, per phase (DESIGN.md §4; HeteroLLM §4.1 layer-level).

  cpu | gpu | npu   every tensor op on that one processor
  hetero            "Hetero-layer" with disaggregated phases (Agent.xpu §4.3): in prefill the
                    token-wise ops (norms, projections, rope, FFN, lm-head) run on the NPU in
                    static bucketed chunks and the dynamic-length attention on the GPU; decode
                    runs on the GPU. Both phases share the KV cache in place.
"""
from __future__ import annotations

PLANS = ("cpu", "gpu", "npu", "hetero")


def placement(plan: str, phase: str):
    """-> function(op) -> processor name."""
    if plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r} (choose from {', '.join(PLANS)})")
    if plan in ("cpu", "gpu", "npu"):
        return lambda op: plan
    if phase == "decode":
        return lambda op: "gpu"
    return lambda op: "gpu" if op.kind == "attention" else "npu"


def processors(plan: str) -> set:
    return {"hetero": {"gpu", "npu"}}.get(plan, {plan})


def default_plan(available: set) -> str:
    """The fastest plan socllm knows for this device. Measured on the 2-core dev machine (PoCL and
    OpenVINO both on the CPU; see the README's table): the NPU actor's compiled graphs are the
    fastest single processor there, so `npu` is the default; `hetero` is chosen only where a real
    GPU and NPU exist (their profile would say so; not measured yet)."""
    return "npu" if "npu" in available else "gpu" if "gpu" in available else "cpu"
