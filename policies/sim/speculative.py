"""Speculative decoding's verification step on a simulated CPU+GPU SoC: Ghidorah (arXiv 2505.23219)
from its published characteristics. Nothing here runs a kernel; every figure is simulated.

One step verifies a tree of W tokens (W = 1: plain decoding) through every layer of the model.
Its time is built per processor, roofline style: a task takes max(flops / flops_eff, bytes /
bandwidth got) plus its launch cost, where

  GPU  a matrix product's flops are counted by whole output tiles and whole waves of tiles
       (wave quantization, Ghidorah §III-C2 [26]): rows padded to the tensor-core tile, column
       tiles run `sms` at a time, so the GPU's time is flat until the rows fill a tile and then
       steps;
  CPU  no tiles; its sustained SIMD throughput against the bandwidth it reaches puts its
       roofline's knee near 16 rows (§IV-C: the ARM CPU keeps "a similar execution time from 4
       to 16", the GPU "from 4 to 64").

Both processors stream one memory. Running at once, each loses `contention_loss` of the
bandwidth it reaches alone, in proportion to how hard the other one draws (§III-C3: contention
"affects different processing units at varying levels"), and together they never pass the SoC's
bandwidth_total. Tasks on the two processors progress as fluids: when one finishes, the other
runs on at the bandwidth it reaches alone. A barrier (both processors need the other's output)
costs the SoC's sync_s (§II-D: a page synchronization under 0.1 ms on the Jetson Xavier NX).

Methods (§IV-A), each over one step of width W:
  sequential  W = 1 on the GPU alone: the normalization's unit
  medusa      the GPU alone verifies the tree: every linear over W rows, attention dense over
              the KV cache and the tree with the tree's mask
  medusa+em   CPU and GPU with Megatron-LM's tensor parallelism (§II-B2, Figure 2): QKV and
              attention by heads, the attention's output projection by rows, then an all-reduce;
              gate/up by columns, down by rows, then an all-reduce; the ratio from each
              processor's execution time alone (EdgeNN), zero-copy synchronization
  ghidorah    HCMP (§III-B): every linear split by output columns at one ratio, no all-reduce;
              attention's dense part (the tree's queries against the KV cache) on the GPU, its
              sparse part (the tree against itself under its mask) on the CPU with the paper's
              optimized sparse kernel (§IV-D, Figure 10(b): 1.90x faster than computing it
              dense), merged by online softmax at the barrier; the ratio from the solo times,
              then adjusted step by step under contention to the fastest (ARCA, §III-C3)

Decoding speed = acceptance length(W) / step time(W); normalized by sequential's 1 / step(1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..arca import climb, solo_share, start_step
from .soc import SoC

F16 = 2                       # bytes of an activation, a K/V element
SPARSE_SPEEDUP = 1.90         # §IV-D, Figure 10(b): optimized sparse over dense on the ARM CPU
RATIO_STEP = 1 / 64           # ARCA's adjustment step: 64 columns of a 4096-wide output
METHODS = ("sequential", "medusa", "medusa+em", "ghidorah")
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class SpecModel:
    """A transformer by its published shape (MHA, gated FFN), for the cost of a step only."""
    name: str
    layers: int
    dim: int
    ffn: int
    heads: int
    vocab: int
    source: str

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# lmsys/vicuna-7b-v1.3's config.json (LLaMA-7B's shape), the model of Ghidorah §IV-A
VICUNA_7B = SpecModel("vicuna-7b", layers=32, dim=4096, ffn=11008, heads=32, vocab=32000,
                      source="lmsys/vicuna-7b-v1.3 config.json (LLaMA-7B shape): 32 layers, "
                             "hidden 4096, intermediate 11008, 32 heads, vocab 32000")

# Ghidorah Table I: acceptance length (tokens a step) of its trees per verification width,
# Vicuna-7B with Medusa's 5 heads; the trees are calibrated on MT-bench
ACCEPTANCE = {
    "mt-bench": {1: 1.0, 2: 1.72, 4: 2.28, 8: 2.59, 16: 2.93, 32: 3.19, 64: 3.34},
    "gsm8k": {1: 1.0, 2: 1.76, 4: 2.43, 8: 2.69, 16: 3.08, 32: 3.34, 64: 3.56},
    "mbpp": {1: 1.0, 2: 1.78, 4: 2.54, 8: 2.89, 16: 3.27, 32: 3.55, 64: 3.74},
    "human-eval": {1: 1.0, 2: 1.77, 4: 2.49, 8: 2.8, 16: 3.19, 32: 3.48, 64: 3.71},
}

# A task: (flops-bound seconds, bytes) on one processor; a phase: processor -> [tasks], ended by
# a barrier unless it is the last of its layer and the method needs none there.


def _gemm_s(proc, rows: int, K: int, M: int) -> float:
    """Seconds of compute of a rows x K by K x M product on `proc` (wave-quantized on a GPU)."""
    if rows <= 0 or M <= 0 or K <= 0:
        return 0.0
    if proc.sms and proc.gemm_tile_rows and proc.gemm_tile_cols:
        tiles = math.ceil(rows / proc.gemm_tile_rows) * math.ceil(M / proc.gemm_tile_cols)
        waves = math.ceil(tiles / proc.sms)
        return 2.0 * waves * proc.sms * proc.gemm_tile_rows * proc.gemm_tile_cols * K / proc.flops
    return 2.0 * rows * K * M / proc.flops


def linear(proc, rows: int, K: int, M: int, wbytes: float) -> tuple:
    """(compute s, bytes) of a linear layer's M output columns over `rows` rows: the weight read
    once, the activations in and out at f16."""
    if M <= 0 or K <= 0:
        return (0.0, 0.0)
    return (_gemm_s(proc, rows, K, M), K * M * wbytes + rows * (K + M) * F16)


def attention(proc, rows: int, keys: int, width: int) -> tuple:
    """(compute s, bytes) of `rows` queries against `keys` cached keys, `width` = heads x
    head_dim of the part: QK^T and AV (4 flops a query, key and channel), K and V read, Q read
    and the output written."""
    if rows <= 0 or keys <= 0 or width <= 0:
        return (0.0, 0.0)
    return (4.0 * rows * keys * width / proc.flops,
            2.0 * keys * width * F16 + 2.0 * rows * width * F16)


def tree_attention_sparse(proc, rows: int, width: int) -> tuple:
    """The tree's rows against the tree's own keys under its mask on the CPU: the dense W x W
    product's cost over the optimized sparse kernel's measured speedup (§IV-D)."""
    c, b = attention(proc, rows, rows, width)
    return (c / SPARSE_SPEEDUP, b / SPARSE_SPEEDUP)


# ---------------------------------------------------------------------------------------------
# virtual time: two processors streaming one memory


def _rates(soc: SoC, running: dict) -> dict:
    """Fraction of its task each running processor completes a second. running: p -> [compute
    s, bytes, done fraction]. Alone, a processor gets the bandwidth it reaches alone; together,
    each loses its contention_loss times the other's draw over what the other reaches alone, and
    together they get at most bandwidth_total."""
    procs = soc.processors
    alone = {p: procs[p].bandwidth for p in running}
    got = dict(alone)
    draw = {}
    for _ in range(30 if len(running) > 1 else 1):
        draw = {p: (r[1] / max(r[0], r[1] / got[p]) if r[1] else 0.0) for p, r in running.items()}
        got = {p: alone[p] * (1.0 - procs[p].contention_loss *
                              min(1.0, sum(draw[q] / alone[q] for q in running if q != p)))
               for p in running}
    total = sum(p_draw for p_draw in draw.values())
    scale = min(1.0, soc.bandwidth_total / total) if total > 0 else 1.0
    rates = {}
    for p, (c, b, _) in running.items():
        mem = b / (got[p] * scale) if b else 0.0
        rates[p] = 1.0 / max(max(c, mem) + procs[p].kernel_s, 1e-15)
    return rates


def run_phase(soc: SoC, work: dict) -> float:
    """Seconds until every processor has run its list of tasks (processor -> [(compute s,
    bytes)]), each list in order, the processors at once."""
    queues = {p: [t for t in ts if t[0] or t[1]] for p, ts in work.items()}
    queues = {p: q for p, q in queues.items() if q}
    running: dict = {}
    t = 0.0
    while queues or running:
        for p in list(queues):
            if p not in running:
                c, b = queues[p].pop(0)
                running[p] = [c, b, 0.0]
                if not queues[p]:
                    del queues[p]
        rates = _rates(soc, running)
        dt = min((1.0 - r[2]) / rates[p] for p, r in running.items())
        for p in list(running):
            running[p][2] += rates[p] * dt
            if running[p][2] >= 1.0 - 1e-12:
                del running[p]
        t += dt
    return t


# ---------------------------------------------------------------------------------------------
# one verification step per method


def _heads_of(model: SpecModel, heads: int) -> list:
    """Medusa's draft heads (a ResBlock and a vocabulary projection each), run on the accepted
    row: [(K, M)] of their linears; `heads` = 0 leaves them out."""
    return [(model.dim, model.dim), (model.dim, model.vocab)] * heads


def _alone_phases(soc: SoC, p: str, model: SpecModel, W: int, ctx: int, wb: float) -> list:
    """One layer on processor p alone: [work of each phase]."""
    proc, d, f = soc.processors[p], model.dim, model.ffn
    if p == "cpu":            # the CPU alone runs the tree's part with its sparse kernel
        att = [attention(proc, W, ctx, d), tree_attention_sparse(proc, W, d)]
    else:                     # a GPU computes the tree's part dense under the mask (Medusa)
        att = [attention(proc, W, ctx + W, d)]
    return [{p: [linear(proc, W, d, 3 * d, wb)] + att + [
        linear(proc, W, d, d, wb), linear(proc, W, d, 2 * f, wb), linear(proc, W, f, d, wb)]}]


def _tail(soc: SoC, model: SpecModel, W: int, wb: float, share: dict, heads: int) -> list:
    """The LM head over the W rows and the draft heads over one, columns split by `share`
    (processor -> fraction of the columns)."""
    out = []
    for rows, (K, M) in [(W, (model.dim, model.vocab))] + [(1, km) for km in _heads_of(model, heads)]:
        out.append({p: [linear(soc.processors[p], rows, K, round(M * s), wb)]
                    for p, s in share.items() if round(M * s) > 0})
    return out


def _step(soc: SoC, model: SpecModel, layer_phases: list, tail: list) -> float:
    """Seconds of a step: the layer's phases (each ended by a barrier where two processors ran)
    times the layers, then the tail's phases."""
    def total(phases):
        s = 0.0
        for ph in phases:
            s += run_phase(soc, ph)
            if sum(1 for ts in ph.values() if ts) > 1:
                s += soc.sync_s
        return s
    return model.layers * total(layer_phases) + total(tail)


