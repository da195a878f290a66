"""Simulated SoCs: device profiles built from the papers' published characteristics, and the cost
of one task of a step program on one of their processors. Nothing here runs a kernel: every
figure that comes from these profiles is a simulated one, and says so.

A profile (policies/sim/socs/<name>.json) gives, per processor, its sustained FLOPS, the memory
bandwidth it reaches alone and its per-kernel costs, and for the SoC the bandwidth all of them
reach together and the synchronization costs (HeteroLLM §3, §4.2). Each number carries the
sentence of the paper it comes from.

A task's cost is a roofline: `flops / flops_eff` against `bytes / bandwidth`, the larger, plus
a per-kernel overhead. The NPU's flops_eff follows HeteroLLM §3.2: matrix dimensions padded to
its array (stage performance), and up to `shape_penalty_max` slower when a weight is wider than
tall (order- and shape-sensitive performance: the stationary operand outgrows the array).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SOC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "socs")
F16 = 2                  # bytes of an activation (W4A16: activations in half precision)
# bytes per weight of each weight ref (graph/program.py): socllm's planar Q4_1 (4-bit codes, an
# f16 scale and minimum per 32) for the layers' matrices, Q8_0 for the token table
WEIGHT_BYTES = {"w4": 0.625, "wq": 0.625, "w8": 1.0625, "wt": 2.0, "wf": 4.0}
# HeteroLLM's W4A16 storage (§5.1), taken as 4-bit codes with one f16 scale per 128 weights (the
# paper does not give its group): what its published decode rates read per token
W4A16_BYTES = {**WEIGHT_BYTES, "w4": 4.125 / 8, "w8": 4.125 / 8}
# Agent.xpu's W8A16 (§6.1, round-to-nearest, OpenVINO's per-channel int8: a byte a weight)
W8A16_BYTES = {**WEIGHT_BYTES, "w4": 1.0, "w8": 1.0}
# Ghidorah's Vicuna-7B on FasterTransformer (§IV): half-precision weights, two bytes each
F16_BYTES = {**WEIGHT_BYTES, "w4": 2.0, "w8": 2.0}
WEIGHTS = {"q4_1": WEIGHT_BYTES, "w4a16": W4A16_BYTES, "w8a16": W8A16_BYTES, "f16": F16_BYTES}


@dataclass
class Processor:
    name: str
    flops: float                     # sustained FLOP/s
    bandwidth: float                 # bytes/s it reaches alone
    kernel_s: float = 0.0            # per task: submission (GPU) or graph launch (NPU)
    resubmit_s: float = 0.0          # extra when a wait on another processor emptied its queue
    tile: int = 1                    # dims padded to this (the NPU's array: stage performance)
    shape_penalty_max: float = 1.0   # the NPU's worst order/shape slowdown
    prepare_s: float = 0.0           # NPU graph preparation: fixed part ...
    prepare_s_per_row: float = 0.0   # ... and per row of the graph's shape
    api: str = ""
    # a GPU's wave quantization (NVIDIA's "wave quantization", Ghidorah §III-C2's [26]): a matrix
    # product's output is cut into tiles of gemm_tile_rows x gemm_tile_cols, run `sms` at a time,
    # so rows and columns are paid for by whole tiles and whole waves (0: no such effect)
    sms: int = 0
    gemm_tile_rows: int = 0
    gemm_tile_cols: int = 0
    # memory contention, per processor (Ghidorah §III-C3: it "affects different processing units
    # at varying levels"): the fraction of the bandwidth it reaches alone that it loses while the
    # other processor streams memory at the full bandwidth that one reaches alone (in proportion
    # below that). Only policies/sim/speculative.py reads it; simulate.py shares bandwidth_total
    contention_loss: float = 0.0


@dataclass
class SoC:
    name: str
    title: str
    source: str
    processors: dict                 # name -> Processor
    bandwidth_total: float           # bytes/s all processors reach at once
    sync_s: float                    # a cross-processor wait with the pool's ready flags
    sync_copy_s: float               # ... and without them (copy through the driver)
    weights: str = "w4a16"           # the storage its paper's models used (WEIGHTS)
    simulated: bool = True
    notes: dict = field(default_factory=dict)
    published: list = field(default_factory=list)   # the papers' results, to compare against


def soc_names(needs: tuple = ("gpu", "npu")) -> list:
    """The simulated SoCs that have every processor of `needs` (the GPU and the NPU that
    HeteroLLM's strategies and `socllm plan` split between; () for all of them)."""
    out = []
    for f in sorted(os.listdir(SOC_DIR)):
        if f.endswith(".json"):
            with open(os.path.join(SOC_DIR, f)) as fh:
                if set(needs) <= set(json.load(fh)["processors"]):
                    out.append(f[:-5])
    return out


def load_soc(name: str) -> SoC:
    path = os.path.join(SOC_DIR, f"{name}.json")
    if not os.path.exists(path):
        raise ValueError(f"unknown SoC {name!r} (simulated SoCs: {', '.join(soc_names(()))})")
    with open(path) as f:
        d = json.load(f)
    notes = {k: v for k, v in d.items() if k.endswith("_note")}
    procs = {}
    for p, spec in d["processors"].items():
        notes.update({f"{p}.{k}": v for k, v in spec.items() if k.endswith("_note")})
        procs[p] = Processor(p, **{k: v for k, v in spec.items() if not k.endswith("_note")})
    return SoC(d["name"], d["title"], d["source"], procs, d["bandwidth_total"], d["sync_s"],
               d["sync_copy_s"], weights=d.get("weights", "w4a16"), notes=notes,
               published=d.get("published", []))


def _pad(x: int, tile: int) -> int:
    return -(-x // tile) * tile


def work(op: str, a: dict, n: int, pos0: int, weight_bytes: dict = WEIGHT_BYTES) -> tuple:
    """(flops, bytes moved from memory, (rows, K, M) of its matrix product or None) of one task
    over n rows after pos0 cached ones. Activations count at f16, weights at their format's bytes
    per weight, K/V rows at f16."""
    if op in ("linear", "lm_head"):
        K, M = (a["K"], a["M"]) if op == "linear" else (a["D"], a["V"])
        rows = 1 if op == "lm_head" and not a.get("all_rows") else n
        wb = weight_bytes[a["w" if op == "linear" else "table"][0]]
        return 2.0 * rows * K * M, M * K * wb + rows * (K + M) * F16, (rows, K, M)
    if op == "attention":
        H, KVH, hd = a["heads"], a["kv_heads"], a["head_dim"]
        keys = pos0 + (n + 1) / 2                      # a causal row's mean key count
        return (4.0 * n * keys * H * hd, (pos0 + n) * 2 * KVH * hd * F16 + 2 * n * H * hd * F16,
                None)
    if op == "embed":
        return 0.0, n * a["D"] * (F16 + 1.0625), None
    if op == "rope":
        return 6.0 * n * a["heads"] * a["head_dim"], 2 * n * a["heads"] * a["head_dim"] * F16, None
    width = {"rmsnorm": "D", "add": "D", "silu_mul": "F", "gelu_mul": "F"}[op]
    cols = a[width] * a.get("heads", 1)
    return 4.0 * n * cols, 3 * n * cols * F16, None


def task_time(proc: Processor, op: str, a: dict, n: int, pos0: int,
              weight_bytes: dict = WEIGHT_BYTES) -> tuple:
    """(compute seconds, bytes) of one task on `proc`; memory time depends on the bandwidth the
    task gets, which the simulator decides (contention)."""
    flops, nbytes, mm = work(op, a, n, pos0, weight_bytes)
    if mm is not None and proc.tile > 1:               # HeteroLLM §3.2: stage performance
        rows, K, M = mm
        flops = 2.0 * _pad(rows, proc.tile) * _pad(K, proc.tile) * _pad(M, proc.tile)
        flops *= min(proc.shape_penalty_max, max(1.0, K / M))    # §3.2: order/shape-sensitive
    return flops / proc.flops, nbytes


def prepare_time(proc: Processor, rows: int) -> float:
    """Seconds to prepare (compile) an NPU graph for a new shape of `rows` rows."""
    return proc.prepare_s + proc.prepare_s_per_row * rows
