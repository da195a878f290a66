"""The auto plan's choice, kept per model, machine and knobs (plans.json in the config's cache
dir): what the choice depends on (plan_key), the table (plan_cache), and the processor actors
a plan runs on (processors_for). The service times the candidates at start (actors/service.py)."""
from __future__ import annotations

import json
import os
import platform

from socllm.graph.store import code_version

from .buckets import NPU_PREFILL_ACT, WHOLE_GRAPH_FROM
from .placement import NPU_MARGIN, PROCESSORS_OF, SERVE_PLANS


def processors_for(plan: str) -> tuple:
    """The processor actors a plan runs on (policies/placement.py SERVE_PLANS): its programs'
    and the GPU for what they cannot take (auto: the GPU and the NPU, to time them)."""
    if plan == "auto":
        return ("gpu", "npu")
    need = {p for on in SERVE_PLANS[plan] for p in PROCESSORS_OF.get(on, (on,))}
    return tuple(sorted(need | ({"gpu"} if plan != "cpu" else set())))


KERNELS = ("actors/cpu", "actors/gpu", "actors/npu")   # the processors' kernels (plan_key)


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it (else the architecture)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.machine())


def plan_key(c, model_file: str, model_digest: str) -> str:
    """What an auto plan's choice depends on: the model (its file's name and sha256,
    models/gguf_file.py file_digest: the same model installed elsewhere finds it), this machine
    (its CPU, its OpenCL drivers, an NPU's device node), the knobs, the rule, and the processors'
    kernels (a kernel made faster changes the timings the choice was made from)."""
    cpu = cpu_name()
    icd = "/etc/OpenCL/vendors"
    drivers = ",".join(sorted(os.listdir(icd))) if os.path.isdir(icd) else ""
    npu = ",".join(sorted(d for d in os.listdir("/dev") if d.startswith("accel")))
    return f"{os.path.basename(model_file)}:{model_digest[:32]}|{platform.node()} {cpu} [{drivers}] [{npu}]|" \
           f"{c.budget}|{c.precision}|{c.prefill_chunk}|{c.context}|{c.max_seqs}|margin {NPU_MARGIN}|" \
           f"npu prefill {NPU_PREFILL_ACT.get(c.precision, 'f32')}|" \
           f"whole graphs from {WHOLE_GRAPH_FROM if c.whole_graph else 0}|" \
           f"{kernels()}"


def kernels() -> str:
    """The processors' kernels as plan_key's last field names them (a hash of their code)."""
    return f"kernels {code_version(KERNELS, ('.py', '.cl'))[:16]}"


def plan_cache(cache_dir: str | None, key: str | None = None,
                value: dict | None = None) -> dict | str | None:
    """The auto plans chosen on this machine (plans.json in the config's cache_dir): -> the
    whole table (no key), the plan cached for key, or, given a value, stores it."""
    if cache_dir is None:           # a config made without from_env: nothing kept
        return {} if key is None else None if value is None else value
    path = os.path.join(cache_dir, "plans.json")
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    if value is None:
        return table if key is None else (table.get(key) or {}).get("plan")
    table[key] = value
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)
    return value