def step_alone(soc: SoC, p: str, model: SpecModel, W: int, ctx: int, wb: float,
               heads: int = 0) -> float:
    """Seconds of a verification step of width W on processor p alone."""
    return _step(soc, model, _alone_phases(soc, p, model, W, ctx, wb),
                 _tail(soc, model, W, wb, {p: 1.0}, heads))


def step_hcmp(soc: SoC, model: SpecModel, W: int, ctx: int, wb: float, r: float,
              heads: int = 0) -> float:
    """Ghidorah's HCMP at CPU share r of every linear's output columns: a barrier after each
    linear (the next op reads the whole output) and after attention (the online-softmax merge)."""
    if r <= 0.0:
        return step_alone(soc, "gpu", model, W, ctx, wb, heads)
    if r >= 1.0:
        return step_alone(soc, "cpu", model, W, ctx, wb, heads)
    g, c, d, f = soc.processors["gpu"], soc.processors["cpu"], model.dim, model.ffn

    def split(K, M):
        mc = round(M * r)
        return {"gpu": [linear(g, W, K, M - mc, wb)], "cpu": [linear(c, W, K, mc, wb)]}
    phases = [split(d, 3 * d),
              {"gpu": [attention(g, W, ctx, d)], "cpu": [tree_attention_sparse(c, W, d)]},
              split(d, d), split(d, 2 * f), split(f, d)]
    return _step(soc, model, phases, _tail(soc, model, W, wb, {"gpu": 1 - r, "cpu": r}, heads))


