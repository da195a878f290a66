"""socllm's planner and solver against a simulated SoC: the prefill and decode strategies of
HeteroLLM §4.1 / §5.2, as socllm's own step programs run by policies/sim/simulate.py.

The row-cut solver (policies/rowcut.py) gets its profile from the SoC's cost model instead of a
measurement: the profiler's prediction mode (HeteroLLM §4.3), each processor alone, plus a cut
simulated with both at once for the contention of their shared bandwidth. Every figure here is
simulated.
"""
from __future__ import annotations

from socllm.graph.partition import ALIGN, CUTTABLE, DOMINANT, part_of
from socllm.graph.program import StepProgram, Task
from socllm.memory.layout import plan_layout

from ..buckets import MAX_CHUNK, bucket_for, prefill_chunks
from ..planner import PlannerCore
from .simulate import simulate_step
from .soc import WEIGHTS, SoC, prepare_time, task_time

PREFILL = ("gpu", "npu-padding", "npu-pipe", "online-prepare", "hetero-layer", "row-cut", "seq-cut",
           "hybrid", "hetero-tensor")
CUTS = ("row-cut", "seq-cut", "hybrid")   # the tensor-level strategies hetero-tensor chooses among
DECODE = ("gpu", "npu", "hetero-tensor")


def planner_for(cfg, weights: dict, soc: SoC | None = None, context: int = 2048) -> PlannerCore:
    """socllm's planner over a pool laid out for the model (weights may hold shapes only,
    models/published.py); with a SoC, the tensor plan's cuts come from its predicted profile."""
    planner = PlannerCore(cfg, rowcut_profile=None if soc is None else predicted_profile(soc, cfg))
    slot_bytes = [planner.slots.nbytes(i, MAX_CHUNK) for i in range(len(planner.slots.sizes))]
    lay = plan_layout(weights, cfg.n_layers, cfg.kv_dim, slot_bytes, MAX_CHUNK, context, cfg.vocab,
                      max(cfg.dim, cfg.ffn_dim, cfg.q_dim))
    planner.set_layout(lay.to_dict())
    return planner


def _linear_s(soc: SoC, proc: str, K: int, M: int, n: int) -> float:
    c, b = task_time(soc.processors[proc], "linear", {"K": K, "M": M, "w": ("w4",)}, n, 0)
    p = soc.processors[proc]
    return max(c, b / p.bandwidth) + p.kernel_s


def _cut_s(soc: SoC, dom: str, other: str, K: int, M: int, r: int, n: int) -> float:
    """A linear cut r rows to `other`, both halves at once (simulated: shared bandwidth)."""
    w = 1 << 20
    half = lambda m: {"K": K, "M": m, "w": ("w4",)}
    prog = StepProgram("sim", n, {other: [Task("linear", half(r), signals=[(w, 1)])],
                                  dom: [Task("linear", half(M - r)), Task("add", {"D": 1},
                                                                          waits=[(w, 1)])]})
    return simulate_step(prog, soc, n, 0).seconds


