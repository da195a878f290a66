"""A Llama-family model -> one step's graph (N new tokens after P cached ones).

The same graph serves prefill (N > 1) and decode (N = 1): shapes are symbolic in N. K and V
projections write straight into the layer's KV cache (rope'd K, plain V), in place, so nothing is
concatenated between steps (Transformer-Lite §2.3).
"""
from __future__ import annotations

from .ir import Graph, N


def weight_name(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.weight"


def build_graph(cfg, n_layers: int | None = None) -> Graph:
    """cfg: models.llama.ModelConfig. n_layers < cfg.n_layers builds a truncated model (tests)."""
    if getattr(cfg, "qkv_bias", False):
        raise NotImplementedError("Q/K/V biases (Qwen2) are not supported by the kernels yet")
    L = cfg.n_layers if n_layers is None else n_layers
    D, F, H, KVH, hd = cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kv_cols = KVH * hd
    g = Graph()
    g.tensor("ids", (N,), "i32", "input")
    g.tensor("logits", (cfg.vocab,), "f32", "output")
    g.tensor("token_embd.weight", (cfg.vocab, D), "q8_0", "weight")
    g.tensor("output_norm.weight", (D,), "f32", "weight")
    for i in range(L):
        for part, shape, dt in [("attn_norm", (D,), "f32"), ("ffn_norm", (D,), "f32"),
                                ("attn_q", (H * hd, D), "q4_1"), ("attn_k", (kv_cols, D), "q4_1"),
                                ("attn_v", (kv_cols, D), "q4_1"), ("attn_output", (D, H * hd), "q4_1"),
                                ("ffn_gate", (F, D), "q4_1"), ("ffn_up", (F, D), "q4_1"),
                                ("ffn_down", (D, F), "q4_1")]:
            g.tensor(weight_name(i, part), shape, dt, "weight")
        g.tensor(f"kcache.{i}", ("L_cap", kv_cols), "f32", "kv")
        g.tensor(f"vcache.{i}", ("L_cap", kv_cols), "f32", "kv")

    def lin(i, part, x, out, K, M):
        g.add("linear", {"x": x, "w": weight_name(i, part)}, {"out": out}, i, K=K, M=M)

    g.add("embed", {"ids": "ids", "table": "token_embd.weight"}, {"out": "x0"}, D=D, V=cfg.vocab)
    x = "x0"
    for i in range(L):
        p = f"l{i}."
        g.add("rmsnorm", {"x": x, "w": weight_name(i, "attn_norm")}, {"out": p + "xn"}, i, D=D, eps=cfg.eps)
        lin(i, "attn_q", p + "xn", p + "q", D, H * hd)
        lin(i, "attn_k", p + "xn", p + "k", D, kv_cols)
        lin(i, "attn_v", p + "xn", f"vcache.{i}", D, kv_cols)
        rope = dict(head_dim=hd, theta=cfg.rope_theta)
        g.add("rope", {"x": p + "q"}, {"out": p + "qr"}, i, heads=H, **rope)
        g.add("rope", {"x": p + "k"}, {"out": f"kcache.{i}"}, i, heads=KVH, **rope)
        g.add("attention", {"q": p + "qr", "k": f"kcache.{i}", "v": f"vcache.{i}"}, {"out": p + "att"},
              i, heads=H, kv_heads=KVH, head_dim=hd)
        lin(i, "attn_output", p + "att", p + "o", H * hd, D)
        g.add("add", {"a": x, "b": p + "o"}, {"out": p + "h"}, i, D=D)
        g.add("rmsnorm", {"x": p + "h", "w": weight_name(i, "ffn_norm")}, {"out": p + "hn"}, i, D=D, eps=cfg.eps)
        lin(i, "ffn_gate", p + "hn", p + "gate", D, F)
        lin(i, "ffn_up", p + "hn", p + "up", D, F)
        g.add("silu_mul", {"g": p + "gate", "u": p + "up"}, {"out": p + "act"}, i, F=F)
        lin(i, "ffn_down", p + "act", p + "down", F, D)
        g.add("add", {"a": p + "h", "b": p + "down"}, {"out": p + "y"}, i, D=D)
        x = p + "y"
    g.add("rmsnorm", {"x": x, "w": "output_norm.weight"}, {"out": "xf"}, D=D, eps=cfg.eps)
    g.add("lm_head", {"x": "xf", "table": "token_embd.weight"}, {"out": "logits"}, D=D, V=cfg.vocab)
    return g