def step_megatron(soc: SoC, model: SpecModel, W: int, ctx: int, wb: float, r: float,
                  heads: int = 0) -> float:
    """Medusa+EM: Megatron-LM's split at CPU share r (heads for attention, FFN columns), each
    processor's attention dense over the cache and the tree under its mask; after the output
    projection and after FFN-down, the GPU adds the CPU's partial sums to its own (reads both,
    writes one) between two barriers."""
    g, c, d, f, hd = soc.processors["gpu"], soc.processors["cpu"], model.dim, model.ffn, model.head_dim
    hc = round(model.heads * r)
    fc = round(f * r)
    dims = {"gpu": (model.heads - hc) * hd, "cpu": hc * hd}
    ffns = {"gpu": f - fc, "cpu": fc}
    procs = {"gpu": g, "cpu": c}
    attn_block = {p: [linear(q, W, d, 3 * dims[p], wb), attention(q, W, ctx + W, dims[p]),
                      linear(q, W, dims[p], d, wb)] for p, q in procs.items() if dims[p]}
    ffn_block = {p: [linear(q, W, d, 2 * ffns[p], wb), linear(q, W, ffns[p], d, wb)]
                 for p, q in procs.items() if ffns[p]}
    # the all-reduce: the GPU waits for the CPU's partial sums (a barrier), reads both, writes
    # the sum, and the CPU waits for it (a second barrier)
    reduce = {"gpu": [(0.0, 3.0 * W * d * F16)]}
    s, syncs = 0.0, 0
    for block in (attn_block, ffn_block):
        s += run_phase(soc, block)
        if len(block) > 1:
            s += run_phase(soc, reduce)
            syncs += 2
    s = model.layers * (s + syncs * soc.sync_s)
    return s + _step(soc, model, [], _tail(soc, model, W, wb, {"gpu": 1 - r, "cpu": r}, heads))


