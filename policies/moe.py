"""Mixture-of-experts on static-shape graphs (NPUMoE §4): capacity tiers, dispatch into a grouped
buffer with an overflow policy, grouped expert graphs and their residency. Pure decisions from a
calibration (models/calibrate.py's JSON) and a device profile: numpy only, no kernels.

A layer's static buffer is its groups' slices one after another: group g of G experts at tier C is
[G*C, dim], expert i of it rows i*C .. i*C+C-1 (§4.2). The CPU sorts a chunk's (token, slot) pairs
by expert and saliency, packs each expert's first C rows, and scatter-adds the outputs back times
their routing weights; an expert's pairs beyond C are its overflow:
  prune  dropped, the lowest-saliency ones (§3.2); they contribute 0, other weights unchanged
  spill  run on the fallback processor (CPU/GPU) beside the graph: exact
  pad    the capacity raised to fit this chunk (§4.1's "padding" alternative): exact
Experts a plan leaves on the fallback (cold ones, §4.3) have no rows: all their pairs run there.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

OVERFLOW = ("prune", "spill", "pad")
TIER_FACTORS = (0.5, 1, 2, 4)       # x C_base (§4.1: the top quartile gets 4x base capacity)
GROUP_SIZES = (4, 8, 16)            # §4.2's configurations
ROW_MULTIPLE = 16                   # §3.2: sizes that are multiples of 16 run best on the NPU
# A device profile: per processor the cost of one call of an expert graph, of each row it
# computes (one expert's FFN on one token) and optionally of streaming one expert's weights
# (ms_per_expert); the NPU's budget for resident expert weights and the
# largest graph it keeps (NPUMoE §4.2: over ~1.2 GB an M2 Ultra falls back to the CPU).
EXAMPLE_PROFILE = {"npu": {"launch_ms": 0.5, "ms_per_row": 0.002},
                   "fallback": {"launch_ms": 0.02, "ms_per_row": 0.01},
                   "npu_mb": 1024.0, "graph_mb": 1200.0, "max_graphs": 256, "bytes_per_weight": 2}


def round_up(n: float, m: int) -> int:
    return int(math.ceil(n / m) * m)


def capacity_tiers(p95, rho: float, T: int, k: int, row: int = ROW_MULTIPLE):
    """p95 [E] routed pairs a chunk of T tokens, the layer's imbalance rho -> (the tiers, sorted,
    and cap [E] int): C_base = ceil(T*k/E); tiers {C_base/2, C_base, 2, 4 C_base} capped at
    ceil(rho*C_base) and rounded up to `row`; each expert the smallest tier >= its p95 (the
    largest when none is)."""
    p95 = np.asarray(p95, float)
    base = math.ceil(T * k / len(p95))
    top = math.ceil(rho * base)
    tiers = sorted({round_up(max(1, min(math.ceil(f * base), top)), row) for f in TIER_FACTORS})
    t = np.asarray(tiers)
    cap = t[np.minimum(np.searchsorted(t, p95), len(t) - 1)]
    return tiers, cap.astype(np.int64)


@dataclass
class Dispatch:
    """Where a chunk's (token, slot) pairs go. Pairs are (t, j): token t's j-th expert sel[t, j]."""
    token: np.ndarray            # [R] the pairs packed into the static buffer
    slot: np.ndarray             # [R]
    row: np.ndarray              # [R] their rows in the buffer
    rows: int                    # the buffer's rows: sum of capacities (padding included)
    fallback_token: np.ndarray   # [S] pairs run on the fallback processor (spilled, cold experts)
    fallback_slot: np.ndarray    # [S]
    dropped_token: np.ndarray    # [D] pairs pruned: they contribute 0
    dropped_slot: np.ndarray     # [D]
    cap: np.ndarray              # [E] the capacities used (pad: raised to fit)


def dispatch(sel, sal, cap, overflow: str = "prune", base=None, static=None) -> Dispatch:
    """sel [T, k] expert ids, sal [T] saliency, cap [E] rows per expert -> a Dispatch. base [E]:
    each expert's first row (default: the caps one after another in expert order; pad ignores
    it); static [E] bool: experts with rows in the buffer (default all; the rest run on the
    fallback). Within an expert the most salient pairs come first (ties: the earlier token)."""
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
    sel, sal = np.asarray(sel), np.asarray(sal)
    T, k = sel.shape
    E = len(cap)
    static = np.ones(E, bool) if static is None else np.asarray(static, bool)
    cap = np.where(static, np.asarray(cap, np.int64), 0)
    if overflow == "pad":
        cap = np.where(static, np.maximum(cap, np.bincount(sel.ravel(), minlength=E)), 0)
        base = None
    base = np.concatenate([[0], np.cumsum(cap)[:-1]]) if base is None else np.asarray(base)
    e, t = sel.ravel(), np.repeat(np.arange(T), k)
    o = np.lexsort((np.arange(T * k), -sal[t], e))        # by expert, saliency desc, position
    e, t, j = e[o], t[o], o % k
    rank = np.arange(T * k) - np.searchsorted(e, e)        # position within its expert
    keep = rank < cap[e]
    off = ~keep & (~static[e] | (overflow == "spill"))
    drop = ~keep & ~off
    return Dispatch(t[keep], j[keep], base[e[keep]] + rank[keep], int(cap.sum()),
                    t[off], j[off], t[drop], j[drop], cap)


def combine(buf_out, fallback_out, w, d: Dispatch) -> np.ndarray:
    """The layer's output [T, dim]: the buffer's rows buf_out [rows, dim] and the fallback's
    fallback_out [S, dim] (in d's order) scattered back, y_t = sum over j in rank order of
    w[t, j] * out(t, j), as the oracle sums (dropped pairs: 0)."""
    T, k = w.shape
    y = np.zeros((T, k, buf_out.shape[1]), buf_out.dtype)          # [T, k, dim]
    y[d.token, d.slot] = buf_out[d.row]
    y[d.fallback_token, d.fallback_slot] = fallback_out
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, k):
        out = out + w[:, j, None] * y[:, j]
    return out


def assemble(y, w, sel, sal, cap, overflow: str = "prune", **kw) -> np.ndarray:
    """The layer's output [T, dim] under a policy, from the exact outputs y [T, k, dim] of every
    pair: the grouped graphs' buffer (padding rows give 0: SwiGLU has no bias) and the fallback's
    rows are filled from y, then combined. With caps >= the true counts it equals exact routing;
    spill and pad always do."""
    d = dispatch(sel, sal, cap, overflow, **kw)
    buf = np.zeros((d.rows, y.shape[2]), y.dtype)                  # [rows, dim]
    buf[d.row] = y[d.token, d.slot]
    return combine(buf, y[d.fallback_token, d.fallback_slot], np.asarray(w), d)


@dataclass
class Group:
    """One grouped expert graph (§4.2): same-tier experts on one dense [G*C, dim] input."""
    experts: list            # hottest first
    capacity: int            # C: rows per expert
    expected_rows: float     # mean routed pairs a chunk, over its experts (calibration)
    processor: str = "npu"   # "npu" or "fallback" (§4.3)


def group_experts(cap, mean, size: int, max_size: int | None = None) -> list:
    """Experts of one tier together, by expected load (hot with hot, cold with cold, §4.3),
    `size` a graph (fewer in a tier's last one); max_size: the most one graph may hold (its
    weights' bytes). Tiers from the largest down."""
    cap, mean = np.asarray(cap), np.asarray(mean, float)
    size = min(size, max_size or size)
    groups = []
    for c in sorted(set(cap.tolist()), reverse=True):
        ids = np.flatnonzero(cap == c)
        ids = ids[np.argsort(-mean[ids], kind="stable")]
        for i in range(0, len(ids), max(1, size)):
            g = ids[i:i + max(1, size)]
            groups.append(Group(g.tolist(), int(c), round(float(mean[g].sum()), 3)))
    return groups


def call_ms(g: Group, profile: dict) -> tuple:
    """(ms on the NPU, ms on the fallback) of a group a chunk: the NPU's one call (launch, then
    every row of its slices, padding included) against the fallback's calls, one an expert, on
    the rows it would really get. A call's work is a roofline: its rows' compute against
    streaming its experts' weights (ms_per_expert, 0 when the profile leaves it out)."""
    npu, fb = profile["npu"], profile["fallback"]
    G = len(g.experts)
    return (npu["launch_ms"] + max(G * npu.get("ms_per_expert", 0), npu["ms_per_row"] * G * g.capacity),
            G * fb["launch_ms"] + max(G * fb.get("ms_per_expert", 0), fb["ms_per_row"] * g.expected_rows))


def place(layers: list, profile: dict, expert_bytes: int) -> None:
    """Residency (§4.3) of every layer's groups ([[Group]], a list a layer); sets each group's
    processor. In a layer the fallback runs beside the NPU, so the coldest groups move to it
    while that shortens the layer (its NPU calls against the fallback's, the longer of the
    two): a group whose launch its rows do not amortise goes, hot groups stay. Then the hottest
    NPU groups of all layers keep their place while they fit the NPU's memory and graph
    budgets; the rest run on the fallback too."""
    for groups in layers:
        ms = {id(g): call_ms(g, profile) for g in groups}
        npu, fb = sum(m[0] for m in ms.values()), 0.0
        for g in sorted(groups, key=lambda g: g.expected_rows):
            a, b = ms[id(g)]
            if max(npu - a, fb + b) < max(npu, fb):
                g.processor, npu, fb = "fallback", npu - a, fb + b
            else:
                g.processor = "npu"
    mb, graphs = 0.0, 0
    kept = [g for groups in layers for g in groups if g.processor == "npu"]
    for g in sorted(kept, key=lambda g: -g.expected_rows):
        size = len(g.experts) * expert_bytes / 2**20
        if mb + size <= profile["npu_mb"] and graphs < profile["max_graphs"]:
            mb, graphs = mb + size, graphs + 1
        else:
            g.processor = "fallback"


@dataclass
class LayerPlan:
    layer: int
    rho: float
    tiers: list                  # the layer's capacities, ascending
    cap: list                    # [E] each expert's tier
    groups: list = field(default_factory=list)   # [Group]

    def layout(self):
        """(base [E]: each expert's first row, static [E] bool: experts with rows, rows)."""
        E = len(self.cap)
        base, static, row = np.zeros(E, np.int64), np.zeros(E, bool), 0
        for g in self.groups:
            if g.processor != "npu":
                continue
            for i, e in enumerate(g.experts):
                base[e], static[e] = row + i * g.capacity, True
            row += len(g.experts) * g.capacity
        return base, static, row


@dataclass
class MoEPlan:
    """The MoE half of a plan: what `socllm plan` prints and the runtime lays graphs out by."""
    gguf_sha256: str
    chunk: int                   # T: tokens a prefill chunk
    top_k: int
    n_experts: int
    overflow: str                # one of OVERFLOW
    row_multiple: int
    group_size: int
    tiers: bool                  # False: every expert at one capacity (ablation "base")
    expert_mb: float             # one expert's weights on the NPU
    layers: list = field(default_factory=list)   # [LayerPlan]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "MoEPlan":
        d = json.loads(s)
        d["layers"] = [LayerPlan(**{**x, "groups": [Group(**g) for g in x["groups"]]})
                       for x in d["layers"]]
        return cls(**d)


def plan(calib: dict, profile: dict = EXAMPLE_PROFILE, overflow: str = "prune",
         group_size: int = 8, row: int = ROW_MULTIPLE, tiers: bool = True,
         residency: bool = True, capacity: int | None = None) -> MoEPlan:
    """A MoEPlan from a calibration (models/calibrate.py) and a device profile. tiers False:
    every expert at `capacity` (default the largest tier); group_size 1: a graph per expert;
    residency False: every group on the NPU."""
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW)}, got {overflow!r}")
    T, k, E = calib["chunk"], calib["top_k"], calib["n_experts"]
    expert_bytes = 3 * calib["dim"] * calib["ffn_dim"] * profile.get("bytes_per_weight", 2)
    max_size = max(1, int(profile["graph_mb"] * 2**20 // expert_bytes))
    layers = []
    for x in calib["layers"]:
        ts, cap = capacity_tiers(x["p95"], x["rho"], T, k, row)
        if not tiers:
            c = capacity or ts[-1]
            ts, cap = [c], np.full(E, c)
        lp = LayerPlan(x["layer"], x["rho"], ts, cap.tolist(),
                       group_experts(cap, x["mean"], group_size, max_size))
        layers.append(lp)
    if residency:
        place([lp.groups for lp in layers], profile, expert_bytes)
    return MoEPlan(calib["gguf_sha256"], T, k, E, overflow, row, group_size, tiers,
                   round(expert_bytes / 2**20, 3), layers)


def effects(p: MoEPlan, counts) -> dict:
    """The plan's measured effects on routed counts [C, L, E] (a calibration's "counts" or,
    out of sample, "heldout_counts"): padding (of the rows the static graphs compute, the share
    that is padding; NPUMoE §5.8 measured 35.35 %), pruned / spilled (of all routed pairs, the
    overflow dropped / sent to the fallback), fallback (pairs of experts left on the fallback)
    and NPU calls a chunk."""
    counts = np.asarray(counts)
    computed = padding = over = cold = 0
    for lp in p.layers:
        _, static, _ = lp.layout()
        cap = np.asarray(lp.cap)
        n = counts[:, lp.layer]                                          # [C, E]
        c = np.maximum(cap, n) if p.overflow == "pad" else np.broadcast_to(cap, n.shape)
        computed += int(c[:, static].sum())
        padding += int((c - np.minimum(n, c))[:, static].sum())
        over += int(np.maximum(n - c, 0)[:, static].sum())
        cold += int(n[:, ~static].sum())
    pairs = int(counts.sum())
    calls = sum(g.processor == "npu" for lp in p.layers for g in lp.groups)
    return {"padding": padding / max(computed, 1),
            "pruned": over / pairs if p.overflow == "prune" else 0.0,
            "spilled": over / pairs if p.overflow == "spill" else 0.0,
            "fallback": cold / pairs, "npu_calls_per_chunk": calls,
            "npu_rows_per_chunk": computed / len(counts)}
