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
    """The fastest plan socllm knows for this device. Measured on the 2-core dev machine (PoCL's
    OpenCL and OpenVINO both on the CPU; `python -m socllm.scripts.measure`, median of 3):
    prefill at 512 tokens hetero 440 tok/s, gpu 343, npu 209, cpu 109; decode (128 tokens) gpu
    58-65 tok/s, hetero 59-60 (it decodes on the GPU), npu 39, cpu 1.2. So `hetero` where both
    a GPU and an NPU actor run, else the best single processor."""
    if {"gpu", "npu"} <= available:
        return "hetero"
    return "gpu" if "gpu" in available else "npu" if "npu" in available else "cpu"