def solo_ratio(soc: SoC, model: SpecModel, W: int, ctx: int, wb: float, heads: int = 0) -> float:
    """The CPU's share from the processors' execution times alone (EdgeNN; ARCA's start): each
    processor's share in proportion to its speed (policies/arca.py solo_share)."""
    return solo_share(step_alone(soc, "gpu", model, W, ctx, wb, heads),
                      step_alone(soc, "cpu", model, W, ctx, wb, heads))


def arca_ratio(soc: SoC, model: SpecModel, W: int, ctx: int, wb: float, heads: int = 0) -> tuple:
    """(CPU share, step seconds): ARCA's contention-aware partition (§III-C3, policies/arca.py
    climb): start from the solo ratio (rounded to RATIO_STEP), move one step at a time in
    whichever direction makes the step under contention faster, stop where neither does."""
    n = round(1 / RATIO_STEP)
    k, best, _ = climb(lambda j: step_hcmp(soc, model, W, ctx, wb, j * RATIO_STEP, heads),
                       start_step(solo_ratio(soc, model, W, ctx, wb, heads), n), 0, n)
    return k * RATIO_STEP, best


def speculative_curve(soc: SoC, model: SpecModel = VICUNA_7B, widths=WIDTHS,
                      acceptance: dict | None = None, context: int = 256, weight_bytes: float = 2.0,
                      draft_heads: int = 0) -> dict:
    """Ghidorah's Figure 9 on a simulated SoC with a CPU and a GPU: per verification width, the
    step time of each method and its decoding speed (acceptance / step time) normalized to
    sequential decoding's (W = 1 on the GPU alone).

    acceptance: width -> tokens accepted a step (default Table I's MT-bench); context: the KV
    cache's length (§IV-C: about 256); weight_bytes: bytes a weight (Ghidorah's fp16: 2);
    draft_heads: Medusa heads whose weights each step also reads (0: the backbone only).
    -> {"rows": [{width, acceptance, step_s: {gpu, cpu, medusa+em, ghidorah}, cpu_share:
        {medusa+em, ghidorah}, normalized: {method: speed}, normalized_cpu_alone}],
        "sequential_s", "best_width"}"""
    if not {"gpu", "cpu"} <= set(soc.processors):
        raise ValueError(f"{soc.name} has no CPU and GPU pair to split a verification step across")
    acceptance = acceptance or ACCEPTANCE["mt-bench"]
    missing = [w for w in widths if w not in acceptance]
    if missing:
        raise ValueError(f"no acceptance length for width(s) {missing}")
    if any(w < 1 for w in widths) or context < 0:
        raise ValueError("widths must be >= 1 and the context >= 0")
    seq = step_alone(soc, "gpu", model, 1, context, weight_bytes)
    rows = []
    for W in widths:
        tg = step_alone(soc, "gpu", model, W, context, weight_bytes, draft_heads)
        tc = step_alone(soc, "cpu", model, W, context, weight_bytes, draft_heads)
        r_em = solo_ratio(soc, model, W, context, weight_bytes, draft_heads)
        t_em = step_megatron(soc, model, W, context, weight_bytes, r_em, draft_heads)
        r_gh, t_gh = arca_ratio(soc, model, W, context, weight_bytes, draft_heads)
        a = acceptance[W]
        rows.append({"width": W, "acceptance": a,
                     "step_s": {"gpu": tg, "cpu": tc, "medusa+em": t_em, "ghidorah": t_gh},
                     "cpu_share": {"medusa+em": r_em, "ghidorah": r_gh},
                     "normalized": {"sequential": 1.0, "medusa": a * seq / tg,
                                    "medusa+em": a * seq / t_em, "ghidorah": a * seq / t_gh},
                     # not one of the paper's methods: Medusa's tree on the CPU alone
                     "normalized_cpu_alone": a * seq / tc})
    best = max(rows, key=lambda r: r["normalized"]["ghidorah"])["width"]
    return {"model": model.name, "context": context, "weight_bytes": weight_bytes,
            "draft_heads": draft_heads, "sequential_s": seq, "rows": rows, "best_width": best}


