"""NPUMoE's ablation (arXiv NPUMoE §5.8, Figure 17) on a simulated SoC: the prefill latency of an
MoE model's prompt, chunk by chunk, when its experts run as static NPU graphs under
  base            one graph per expert, one fixed capacity (the layer's largest tier)
  tiers           one graph per expert at its capacity tier (§4.1)
  tiers+grouping  same-tier experts in graphs of G (§4.2)
  all             and load-aware residency: cold groups on the fallback processor (§4.3)
Nothing here runs a kernel and no model is read: every figure is SIMULATED, from the SoC's
published characteristics (policies/sim/socs) and the models' published shapes.

Routing is not published per expert, so it is drawn (ASSUMED, seeded): each layer's popularity
is Zipf over a random order of its experts, exponent uniform in ZIPF (NPUMoE §2, Figure 5: "highly
skewed and varies across layers"), and each chunk's popularity drifts by a lognormal factor
(Mixtral §5: locality); a token picks its top-k experts by Gumbel top-k on the log popularity,
so every chunk routes exactly T*k pairs. The plans are policies/moe.py's, from calibration chunks;
the latency is measured on other (held-out) chunks.

Costs, per layer of a chunk: attention (Q/K/V/O and the causal attention) on the NPU, the same in
every variant; each NPU expert graph call pays a dispatch (the SoC's synchronization: through the
driver, as Core ML's NPUMoE, or the pool's ready flags with fast_sync) and then a roofline over
its slices, padding rows included (policies/sim/soc.task_time: the NPU's tile and shape rules);
the fallback runs each cold expert with a chunk's real rows (a kernel a matrix), concurrently,
and together they stream at most the SoC's bandwidth_total. Routing, top-k and scatter on the
CPU are the same in every variant and left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import moe
from .soc import WEIGHTS, SoC, task_time

ABLATIONS = ("base", "tiers", "tiers+grouping", "all")
ZIPF = (0.5, 1.1)                   # ASSUMED: a layer's popularity exponent
DRIFT = 0.3                         # ASSUMED: sigma of a chunk's lognormal popularity drift
GRAPH_MB = 1200.0                   # §4.2: over ~1.2 GB a graph falls back to the CPU (M2 Ultra)
# §5.8, Figure 17 (PhiMoE, M2 Ultra): Ours-all 2.89x faster than Ours-base, 1.09x than Ours-TG
PUBLISHED = {"all_vs_base": 2.89, "all_vs_tiers+grouping": 1.09}


@dataclass(frozen=True)
class MoEShape:
    """An MoE transformer by its published shape."""
    name: str
    layers: int
    dim: int
    n_experts: int
    top_k: int
    ffn_e: int               # one expert's FFN width
    heads: int
    kv_heads: int
    head_dim: int


# Phi-3.5-MoE-instruct (NPUMoE Table 1; its config.json: 32 heads, 8 kv heads) and Qwen3-30B-A3B
# (its config.json: 32 heads, 4 kv heads, head_dim 128)
SHAPES = {"phi-3.5-moe": MoEShape("phi-3.5-moe", 32, 4096, 16, 2, 6400, 32, 8, 128),
          "qwen3-30b-a3b": MoEShape("qwen3-30b-a3b", 48, 2048, 128, 8, 768, 32, 4, 128)}


def routed_counts(shape: MoEShape, T: int, chunks: int, seed: int, pop=None):
    """(counts [chunks, L, E] routed pairs per chunk, the layers' popularity [L, E]) of the
    assumed router; pop: the popularity to draw from (default: new, from seed)."""
    rng = np.random.default_rng(seed)
    L, E, k = shape.layers, shape.n_experts, shape.top_k
    if pop is None:
        s = rng.uniform(*ZIPF, L)
        pop = np.stack([np.arange(1, E + 1)[rng.permutation(E)] ** -s[l] for l in range(L)])
        pop /= pop.sum(1, keepdims=True)
    counts = np.zeros((chunks, L, E), np.int64)
    for c in range(chunks):
        p = pop * rng.lognormal(0, DRIFT, (L, E))
        g = np.log(p)[:, None, :] + rng.gumbel(size=(L, T, E))           # [L, T, E]
        top = np.argpartition(-g, k - 1, axis=2)[:, :, :k]               # [L, T, k]
        for l in range(L):
            counts[c, l] = np.bincount(top[l].ravel(), minlength=E)
    return counts, pop


def calibration(shape: MoEShape, T: int, chunks: int = 8, seed: int = 0):
    """A calibration dict as models/calibrate.py writes it (the fields policies/moe reads) and
    held-out counts [chunks, L, E] from the same router."""
    counts, pop = routed_counts(shape, T, chunks, seed)
    held, _ = routed_counts(shape, T, chunks, seed + 1, pop)
    base = T * shape.top_k / shape.n_experts
    mean, p95 = counts.mean(0), np.percentile(counts, 95, axis=0)
    layers = [{"layer": l, "mean": mean[l].tolist(), "p95": p95[l].tolist(),
               "rho": float(mean[l].max() / base)} for l in range(shape.layers)]
    return ({"gguf_sha256": f"simulated:{shape.name}", "chunk": T, "top_k": shape.top_k,
             "n_experts": shape.n_experts, "dim": shape.dim, "ffn_dim": shape.ffn_e,
             "layers": layers}, held)


def _expert(proc, shape: MoEShape, rows: int, wb: dict):
    """(compute s, bytes) of one expert's FFN over `rows` rows on proc: gate, up, down."""
    s = b = 0.0
    for K, M in ((shape.dim, shape.ffn_e), (shape.dim, shape.ffn_e), (shape.ffn_e, shape.dim)):
        c, nb = task_time(proc, "linear", {"K": K, "M": M, "w": ("w4",)}, rows, 0, wb)
        s, b = s + c, b + nb
    c, nb = task_time(proc, "silu_mul", {"F": shape.ffn_e}, rows, 0, wb)
    return s + c, b + nb


def fallback_of(soc: SoC) -> str:
    """NPUMoE's fallback is the CPU; a simulated SoC without one falls back to its GPU."""
    return "cpu" if "cpu" in soc.processors else "gpu"


def profile(soc: SoC, shape: MoEShape, weights: str, fast_sync: bool) -> dict:
    """policies/moe's device profile from the SoC: a call's dispatch, a row's compute and an
    expert's weight streaming, per processor (the residency decision's view of the costs)."""
    wb, out = WEIGHTS[weights], {}
    for role, name in (("npu", "npu"), ("fallback", fallback_of(soc))):
        p = soc.processors[name]
        c64, nbytes = _expert(p, shape, 64, wb)
        launch = p.kernel_s + ((soc.sync_s if fast_sync else soc.sync_copy_s) if role == "npu" else 3 * p.kernel_s)
        out[role] = {"launch_ms": 1e3 * launch, "ms_per_row": 1e3 * c64 / 64,
                     "ms_per_expert": 1e3 * nbytes / p.bandwidth}
    expert_mb = 3 * shape.dim * shape.ffn_e * wb["w4"] / 2**20
    return {**out, "npu_mb": math.inf, "graph_mb": GRAPH_MB, "max_graphs": 10**9,
            "bytes_per_weight": wb["w4"], "expert_mb": expert_mb}


def plans(calib: dict, prof: dict, row: int, group_size: int) -> dict:
    """The four variants' policies/moe plans (overflow pruned, as NPUMoE's)."""
    return {"base": moe.plan(calib, prof, group_size=1, row=row, tiers=False, residency=False),
            "tiers": moe.plan(calib, prof, group_size=1, row=row, residency=False),
            "tiers+grouping": moe.plan(calib, prof, group_size=group_size, row=row, residency=False),
            "all": moe.plan(calib, prof, group_size=group_size, row=row)}


def layer_s(soc: SoC, shape: MoEShape, lp: moe.LayerPlan, n: np.ndarray, wb: dict, dispatch_s: float):
    """Seconds of one layer's experts for a chunk routing n [E] pairs to them."""
    npu, fb = soc.processors["npu"], soc.processors[fallback_of(soc)]
    t_npu = t_fb = b_npu = b_fb = 0.0
    for g in lp.groups:
        if g.processor == "npu":                       # one graph over its slices, padding too
            c, b = _expert(npu, shape, g.capacity, wb)
            G = len(g.experts)
            t_npu += dispatch_s + npu.kernel_s + max(G * c, G * b / npu.bandwidth)
            b_npu += G * b
            continue
        for e in g.experts:                            # the fallback: a chunk's real rows
            if n[e]:
                c, b = _expert(fb, shape, int(n[e]), wb)
                t_fb += 4 * fb.kernel_s + max(c, b / fb.bandwidth)
                b_fb += b
    t = max(t_npu, t_fb, (b_npu + b_fb) / soc.bandwidth_total)
    return t + (soc.sync_s if t_fb and t_npu else 0.0)


def attention_s(soc: SoC, shape: MoEShape, T: int, pos0: int, wb: dict) -> float:
    npu, s = soc.processors["npu"], shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    t = 0.0
    for op, a in (("linear", {"K": s.dim, "M": q + 2 * kv, "w": ("w4",)}),
                  ("attention", {"heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim}),
                  ("linear", {"K": q, "M": s.dim, "w": ("w4",)})):
        c, b = task_time(npu, op, a, T, pos0, wb)
        t += max(c, b / npu.bandwidth)
    return t


def ablation(soc: SoC, shape: MoEShape, prompt: int = 1024, chunk: int = 256, group_size: int = 8,
             fast_sync: bool = False, weights: str | None = None, seed: int = 0) -> dict:
    """Prefill latency (SIMULATED) of a `prompt`-token prompt in chunks of `chunk` under each
    variant, with the plans' padding and pruned shares on the held-out chunks."""
    if "npu" not in soc.processors:
        raise ValueError(f"{soc.name} has no NPU for NPUMoE's static expert graphs")
    weights = weights or soc.weights
    wb = WEIGHTS[weights]
    row = max(moe.ROW_MULTIPLE, soc.processors["npu"].tile)
    calib, held = calibration(shape, chunk, seed=seed)
    prof = profile(soc, shape, weights, fast_sync)
    dispatch_s = soc.sync_s if fast_sync else soc.sync_copy_s
    n_chunks = -(-prompt // chunk)
    attn = sum(shape.layers * attention_s(soc, shape, chunk, i * chunk, wb) for i in range(n_chunks))
    out = {}
    for name, p in plans(calib, prof, row, group_size).items():
        experts = sum(layer_s(soc, shape, lp, held[i % len(held), lp.layer], wb, dispatch_s)
                      for i in range(n_chunks) for lp in p.layers)
        eff = moe.effects(p, held)
        out[name] = {"prefill_s": attn + experts, "experts_s": experts, "attention_s": attn,
                     "npu_calls_per_chunk": eff["npu_calls_per_chunk"], "padding": eff["padding"],
                     "pruned": eff["pruned"], "fallback": eff["fallback"]}
    return {"simulated": True, "soc": soc.name, "model": shape.name, "prompt": prompt,
            "chunk": chunk, "group_size": group_size, "weights": weights, "fast_sync": fast_sync,
            "fallback": fallback_of(soc), "variants": out,
            "all_vs_base": out["base"]["prefill_s"] / out["all"]["prefill_s"],
            "all_vs_tiers+grouping": out["tiers+grouping"]["prefill_s"] / out["all"]["prefill_s"],
            "published": PUBLISHED}


def table(r: dict) -> str:
    lines = [f"SIMULATED: {r['model']} on {r['soc']} ({r['weights']}, fallback {r['fallback']}, "
             f"{'pool sync' if r['fast_sync'] else 'driver sync'}), prompt {r['prompt']} in chunks "
             f"of {r['chunk']}, groups of {r['group_size']}",
             f"  {'variant':15s} {'prefill s':>9s} {'experts s':>9s} {'calls/chunk':>11s} "
             f"{'padding':>8s} {'pruned':>7s} {'fallback':>8s}"]
    for name, v in r["variants"].items():
        lines.append(f"  {name:15s} {v['prefill_s']:9.3f} {v['experts_s']:9.3f} "
                     f"{v['npu_calls_per_chunk']:11d} {v['padding']:8.1%} {v['pruned']:7.1%} "
                     f"{v['fallback']:8.1%}")
    lines.append(f"  all vs base {r['all_vs_base']:.2f}x (NPUMoE Figure 17, PhiMoE on an M2 Ultra: "
                 f"{PUBLISHED['all_vs_base']}x), all vs tiers+grouping {r['all_vs_tiers+grouping']:.2f}x "
                 f"({PUBLISHED['all_vs_tiers+grouping']}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    from .soc import load_soc, soc_names
    for soc_name in soc_names():
        for m in SHAPES.values():
            for T in (256, 512):
                print(table(ablation(load_soc(soc_name), m, chunk=T)))
