"""Offline calibration of a mixture-of-experts GGUF (NPUMoE §3.3, §5.8): what its router does on
real text, measured once through the numpy oracle and kept as JSON beside socllm's other caches.

For a prefill chunk of T tokens and every layer l and expert e it records the routed (token, slot)
pairs n_{l,e} of each chunk (their mean and p95 over chunks), the popularity pi_{l,e} (e's share of
the layer's pairs), the imbalance rho_l = max_e mean n_{l,e} / (T*k/E) (§4.1; 1 is balanced) and
the saliency distribution, the L2 norm of each token's attention output (§3.2, what overflow
pruning ranks by). Its accuracy is NPUMoE's (§5.8): per layer, Overlap@K between the top-K popular
experts of the calibration text and those of a disjoint held-out part of it, and the median over
layers. policies/moe.py turns the result into capacity tiers, groups and residency.

The text is one long prompt, prefilled in chunks of T from an empty cache (started again at the
model's context): chunk c is tokens c*T .. c*T+T-1, and only whole chunks count, so every chunk
routes exactly T*k pairs in every layer.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .gguf_file import ModelError, _sha256, open_gguf
from .llama import load_config, load_weights
from . import oracle as oracle_module
from .oracle import Oracle
from .tokenizer import Tokenizer

TEXT = Path(__file__).parents[1] / "scripts" / "data" / "pride_and_prejudice_ch1-2.txt"
VERSION = 2
OVERLAP_K = (4, 8)                      # NPUMoE §5.8 reports top-4 and top-8
SALIENCY_Q = (5, 25, 50, 75, 95)        # percentiles of ||attn_out||_2 kept per layer


def calibrate(path: str, tokens: int = 1024, chunk: int = 128, cache_dir: str | None = None,
              text_file: str | None = None, skip: int = 0, refresh: bool = False) -> dict:
    """The calibration of the GGUF at `path` on `tokens` tokens of `text_file` (default: TEXT)
    after its first `skip` (tokens a router was fitted on, say), held out against up to as many
    tokens after them; from the cache when `cache_dir`/moe holds it (keyed by the file's sha256,
    T, N, skip, the text's and the oracle's). The returned dict is the JSON, plus "cache":
    {"path", "hit"} (not stored)."""
    if tokens < 1 or chunk < 1 or skip < 0:
        raise ValueError(f"--tokens and --chunk must be positive and --skip not negative, got "
                         f"{tokens}, {chunk} and {skip}")
    reader = open_gguf(path)
    cfg = load_config(reader)
    if not cfg.n_experts:
        raise ModelError(f"not a mixture-of-experts model: {path} (no {cfg.arch}.expert_count)")
    text_file = Path(text_file or TEXT)
    try:
        text = text_file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the calibration text {text_file}: {e}") from None
    text_sha = hashlib.sha256(text.encode()).hexdigest()
    gguf_sha = _sha256(path)
    cache = None
    if cache_dir:
        # the oracle's source too: a change to how it routes (ties, the rule) is a new calibration
        oracle_sha = hashlib.sha256(Path(oracle_module.__file__).read_bytes()).hexdigest()
        cache = (Path(cache_dir) / "moe" /
                 f"{gguf_sha}-T{chunk}-N{tokens}-S{skip}-{text_sha[:12]}-{oracle_sha[:8]}.json")
        if not refresh:
            hit = _read(cache)
            if hit is not None:
                return {**hit, "cache": {"path": str(cache), "hit": True}}
    ids = Tokenizer(reader).encode(text)[skip:]
    n_cal = min(tokens, len(ids) // 2) // chunk * chunk        # whole chunks; half the text at most
    n_held = min(tokens, len(ids) - n_cal) // chunk * chunk
    if n_cal == 0 or n_held == 0:
        raise ValueError(f"the text has {len(ids)} tokens after --skip: too few for a calibration chunk and a "
                         f"held-out chunk of {chunk}")
    window = cfg.context_length // chunk * chunk
    if window == 0:
        raise ValueError(f"--chunk {chunk} exceeds the model's context of {cfg.context_length}")
    oracle = Oracle(cfg, load_weights(reader, cfg))
    cal_counts, cal_sal = route_counts(oracle, ids[:n_cal], chunk, window)
    held_counts, _ = route_counts(oracle, ids[n_cal:n_cal + n_held], chunk, window)
    out = summarize(cal_counts, held_counts, cal_sal, cfg.n_experts_used)
    out = {"version": VERSION, "model": os.path.basename(path), "gguf_sha256": gguf_sha,
           "arch": cfg.arch, "n_layers": cfg.n_layers, "n_experts": cfg.n_experts,
           "top_k": cfg.n_experts_used, "dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "chunk": chunk,
           "text": {"file": text_file.name, "sha256": text_sha, "tokens": skip + len(ids), "skip": skip},
           "calibration": {"first_token": skip, "tokens": n_cal, "chunks": n_cal // chunk},
           "heldout": {"first_token": skip + n_cal, "tokens": n_held, "chunks": n_held // chunk},
           **out}
    if cache is not None:
        _write(cache, out)
    return {**out, "cache": {"path": str(cache) if cache else None, "hit": False}}


def route_counts(oracle: Oracle, ids: list[int], chunk: int, window: int):
    """Prefill ids in chunks of `chunk` (a fresh cache every `window` tokens) -> (counts
    [C, L, E] int: routed pairs per chunk, layer and expert; saliency [L, C*chunk] f32:
    ||attn_out||_2 of every token)."""
    cfg = oracle.cfg
    n = len(ids) // chunk
    counts = np.zeros((n, cfg.n_layers, cfg.n_experts), np.int64)
    sal = np.zeros((cfg.n_layers, n * chunk), np.float32)
    seen = {}

    def tap(layer, name, value):
        if name in ("attn_out", "moe_sel"):
            seen[layer, name] = value

    oracle.tap = tap
    try:
        kv = None
        for c in range(n):
            pos0 = c * chunk % window
            if pos0 == 0:
                kv = oracle.new_cache(window)
            oracle.forward(ids[c * chunk:(c + 1) * chunk], pos0, kv)
            for layer in range(cfg.n_layers):
                counts[c, layer] = np.bincount(seen[layer, "moe_sel"].ravel(), minlength=cfg.n_experts)
                sal[layer, c * chunk:(c + 1) * chunk] = np.linalg.norm(seen[layer, "attn_out"], axis=1)
    finally:
        oracle.tap = None
    return counts, sal


def summarize(counts: np.ndarray, held: np.ndarray, sal: np.ndarray, k: int) -> dict:
    """counts [C, L, E] and held [C', L, E] routed pairs per chunk, sal [L, N] -> the per-layer
    statistics and Overlap@K of the JSON."""
    C, L, E = counts.shape
    T = int(counts[0, 0].sum()) // k                    # tokens a chunk
    mean, p95 = counts.mean(0), np.percentile(counts, 95, axis=0)       # [L, E] each
    ks = [K for K in OVERLAP_K if K < E]                # K = E overlaps trivially
    layers = []
    for layer in range(L):
        tot, tot_held = counts[:, layer].sum(0), held[:, layer].sum(0)  # [E] each
        q = np.percentile(sal[layer], SALIENCY_Q)
        layers.append({
            "layer": layer,
            "mean": _round(mean[layer]), "p95": _round(p95[layer]),
            "popularity": _round(tot / tot.sum(), 5),
            "heldout_popularity": _round(tot_held / tot_held.sum(), 5),
            "rho": round(float(mean[layer].max() / (T * k / E)), 4),
            "rho_p95": round(float(p95[layer].max() / (T * k / E)), 4),
            "saliency": {"mean": round(float(sal[layer].mean()), 5),
                         **{f"p{p}": round(float(v), 5) for p, v in zip(SALIENCY_Q, q)}},
            "overlap": {str(K): overlap_at(tot, tot_held, K) for K in ks},
        })
    per_k = {str(K): [x["overlap"][str(K)] for x in layers] for K in ks}
    return {"overlap_median": {K: float(np.median(v)) for K, v in per_k.items()},
            "overlap_mean": {K: round(float(np.mean(v)), 4) for K, v in per_k.items()},
            "layers": layers, "counts": counts.tolist(), "heldout_counts": held.tolist()}


def top_experts(n: np.ndarray, K: int) -> np.ndarray:
    """The K most routed experts of counts n [E] (ties: the lower id)."""
    return np.argsort(-np.asarray(n), kind="stable")[:K]


def overlap_at(a: np.ndarray, b: np.ndarray, K: int) -> float:
    """Overlap@K (NPUMoE §5.8): the share of a's top-K experts that are among b's top K."""
    return len(set(top_experts(a, K).tolist()) & set(top_experts(b, K).tolist())) / K


def _round(x: np.ndarray, digits: int = 3) -> list:
    return [round(float(v), digits) for v in x]


def _read(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None                    # none yet, or damaged: calibrate again
    return d if d.get("version") == VERSION else None


def _write(path: Path, d: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d))
        os.replace(tmp, path)          # atomic: a concurrent run never reads half a file
    except OSError:
        pass                           # a read-only cache only costs a calibration next time