def published_figure(soc: SoC, dataset: str) -> dict:
    """(method, width) -> the paper's normalized speed for `dataset`, from the SoC's "published"
    entries of what "normalized decode speed"."""
    return {(e["method"], e["width"]): e["value"] for e in soc.published
            if e.get("what") == "normalized decode speed" and e.get("dataset") == dataset}


def against_text(soc: SoC, curve: dict, dataset: str) -> list:
    """The numbers Ghidorah's text states (the SoC's published entries without a per-width
    figure reading) beside the simulated ones, for a curve of `dataset` that holds the widths they
    speak of. Rows: {what, method, published, simulated, ratio, calibrated, source}; calibrated:
    the SoC's profile was set to reproduce it (an input, not a result)."""
    rows_by_w = {r["width"]: r for r in curve["rows"]}
    out = []
    for e in soc.published:
        if e.get("dataset", dataset) != dataset or e["source"].startswith("Ghidorah Figure 9"):
            continue
        widths = e.get("widths") or ([e["width"]] if "width" in e else list(rows_by_w))
        if not all(w in rows_by_w for w in widths):
            continue
        rows = [rows_by_w[w] for w in widths]
        n = [r["normalized"] for r in rows]
        if e["what"] == "normalized decode speed":
            sim = n[0][e["method"]]
        elif e["what"] == "parallel speedup":
            sim = curve["sequential_s"] / rows[0]["step_s"][e["method"]]
        elif e["what"].startswith("mean speedup over "):
            base = e["what"][len("mean speedup over "):]
            sim = sum(x[e["method"]] / x[base] for x in n) / len(n)
        elif e["what"] == "best width":
            sim = max(rows, key=lambda r: r["normalized"][e["method"]])["width"]
        else:
            raise ValueError(f"unknown published figure {e['what']!r}")
        out.append({"what": e["what"], "method": e["method"], "dataset": e.get("dataset"),
                    "published": e["value"], "simulated": sim, "ratio": sim / e["value"],
                    "calibrated": bool(e.get("calibrated")), "source": e["source"]})
    return out