def predicted_profile(soc: SoC, cfg) -> dict:
    """A row-cut profile (policies/rowcut.py's format) for both phases, from the SoC's model:
    {phase: {"dominant": {part: {rows: s}}, "other": ..., "sync_s", "cut": {part: ...}}}."""
    shapes = {"attn_q": (cfg.dim, cfg.q_dim), "attn_k": (cfg.dim, cfg.kv_dim),
              "attn_output": (cfg.q_dim, cfg.dim), "ffn_gate": (cfg.dim, cfg.ffn_dim),
              "ffn_up": (cfg.dim, cfg.ffn_dim), "ffn_down": (cfg.ffn_dim, cfg.dim)}
    out = {}
    for phase, n in (("decode", 1), ("prefill", 256)):
        dom = DOMINANT[phase]
        other = "npu" if dom == "gpu" else "gpu"
        prof = {"dominant": {}, "other": {}, "sync_s": soc.sync_s, "cut": {}}
        for part, (K, M) in shapes.items():
            if part not in CUTTABLE:
                continue
            rows = list(range(ALIGN, M + 1, ALIGN))
            prof["dominant"][part] = {r: _linear_s(soc, dom, K, r, n) for r in rows}
            prof["other"][part] = {r: _linear_s(soc, other, K, r, n) for r in rows}
            r = max(ALIGN, M // 2 // ALIGN * ALIGN)
            prof["cut"][part] = {"rows": r, "cut_measured_s": _cut_s(soc, dom, other, K, M, r, n) + soc.sync_s,
                                 "cut_predicted_s": max(prof["dominant"][part][M - r],
                                                        prof["other"][part][r]) + soc.sync_s}
        out[phase] = prof
    return out


def layer_placement(soc: SoC, n: int):
    """Hetero-layer (HeteroLLM §4.1): each op on the processor its predicted time is least on."""
    def place(op):
        a = dict(op.attrs)
        if op.kind == "linear":
            a["w"] = ("w4",)
        elif op.kind == "lm_head":
            a["table"] = ("w8",)
        best = {}
        for p in ("npu", "gpu"):
            c, b = task_time(soc.processors[p], op.kind, a, n, 0)
            best[p] = max(c, b / soc.processors[p].bandwidth)
        return min(best, key=best.get)
    return place


def prefill(soc: SoC, planner: PlannerCore, strategy: str, length: int, fast_sync: bool = True,
            weights: str = "q4_1") -> dict:
    """Seconds to prefill a prompt of `length` tokens with one strategy (HeteroLLM §5.2.2):
      gpu            the GPU alone, one dynamic-shape step
      npu-padding    the NPU alone, the prompt padded to the smallest bucket holding it
      npu-pipe       the NPU alone, chunks of buckets with little padding (buckets.prefill_chunks)
      online-prepare the NPU alone, a graph prepared for exactly this length (its time counted)
      hetero-layer   each op on its predicted-faster processor, pipe chunks
      row-cut        row-cut linears (the solver's cuts), pipe chunks
      seq-cut        static NPU chunks and a GPU margin at once (the seqcut plan, graph/seqcut.py)
      hybrid         the prompt padded to one NPU bucket, its linears row-cut with the GPU
      hetero-tensor  whichever of the cuts the simulation predicts faster (HeteroLLM §5.2.2:
                     "decides the partition strategy according to the computational power")"""
    if length > MAX_CHUNK and strategy in ("npu-padding", "online-prepare", "seq-cut", "hybrid"):
        raise ValueError(f"{strategy} runs one step of at most {MAX_CHUNK} rows")
    if strategy == "hetero-tensor":
        tried = [prefill(soc, planner, s, length, fast_sync, weights) for s in CUTS
                 if length <= MAX_CHUNK or s == "row-cut"]
        best = min(tried, key=lambda r: r["seconds"])
        return {**best, "strategy": strategy, "chose": best["strategy"]}
    steps, extra = [], 0.0
    if strategy == "gpu":
        steps = [("gpu", length, length)]
    elif strategy == "npu-padding":
        steps = [("npu", length, bucket_for(length))]
    elif strategy == "online-prepare":
        steps, extra = [("npu", length, length)], prepare_time(soc.processors["npu"], length)
    elif strategy == "seq-cut":
        steps = [("seqcut", length, length)]
    elif strategy == "hybrid":
        steps = [("tensor", length, bucket_for(length))]
    else:
        plan = {"npu-pipe": "npu", "hetero-layer": "layer", "row-cut": "tensor"}[strategy]
        steps = [(plan, rows, bucket) for rows, bucket in prefill_chunks(length)]
    total, pos0, byts, busy = extra, 0, 0.0, {}
    for plan, rows, bucket in steps:
        if plan == "layer":
            prog = planner.placed_program("hetero-layer", layer_placement(soc, bucket), "prefill", bucket)
        else:
            prog = _program(planner, plan, "prefill", bucket)
        r = simulate_step(prog, soc, bucket if plan not in ("gpu", "seqcut") else rows, pos0,
                          fast_sync, weight_bytes=WEIGHTS[weights])
        total += r.seconds + soc.sync_s           # the host's go and done words
        byts += sum(r.bytes.values())
        for p, s in r.busy.items():
            busy[p] = busy.get(p, 0.0) + s
        pos0 += rows
    return {"strategy": strategy, "prompt_len": length, "seconds": total,
            "tok_s": length / total, "steps": len(steps), "prepare_s": extra,
            "busy_s": busy}


def decode(soc: SoC, planner: PlannerCore, strategy: str, pos: int, fast_sync: bool = True,
           weights: str = "q4_1") -> dict:
    """One decode step after `pos` tokens: gpu, npu, or hetero-tensor (row-cut, GPU-dominant).
    weights: the weights' storage (policies/soc.WEIGHTS)."""
    plan = {"gpu": "gpu", "npu": "npu", "hetero-tensor": "tensor"}[strategy]
    r = simulate_step(_program(planner, plan, "decode", 1), soc, 1, pos, fast_sync,
                      weight_bytes=WEIGHTS[weights])
    s = r.seconds + soc.sync_s
    return {"strategy": strategy, "pos": pos, "seconds": s, "tok_s": 1.0 / s,
            "bandwidth_gbs": sum(r.bytes.values()) / s / 1e9, "syncs": r.syncs,
            "busy_s": r.busy}


def _program(planner: PlannerCore, plan: str, phase: str, bucket: int):
    return StepProgram.from_bytes(planner.program(plan, phase, bucket)[1])


def cut_rows(planner: PlannerCore, phase: str) -> dict:
    """part -> (rows on the non-dominant processor, M) of the tensor plan's cuts."""
    graph = planner.partitioned(phase)
    out = {}
    for op in graph.ops:
        part = part_of(op)
        if part and "rows" in op.attrs and op.attrs["on"] != DOMINANT[phase]:
            lo, hi = op.attrs["rows"]
            out[part] = (hi - lo, hi)
    return out


def against_published(soc: SoC, planners: dict, weights: str = "w4a16") -> list:
    """The SoC's published results (policies/sim/socs/*.json "published") beside the simulated ones.
    planners: model name -> planner_for(...). Rows: {what, model, strategy, prompt_len, source,
    published, simulated, ratio (simulated / published)}. A workload's figures (they name rates)
    are the workload simulation's (actors/front/simulate.py --workload), a speculative method's
    (they name one) the speculative curve's (policies/sim/speculative.py, --spec)."""
    rows = []
    for e in soc.published:
        if "reactive_rate" in e or "method" in e:   # a workload's, or speculative decoding's
            continue
        pl, s, L = planners[e["model"]], e["strategy"], e["prompt_len"]
        if e["what"] == "decode tok/s":
            sim = decode(soc, pl, s, L, weights=weights)["tok_s"]
        elif e["what"] == "decode GB/s":
            sim = decode(soc, pl, s, L, weights=weights)["bandwidth_gbs"]
        elif e["what"] == "prefill tok/s":
            sim = prefill(soc, pl, s, L, weights=weights)["tok_s"]
        elif e["what"].startswith("prefill speedup vs "):
            base = e["what"].split(" vs ")[1]
            sim = prefill(soc, pl, base, L, weights=weights)["seconds"] / \
                prefill(soc, pl, s, L, weights=weights)["seconds"]
        else:
            raise ValueError(f"unknown published figure {e['what']!r}")
        rows.append({**e, "published": e["value"], "simulated": sim, "ratio": sim / e["value"]})
    return rows
