"""The numpy fp32 oracle: the plain Llama math, written out once, to check every backend against.

It shares nothing with the engine but the weights' file: its own dequantized float32 copy (the
only fp32 copy of the weights anywhere in socllm), its own KV cache, its own attention. Slow and
obvious on purpose: every backend's logits and greedy tokens are compared to these.
"""
from __future__ import annotations

import numpy as np

from .llama import ModelConfig
from .quant import dequant_float, dequant_planar, dequant_q8_0

F32 = np.float32


class KVCache:
    """Keys and values of every position seen so far, per layer."""

    def __init__(self, cfg: ModelConfig, ctx: int):
        self.k = np.zeros((cfg.n_layers, ctx, cfg.kv_dim), F32)  # [L, ctx, kv_heads*head_dim]
        self.v = np.zeros((cfg.n_layers, ctx, cfg.kv_dim), F32)  # [L, ctx, kv_heads*head_dim]


class Oracle:
    def __init__(self, cfg: ModelConfig, weights: dict):
        self.cfg = cfg
        # tap(layer, name, value): sees the layer's intermediates (calibration, models/moefy.py):
        # "attn_out" [T, dim] (the attention's output, before the residual add), "ffn_in" [T, dim]
        # (the ffn_norm output), and "ffn_act" [T, ffn] (a dense layer's gate*up) or "moe_logits"
        # [T, E] and "moe_sel" [T, k] (an MoE layer's router logits and chosen experts)
        self.tap = None
        # moe_assemble(layer, y [T, k, dim], w [T, k], sel [T, k], sal [T]) -> [T, dim]: an MoE
        # layer's output from every pair's exact expert output under a policy (NPUMoE's pruning:
        # scripts/moe_ppl.py; policies/moe.py assemble); None: exact routing's weighted sum
        self.moe_assemble = None
        w = {name: _dequant(t) for name, t in weights.items()}  # matrices [out, in], vectors [n]
        self.embd = w["token_embd.weight"]                                  # [vocab, dim]
        self.lm_head = self.embd if cfg.tied_embeddings else w["output.weight"]  # [vocab, dim]
        self.out_norm = w["output_norm.weight"]                             # [dim]
        self.layers = [{k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"blk.{i}.")}
                       for i in range(cfg.n_layers)]
        half = cfg.head_dim // 2
        # theta_i = base^(-2i/head_dim); computed in f64 so the angles at large pos stay exact.
        # One set per rope base (Gemma 3's sliding-window layers have their own).
        self.inv_freq = {}
        for theta in {cfg.layer_theta(i) for i in range(cfg.n_layers)}:
            inv = theta ** (-np.arange(half, dtype=np.float64) * 2 / cfg.head_dim)
            if cfg.rope_freqs:                              # Llama 3.1's per-pair divisors
                inv = inv / w["rope_freqs.weight"].astype(np.float64)
            self.inv_freq[theta] = inv

    def new_cache(self, ctx: int) -> KVCache:
        return KVCache(self.cfg, ctx)

    def forward(self, ids: list[int], pos0: int, kv: KVCache) -> np.ndarray:
        """Run `ids` at positions pos0.. (filling kv); logits of the last position [vocab]."""
        return self._hidden(ids, pos0, kv)[-1] @ self.lm_head.T

    def logits_for(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits of every position [len(ids), vocab], from an empty cache."""
        return self._hidden(ids, 0, self.new_cache(len(ids))) @ self.lm_head.T

    def greedy(self, prompt_ids: list[int], n_new: int) -> list[int]:
        """The argmax continuation: n_new ids after the prompt (no early stop at EOS)."""
        kv = self.new_cache(len(prompt_ids) + n_new)
        logits, pos, out = self.forward(prompt_ids, 0, kv), len(prompt_ids), []
        for _ in range(n_new):
            out.append(int(np.argmax(logits)))
            logits, pos = self.forward(out[-1:], pos, kv), pos + 1
        return out

    def _hidden(self, ids: list[int], pos0: int, kv: KVCache) -> np.ndarray:
        """Final-normed hidden states [T, dim] of ids at positions pos0..pos0+T-1."""
        c = self.cfg
        x = self.embd[np.asarray(ids)] * F32(c.embed_scale)  # [T, dim]
        angles = {theta: self._rope_angles(inv, pos0, len(ids)) for theta, inv in self.inv_freq.items()}
        gate = _silu if c.act == "silu" else _gelu
        for i, lw in enumerate(self.layers):
            cos, sin = angles[c.layer_theta(i)]              # [T, head_dim/2] each
            a = self._attention(i, lw, _rmsnorm(x, lw["attn_norm.weight"], c.eps), pos0, cos, sin, kv)
            # NPUMoE's saliency: the L2 norm of a row's attention output (graph/build.py _moe)
            sal = np.linalg.norm(a, axis=1) if self.moe_assemble else None     # [T]
            if c.post_norms:                                 # Gemma: the sublayer's output normed
                a = _rmsnorm(a, lw["post_attention_norm.weight"], c.eps)
            x = x + a
            h = _rmsnorm(x, lw["ffn_norm.weight"], c.eps)
            self._tap(i, "attn_out", a)
            self._tap(i, "ffn_in", h)
            m = self._moe(i, lw, h, gate, sal) if c.n_experts else self._mlp(i, lw, h, gate)
            if c.post_norms:
                m = _rmsnorm(m, lw["post_ffw_norm.weight"], c.eps)
            x = x + m
        return _rmsnorm(x, self.out_norm, c.eps)

    def _tap(self, i, name, value):
        if self.tap is not None:
            self.tap(i, name, value)

    def _mlp(self, i, lw, h, gate):
        act = gate(h @ lw["ffn_gate.weight"].T) * (h @ lw["ffn_up.weight"].T)    # [T, ffn]
        self._tap(i, "ffn_act", act)
        return act @ lw["ffn_down.weight"].T

    def _moe(self, i, lw, h, gate, sal=None):
        """A mixture-of-experts FFN with exact top-k routing, as llama.cpp's build_moe_ffn: softmax
        over all E router logits, the k largest (ties: the lower id), their weights renormalized
        (moe_norm: llama, Qwen3-MoE; not OLMoE), y = sum over the k in rank order of
        w_j * FFN_{e_j}(h)."""
        c = self.cfg
        z = h @ lw["ffn_gate_inp.weight"].T                                 # [T, E]
        sel, w = route(z, c.n_experts_used, c.moe_norm)                     # [T, k] each
        self._tap(i, "moe_logits", z)
        self._tap(i, "moe_sel", sel)
        F = c.ffn_dim
        G = lw["ffn_gate_exps.weight"].reshape(c.n_experts, F, c.dim)       # [E, F, dim]
        U = lw["ffn_up_exps.weight"].reshape(c.n_experts, F, c.dim)         # [E, F, dim]
        Dn = lw["ffn_down_exps.weight"].reshape(c.n_experts, c.dim, F)      # [E, dim, F]
        y = np.zeros((*sel.shape, c.dim), F32)                              # [T, k, dim]
        for e in np.unique(sel):
            t, j = np.nonzero(sel == e)
            y[t, j] = (gate(h[t] @ G[e].T) * (h[t] @ U[e].T)) @ Dn[e].T
        if self.moe_assemble is not None:
            return self.moe_assemble(i, y, w, sel, sal)
        out = w[:, 0, None] * y[:, 0]
        for j in range(1, sel.shape[1]):                                    # in rank order
            out = out + w[:, j, None] * y[:, j]
        return out

    def _attention(self, i, lw, h, pos0, cos, sin, kv):
        c, T = self.cfg, h.shape[0]
        q, k, v = (h @ lw[f"attn_{n}.weight"].T for n in "qkv")  # [T, q_dim], [T, kv_dim] x2
        if c.qkv_bias:
            q, k, v = q + lw["attn_q.bias"], k + lw["attn_k.bias"], v + lw["attn_v.bias"]
        if c.qk_norm == "all":                          # OLMoE: RMSNorm of the whole projection
            q, k = _rmsnorm(q, lw["attn_q_norm.weight"], c.eps), _rmsnorm(k, lw["attn_k_norm.weight"], c.eps)
        q, k = q.reshape(T, c.n_heads, c.head_dim), k.reshape(T, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "head":                         # Qwen3: RMSNorm of every head's row
            q, k = _rmsnorm(q, lw["attn_q_norm.weight"], c.eps), _rmsnorm(k, lw["attn_k_norm.weight"], c.eps)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        end = pos0 + T
        kv.k[i, pos0:end], kv.v[i, pos0:end] = k.reshape(T, -1), v
        keys = kv.k[i, :end].reshape(end, c.n_kv_heads, c.head_dim)    # [S, kv_heads, hd]
        vals = kv.v[i, :end].reshape(end, c.n_kv_heads, c.head_dim)    # [S, kv_heads, hd]
        group = c.n_heads // c.n_kv_heads  # GQA: query head h reads kv head h // group
        keys, vals = np.repeat(keys, group, axis=1), np.repeat(vals, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, keys) / F32(np.sqrt(c.head_dim))  # [H, T, S]
        # Causal: query t (at pos0+t) sees keys 0..pos0+t; in a sliding-window layer only the
        # last `window` of them (keys past pos0+t-window are masked).
        dist = (pos0 + np.arange(T))[:, None] - np.arange(end)[None, :]   # [T, S]
        win = c.layer_window(i)
        scores[:, (dist < 0) | ((dist >= win) if win else False)] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", probs, vals).reshape(T, c.q_dim)  # [T, q_dim]
        return out @ lw["attn_output.weight"].T                            # [T, dim]

    @staticmethod
    def _rope_angles(inv_freq: np.ndarray, pos0: int, T: int):
        ang = np.arange(pos0, pos0 + T, dtype=np.float64)[:, None] * inv_freq  # [T, hd/2]
        return np.cos(ang).astype(F32), np.sin(ang).astype(F32)

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x [T, heads, head_dim]: NORM pairs (2i, 2i+1), NEOX pairs (i, i+half)."""
        if self.cfg.neox_rope:
            half = x.shape[-1] // 2
            a, b = x[..., :half], x[..., half:]
        else:
            a, b = x[..., 0::2], x[..., 1::2]
        cos, sin = cos[:, None, :], sin[:, None, :]
        ra, rb = a * cos - b * sin, a * sin + b * cos
        out = np.empty_like(x)
        if self.cfg.neox_rope:
            out[..., :half], out[..., half:] = ra, rb
        else:
            out[..., 0::2], out[..., 1::2] = ra, rb
        return out


def route(z: np.ndarray, k: int, norm: bool = True):
    """Router logits z [T, E] -> (experts [T, k] int, weights [T, k] f32): softmax over all E, the
    top k (ties: the lower id, a stable sort; llama.cpp leaves tie order open), renormalized to
    sum 1 when norm (clamped below at 2^-14, as llama.cpp does). The top k are picked by logit,
    which orders them as their probabilities do, but exactly: a flat router (a MoEfied model's,
    models/moe_gguf.py) has probabilities within an f32 ulp of each other, whose rounding would
    decide the experts."""
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    sel = np.argsort(-z, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, sel, axis=1)
    if norm:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), F32(6.103515625e-5))
    return sel, w.astype(F32)


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps)) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x * (F32(0.5) + F32(0.5) * np.tanh(x * F32(0.5)))  # x*sigmoid(x), no exp overflow


def _gelu(x: np.ndarray) -> np.ndarray:
    """tanh-GELU (Gemma's gelu_pytorch_tanh)."""
    return F32(0.5) * x * (F32(1) + np.tanh(F32(np.sqrt(2 / np.pi)) * (x + F32(0.044715) * x * x * x)))


def _dequant(t: dict | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(F32)
    if "w" in t:
        return dequant_float(t["fmt"], t["w"])
    return dequant_planar(t) if "m" in t or "dm" in t else dequant_q8_0(t["qs"], t["d"])
