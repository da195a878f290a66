"""MoEfication: a dense `llama` GGUF's FFNs split into experts by calibration on in-repo text
(notes/moe.md §1 and §3; MoEfication, thunlp; LLaMA-MoE's expert construction). The plan is
written as a Mixtral-style GGUF that llama.cpp loads by models/moe_gguf.py.

A gated FFN splits exactly over any partition {S_e} of its neurons:
    D(silu(Gx) * Ux) = sum_e D[:, S_e](silu(G[S_e] x) * U[S_e] x)
so expert e is the rows S_e of ffn_gate / ffn_up (byte copies: a Q4_1 row is one neuron) and the
columns S_e of ffn_down.

Splits: `neurons` clusters all ffn neurons into equal groups by co-activation on calibration text
(balanced spherical k-means; ffn_down's columns are requantized to Q4_1 by GPTQ, models/gptq.py,
one rounding more); `atoms` clusters the aligned 32-neuron blocks instead, so every expert tensor
is a byte copy and k scales each down block's f16 d and m (exactly for a power of two). The router
is a ridge fit of each token's expert shares, s_e = sum over S_e of |silu(g_i) u_i| |D[:, i]|, on
the ffn_norm output (a linear stand-in for MoEfication's MLP router). Deterministic: fixed seeds,
stable sorts, f64 solves.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from .llama import load_config, load_weights
from .oracle import Oracle
from .tokenizer import Tokenizer

SPLITS = ("neurons", "atoms")
ATOM = 32                 # neurons in a Q4_1 block of ffn_down's rows: the `atoms` unit
TOP_SHARE = 0.25          # split_layer: a unit is active among a token's top quarter
RIDGE = 1e-3              # the ridge's lambda, relative to the mean of diag(X^T X)
KMEANS_ITERS = 25
WINDOW = 512              # calibration tokens run through the oracle at once
CALIBRATION = Path(__file__).parent.parent / "scripts" / "data" / "pride_and_prejudice_ch3-6.txt"
F32 = np.float32


@dataclass(frozen=True)
class ExpertLayer:
    groups: np.ndarray    # [E, n_ff_e] int: expert e's neurons, ascending (down's column order)
    router: np.ndarray    # [E, dim] f64: the ridge router, before tau
    spread: float         # the largest (max - min) of its logits over calibration tokens
    recall: np.ndarray    # [E] f64: at k = 1..E, the calibration score mass of the router's top k
                          # over that of the best k (MoEfication's metric; held-in data)
    hess: np.ndarray | None = None   # [E, n_ff, n_ff] f64: sum over tokens of h h^T per expert,
                                     # dampened (GPTQ's H; neurons split only)


def check_args(ffn_dim: int, experts: int, top_k: int, split: str) -> None:
    """Raise ValueError (one line) for a build llama.cpp or Q4_1 cannot hold."""
    if split not in SPLITS:
        raise ValueError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if experts < 2 or ffn_dim % experts or (ffn_dim // experts) % ATOM:
        ok = [e for e in range(2, ffn_dim // ATOM + 1) if ffn_dim % (e * ATOM) == 0]
        raise ValueError(f"--experts {experts} does not split ffn {ffn_dim} into experts of a "
                         f"multiple of {ATOM} neurons (choose one of {ok})")
    if not 0 < top_k <= experts:
        raise ValueError(f"--top-k must be in [1, {experts}], got {top_k}")


def calibration_ids(tok: Tokenizer, tokens: int) -> list[int]:
    ids = tok.encode(CALIBRATION.read_text())
    if not 0 < tokens <= len(ids):
        raise ValueError(f"--tokens must be in [1, {len(ids)}] (the calibration text "
                         f"{CALIBRATION.name}), got {tokens}")
    return ids[:tokens]


def calibrate(oracle: Oracle, ids: list[int], bar=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run ids through the dense oracle in WINDOW-token windows, each from an empty cache.
    -> per layer (X [N, dim]: the ffn_norm outputs, H [N, ffn]: silu(gate) * up), f32."""
    L = oracle.cfg.n_layers
    xs, acts = [[] for _ in range(L)], [[] for _ in range(L)]

    def tap(i, name, v):
        if name == "ffn_in":
            xs[i].append(np.array(v, F32))
        elif name == "ffn_act":
            acts[i].append(np.array(v, F32))

    starts = range(0, len(ids), WINDOW)
    oracle.tap = tap
    try:
        for n, s in enumerate(starts):
            w = ids[s: s + WINDOW]
            oracle.forward(w, 0, oracle.new_cache(len(w)))
            bar and bar("calibrating", n + 1, len(starts))
    finally:
        oracle.tap = None
    return [(np.concatenate(xs[i]), np.concatenate(acts[i])) for i in range(L)]


