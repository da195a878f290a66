"""A Llama-family model (models/llama.py: Llama, Qwen2/3, Gemma 3, the MoEs) -> one step's graph
(N new tokens after P cached ones).

The same graph serves prefill (N > 1) and decode (N = 1): shapes are symbolic in N. K and V
projections write straight into the layer's KV cache (rope'd K, plain V), in place, so nothing is
concatenated between steps (Transformer-Lite §2.3).
"""
from __future__ import annotations

from .ir import Graph, N


def weight_name(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.weight"


def build_graph(cfg, n_layers: int | None = None, paged: dict | None = None) -> Graph:
    """cfg: models.llama.ModelConfig. n_layers < cfg.n_layers builds a truncated model (tests).

    paged = {"block_rows", "max_blocks", "max_seqs", "all_rows"}: a serving step, whose N rows
    belong to any sequences at their own positions (memory/blocks.py): rope and the K/V writes
    take each row's position and KV row from the step's row metadata (pos, rows), attention reads
    each row's sequence (seq) through its block table (btab), and with all_rows (a decode batch)
    the lm-head gives every row's logits [N, V], else the last row's."""
    L = cfg.n_layers if n_layers is None else n_layers
    D, F, H, KVH, hd = cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kv_cols = KVH * hd
    g = Graph()
    g.tensor("ids", (N,), "i32", "input")
    all_rows = bool(paged and paged["all_rows"])
    g.tensor("logits", (N, cfg.vocab) if all_rows else (cfg.vocab,), "f32", "output")
    rowmeta = {}        # extra inputs of the ops that depend on a row's sequence and position
    if paged:
        for name in ("pos", "rows", "seq"):
            g.tensor(name, (N,), "i32", "input")       # [N] per-row metadata
        g.tensor("btab", (paged["max_seqs"], paged["max_blocks"]), "i32", "input")
        if all_rows:        # a decode step's draft tree rows: the keys each sees (paged.cl tree_row)
            g.tensor("tmask", (N, 4), "i32", "input")
        rowmeta = {"pos": "pos"}
    g.tensor("token_embd.weight", (cfg.vocab, D), "q8_0", "weight")
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"   # the lm-head's table
    if not cfg.tied_embeddings:
        g.tensor(head, (cfg.vocab, D), "q8_0", "weight")
    g.tensor("output_norm.weight", (D,), "f32", "weight")
    for i in range(L):
        for part, shape, dt in [("attn_norm", (D,), "f32"), ("ffn_norm", (D,), "f32"),
                                ("attn_q", (H * hd, D), "q4_1"), ("attn_k", (kv_cols, D), "q4_1"),
                                ("attn_v", (kv_cols, D), "q4_1"), ("attn_output", (D, H * hd), "q4_1"),
                                *_ffn_weights(cfg)]:
            g.tensor(weight_name(i, part), shape, dt, "weight")
        if cfg.qk_norm:          # per head [hd], or over the whole projection (OLMoE)
            whole = cfg.qk_norm == "all"
            g.tensor(f"blk.{i}.attn_q_norm.weight", (H * hd if whole else hd,), "f32", "weight")
            g.tensor(f"blk.{i}.attn_k_norm.weight", (kv_cols if whole else hd,), "f32", "weight")
        if cfg.post_norms:
            g.tensor(f"blk.{i}.post_attention_norm.weight", (D,), "f32", "weight")
            g.tensor(f"blk.{i}.post_ffw_norm.weight", (D,), "f32", "weight")
        if cfg.qkv_bias:                             # Qwen2: y = x W.T + b
            for part, n in (("attn_q", H * hd), ("attn_k", kv_cols), ("attn_v", kv_cols)):
                g.tensor(f"blk.{i}.{part}.bias", (n,), "f32", "weight")
        g.tensor(f"kcache.{i}", ("L_cap", kv_cols), "f32", "kv")
        g.tensor(f"vcache.{i}", ("L_cap", kv_cols), "f32", "kv")

    def bias(i, part):
        return {"b": f"blk.{i}.{part}.bias"} if cfg.qkv_bias and part in ("attn_q", "attn_k", "attn_v") else {}

    def lin(i, part, x, out, K, M):
        g.add("linear", {"x": x, "w": weight_name(i, part), **bias(i, part)}, {"out": out}, i, K=K, M=M)

    def post_norm(i, part, x):           # Gemma: a sublayer's output normed before the add
        if not cfg.post_norms:
            return x
        g.add("rmsnorm", {"x": x, "w": weight_name(i, part)}, {"out": x + "n"}, i, D=D, eps=cfg.eps)
        return x + "n"

    if cfg.rope_freqs:       # Llama 3.1: per-pair frequency divisors
        g.tensor("rope_freqs.weight", (hd // 2,), "f32", "weight")
    freqs = {"f": "rope_freqs.weight"} if cfg.rope_freqs else {}

    scale = {"scale": cfg.embed_scale} if cfg.embed_scale != 1.0 else {}
    g.add("embed", {"ids": "ids", "table": "token_embd.weight"}, {"out": "x0"}, D=D, V=cfg.vocab,
          **scale)
    x = "x0"
    for i in range(L):
        p = f"l{i}."
        g.add("rmsnorm", {"x": x, "w": weight_name(i, "attn_norm")}, {"out": p + "xn"}, i, D=D, eps=cfg.eps)
        lin(i, "attn_q", p + "xn", p + "q", D, H * hd)
        lin(i, "attn_k", p + "xn", p + "k", D, kv_cols)
        q, k = p + "q", p + "k"
        if cfg.qk_norm:   # before rope: every head's row normalized (Qwen3, Gemma 3), or the
            # whole projection at once (OLMoE)
            for x_, n_, heads in ((q, "attn_q_norm", H), (k, "attn_k_norm", KVH)):
                width = {"D": heads * hd} if cfg.qk_norm == "all" else {"D": hd, "heads": heads}
                g.add("rmsnorm", {"x": x_, "w": weight_name(i, n_)}, {"out": x_ + "n"}, i,
                      eps=cfg.eps, **width)
            q, k = q + "n", k + "n"
        kv_rows = {"rows": "rows"} if paged else {}
        g.add("linear", {"x": p + "xn", "w": weight_name(i, "attn_v"), **bias(i, "attn_v"), **kv_rows},
              {"out": f"vcache.{i}"}, i, K=D, M=kv_cols)
        # NEOX rope (Qwen2) rotates pairs (j, j + hd/2), GGML's NORM rope pairs (2j, 2j+1)
        rope = dict(head_dim=hd, theta=cfg.layer_theta(i), **({"neox": 1} if cfg.neox_rope else {}))
        g.add("rope", {"x": q, **rowmeta, **freqs}, {"out": p + "qr"}, i, heads=H, **rope)
        g.add("rope", {"x": k, **rowmeta, **kv_rows, **freqs}, {"out": f"kcache.{i}"}, i,
              heads=KVH, **rope)
        att = {"q": p + "qr", "k": f"kcache.{i}", "v": f"vcache.{i}"}
        pages = {}
        if paged:
            att.update(pos="pos", seq="seq", btab="btab", **({"tmask": "tmask"} if all_rows else {}))
            pages = dict(block_rows=paged["block_rows"], max_blocks=paged["max_blocks"])
        win = {"window": cfg.layer_window(i)} if cfg.layer_window(i) else {}
        g.add("attention", att, {"out": p + "att"}, i, heads=H, kv_heads=KVH, head_dim=hd, **pages, **win)
        lin(i, "attn_output", p + "att", p + "o", H * hd, D)
        g.add("add", {"a": x, "b": post_norm(i, "post_attention_norm", p + "o")}, {"out": p + "h"}, i, D=D)
        g.add("rmsnorm", {"x": p + "h", "w": weight_name(i, "ffn_norm")}, {"out": p + "hn"}, i, D=D, eps=cfg.eps)
        if cfg.n_experts:
            _moe(g, cfg, i, p)
        else:
            lin(i, "ffn_gate", p + "hn", p + "gate", D, F)
            lin(i, "ffn_up", p + "hn", p + "up", D, F)
            g.add(f"{cfg.act}_mul", {"g": p + "gate", "u": p + "up"}, {"out": p + "act"}, i, F=F)
            lin(i, "ffn_down", p + "act", p + "down", F, D)
        g.add("add", {"a": p + "h", "b": post_norm(i, "post_ffw_norm", p + "down")}, {"out": p + "y"}, i, D=D)
        x = p + "y"
    g.add("rmsnorm", {"x": x, "w": "output_norm.weight"}, {"out": "xf"}, D=D, eps=cfg.eps)
    g.add("lm_head", {"x": "xf", "table": head}, {"out": "logits"}, D=D, V=cfg.vocab,
          **({"all_rows": True} if all_rows else {}))
    return g


def _ffn_weights(cfg) -> list:
    """(part, shape, dtype) of a layer's FFN weights: a dense MLP's three matrices, or an MoE's
    router [E, D] and its experts stacked by rows (expert e's matrix: rows e*out .. (e+1)*out)."""
    D, F, E = cfg.dim, cfg.ffn_dim, cfg.n_experts
    if not E:
        return [("ffn_gate", (F, D), "q4_1"), ("ffn_up", (F, D), "q4_1"), ("ffn_down", (D, F), "q4_1")]
    return [("ffn_gate_inp", (E, D), "f32"), ("ffn_gate_exps", (E * F, D), "q4_1"),
            ("ffn_up_exps", (E * F, D), "q4_1"), ("ffn_down_exps", (E * D, F), "q4_1")]


def _moe(g: Graph, cfg, i: int, p: str):
    """A mixture-of-experts FFN (NPUMoE; llama.cpp's build_moe_ffn): the router's logits, exact
    top-k routing (moe_route: each row's k experts and weights), each row's k experts' gate and up
    (moe_linear: [N, k*F]), the gated product, and the k experts' down projections summed by their
    weights in rank order ([N, D]). A route row: k expert ids (as floats), k weights, saliency."""
    D, F, E, k = cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.n_experts_used
    g.add("linear", {"x": p + "hn", "w": weight_name(i, "ffn_gate_inp")}, {"out": p + "logit"}, i,
          K=D, M=E)
    # the route keeps each row's saliency, the L2 norm of its attention output (NPUMoE §3.2:
    # which rows an expert over its capacity drops first)
    g.add("moe_route", {"x": p + "logit", "sal": p + "o"}, {"out": p + "route"}, i, E=E, k=k,
          norm=int(cfg.moe_norm), D=D)
    for part, out in (("ffn_gate_exps", "gate"), ("ffn_up_exps", "up")):
        g.add("moe_linear", {"x": p + "hn", "route": p + "route", "w": weight_name(i, part)},
              {"out": p + out}, i, K=D, M=F, E=E, k=k, per_slot=0, combine=0)
    g.add(f"{cfg.act}_mul", {"g": p + "gate", "u": p + "up"}, {"out": p + "act"}, i, F=k * F)
    g.add("moe_linear", {"x": p + "act", "route": p + "route", "w": weight_name(i, "ffn_down_exps")},
          {"out": p + "down"}, i, K=F, M=D, E=E, k=k, per_slot=1, combine=1)
