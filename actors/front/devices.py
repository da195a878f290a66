"""`socllm info`: the processors this machine offers and the actor that uses each."""
from __future__ import annotations

from socllm.policies.config import EngineConfig


def describe_devices() -> dict:
    config = EngineConfig.from_env()
    out = {"threads": config.budget, "cpu": {"actor": "control (numpy kernels, sampling, step control)"}}
    try:
        from socllm.actors.gpu.device import cl, name_the_cpu
        name_the_cpu(config)
        plats = []
        for p in cl.get_platforms():
            plats.append({"platform": p.name, "devices": [
                {"name": d.name, "type": cl.device_type.to_string(d.type),
                 "host_unified_memory": bool(d.host_unified_memory),
                 "note": "PoCL runs OpenCL on the CPU: a real OpenCL run, not a GPU" if "Portable" in p.name else ""}
                for d in p.get_devices()]})
        out["opencl"] = plats
        from socllm.actors.gpu.device import make_context
        _, _, dev = make_context(config=config)
        out["gpu_actor"] = f"{dev.platform.name}: {dev.name}"
    except Exception as e:
        out["opencl"] = f"unavailable: {e}"
    try:
        import openvino as ov
        from socllm.actors.npu.segment import pick_device
        core = ov.Core()
        out["openvino"] = {"version": ov.__version__, "devices": {
            d: core.get_property(d, "FULL_DEVICE_NAME") for d in core.available_devices}}
        dev = pick_device(core)
        out["npu_actor"] = dev + ("" if dev == "NPU" else " device under NPU rules (no NPU found)")
    except Exception as e:
        out["openvino"] = f"unavailable: {e}"
    return out