def balanced_assign(sim: np.ndarray, size: int) -> np.ndarray:
    """sim [n, E] -> labels [n]: the most similar (point, cluster) pair first, every cluster
    taking `size` points (n = E * size); equal similarities in flat-index order."""
    n, E = sim.shape
    labels, room, left = np.full(n, -1), np.full(E, size), n
    for f in np.argsort(-sim, axis=None, kind="stable"):
        i, e = divmod(int(f), E)
        if labels[i] < 0 and room[e]:
            labels[i], room[e], left = e, room[e] - 1, left - 1
            if not left:
                break
    return labels


def balanced_kmeans(F: np.ndarray, E: int, seed) -> np.ndarray:
    """Unit rows F [n, d] -> groups [E, n/E] of row ids (spherical k-means with equal sizes),
    each ascending; experts ordered by their smallest id."""
    n = len(F)
    C = F[np.sort(np.random.default_rng(seed).choice(n, E, replace=False))]      # [E, d]
    labels = None
    for _ in range(KMEANS_ITERS):
        new = balanced_assign(F @ C.T, n // E)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        C = np.eye(E)[labels].T @ F                                    # [E, d]: sums
        C /= np.maximum(np.linalg.norm(C, axis=1, keepdims=True), 1e-30)
    groups = [np.flatnonzero(labels == e) for e in range(E)]
    return np.stack(sorted(groups, key=lambda g: g[0]))


def _unit_rows(P: np.ndarray) -> np.ndarray:
    P = np.asarray(P, np.float64)
    return P / np.maximum(np.linalg.norm(P, axis=1, keepdims=True), 1e-30)


def split_layer(A: np.ndarray, E: int, split: str, seed) -> np.ndarray:
    """Importances A [N, ffn] -> groups [E, ffn/E] of neuron ids: units (neurons, or atoms of
    32) clustered by co-activation, a unit being active for a token when it is among the token's
    TOP_SHARE most important (MoEfication's co-activation graph, as k-means on these 0/1
    profiles). On SmolLM2's dense SiLU activations the raw magnitudes let a few loud tokens
    decide: with them (and raw router targets) a masked FFN of k = 4 of 16 had 6x this
    perplexity, 8 of 16 1.7x (one calibration window)."""
    N, ffn = A.shape
    units = A if split == "neurons" else A.reshape(N, ffn // ATOM, ATOM).sum(2)  # [N, n]
    m = max(1, int(units.shape[1] * TOP_SHARE))
    active = units >= -np.sort(-units, axis=1)[:, m - 1:m]                    # [N, n] bool
    groups = balanced_kmeans(_unit_rows(active.T), E, seed)
    if split == "neurons":
        return groups
    return (groups[:, :, None] * ATOM + np.arange(ATOM)).reshape(E, -1)   # [E, atoms * 32]


def fit_router(X: np.ndarray, S: np.ndarray) -> np.ndarray:
    """Ridge regression of expert scores S [N, E] on router inputs X [N, dim] -> W [E, dim] f64.
    The target is each token's shares S / sum(S), centred: routing needs a token's ranking, not
    its loudness (raw scores let the attention sinks dominate the fit), and softmax and top-k
    ignore a shift common to all experts, which would only cost the logits f32 precision."""
    X = np.asarray(X, np.float64)
    S = np.asarray(S, np.float64)
    S = S / np.maximum(S.sum(axis=1, keepdims=True), 1e-30)
    S = S - S.mean(axis=1, keepdims=True)
    G = X.T @ X
    lam = RIDGE * np.trace(G) / len(G)
    return np.linalg.solve(G + lam * np.eye(len(G)), X.T @ S).T


def recall_by_k(S: np.ndarray, z: np.ndarray) -> np.ndarray:
    """S, z [N, E] -> [E]: mean over tokens of sum(S over z's top k) / sum(S's own top k)."""
    got = np.cumsum(np.take_along_axis(S, np.argsort(-z, axis=1, kind="stable"), 1), axis=1)
    best = np.cumsum(-np.sort(-S, axis=1), axis=1)
    return (got / np.maximum(best, 1e-30)).mean(axis=0)


def plan_layer(X: np.ndarray, H: np.ndarray, down_norm: np.ndarray, E: int, split: str,
               seed) -> ExpertLayer:
    """X [N, dim] router inputs, H [N, ffn] activations, down_norm [ffn] = |D[:, i]| -> the
    layer's experts and router."""
    A = np.abs(H) * down_norm                     # [N, ffn]: a bound on neuron i's output share
    groups = split_layer(A, E, split, seed)
    S = A[:, groups].sum(axis=2, dtype=np.float64)                      # [N, E] expert scores
    W = fit_router(X, S)                                                # [E, dim]
    z = np.asarray(X, np.float64) @ W.T                                 # [N, E]
    hess = None
    if split == "neurons":                        # what GPTQ needs to requantize down's columns
        Hg = np.asarray(H, np.float64)[:, groups]                       # [N, E, n_ff]
        hess = np.einsum("tei,tej->eij", Hg, Hg)                        # [E, n_ff, n_ff]
        # GPTQ's dampening, more where few tokens estimate many columns (256 tokens for 192
        # columns: GPTQ at 1 % rounds worse than min-max; at 4096 tokens 1-2 % is best)
        n = Hg.shape[2]
        damp = min(1.0, max(0.01, n / len(Hg)))
        hess += damp * np.einsum("eii->e", hess)[:, None, None] / n * np.eye(n)
    return ExpertLayer(groups, W, float((z.max(1) - z.min(1)).max()),
                       recall_by_k(S, z), hess)


def plan(path: str, experts: int, split: str, tokens: int, seed: int = 0, bar=None) -> dict:
    """Calibrate the dense model at `path` and split every layer: {"layers", "meta"}."""
    from .gguf_file import open_gguf
    reader = open_gguf(path)
    cfg = load_config(reader)
    if cfg.arch != "llama" or cfg.n_experts or cfg.post_norms or cfg.act != "silu":
        raise ValueError(f"moefy needs a dense llama-arch GGUF, not {cfg.arch}"
                         f"{' (already MoE)' if cfg.n_experts else ''}: {path}")
    for name in ("ffn_gate", "ffn_up", "ffn_down"):
        kind = next(t.tensor_type.name for t in reader.tensors if t.name == f"blk.0.{name}.weight")
        if kind != "Q4_1":
            raise ValueError(f"moefy reads Q4_1 FFN matrices; {name} is {kind}: {path}")
    check_args(cfg.ffn_dim, experts, 1, split)
    ids = calibration_ids(Tokenizer(reader), tokens)
    acts = calibrate(Oracle(cfg, load_weights(reader, cfg)), ids, bar)
    T = {t.name: t for t in reader.tensors}
    layers = []
    for i in range(cfg.n_layers):
        X, H = acts[i]
        acts[i] = None                                                  # free as we go
        D = dequantize(np.asarray(T[f"blk.{i}.ffn_down.weight"].data), Q.Q4_1)   # [dim, ffn]
        layers.append(plan_layer(X, H, np.linalg.norm(D, axis=0), experts, split, (seed, i)))
        bar and bar("splitting", i + 1, cfg.n_layers)
    meta = {"source_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
            "calibration_text": CALIBRATION.name, "calibration_tokens": len(ids),
            "split": split, "seed": seed}
    return {"layers": layers, "meta": meta}


def stderr_bar(label: str, i: int, n: int, width: int = 30) -> None:
    """A one-line progress bar on stderr, ended at i == n."""
    full = width * i // n
    sys.stderr.write(f"\rmoefy: {label:<12}[{'#' * full}{' ' * (width - full)}] {i}/{n}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()
