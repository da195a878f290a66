"""Tiny Llama-family GGUFs for tests and fixtures (no download): seeded random weights, 1 layer by
default, dim 32, 2 heads of 16 (1 kv head), ffn 64, and a byte-level tokenizer of 257 tokens (one
per byte, and one merge: two spaces) so an engine can load them. K-quant matrices need rows of 256 weights: pass
dim=256 (and ffn=512)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFWriter
from gguf.quants import quantize

from .quant import F16_FIELDS, FORMATS

QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")   # gguf.quants.quantize


def random_blocks(qtype: str, rows: int, cols: int, rng, scales) -> np.ndarray:
    """Random GGUF bytes of a [rows, cols] matrix of a block format, every code and sub-scale
    pattern, its f16 scale fields set to scales(n) (n values: finite ones)."""
    f = FORMATS[qtype]
    n = rows * cols // f.block
    raw = rng.integers(0, 256, (n, f.block_bytes), dtype=np.uint8)
    for col in F16_FIELDS[qtype]:
        raw[:, col:col + 2] = np.asarray(scales(n)).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def blocks(qtype: str, x: np.ndarray, rng) -> np.ndarray:
    """x [rows, cols] f32 -> the raw bytes of a GGUF tensor of type qtype. gguf quantizes the
    32-weight formats; K-quant blocks are random but valid: random codes and sub-scales, and f16
    super-scales small enough that the weights stay near x's size."""
    if qtype in QUANTIZABLE:
        return quantize(x, QT[qtype])
    rows, cols = x.shape
    if qtype in FORMATS:        # d (and dmin): |w| <= 63 * 31 * 2e-4 ~ 0.4 (Q6_K: 127 * 32 * 2e-4)
        return random_blocks(qtype, rows, cols, rng, lambda n: rng.uniform(0.5, 1.0, n) * 2e-4)
    n = rows * cols // 256      # Q2_K, which socllm does not read: its d and dmin
    raw = rng.integers(0, 256, (n, {"Q2_K": 84, "Q3_K": 110}[qtype]), dtype=np.uint8)
    for col in (80, 82):
        raw[:, col:col + 2] = (rng.uniform(0.5, 1.0, n) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def write_tiny(path, arch="llama", matrix="Q4_1", types=None, extra=(), dim=32, ffn=64,
               layers=1, vocab=257, table="Q8_0", head_dim=16, heads=None, window=4,
               swa_pattern=3, kv_heads=None, random=False, context=64, meta=None, experts=0,
               top_k=2) -> str:
    """matrix: the type of the layers' matrices; table: the token embedding's; types: {name:
    type} for single tensors; extra: f32 vectors beside the Llama ones (rope_freqs.weight: [hd/2];
    a name with "norm": [hd]; others [8]). heads: query heads (default dim / head_dim), kv_heads
    (default half of them). random: block matrices of random valid blocks rather than quantized
    weights (fast at a real model's size: scripts/gpu_decode.py's runs); vocab beyond 257: filler
    tokens.
    experts: a mixture of experts (Mixtral-style tensors): `experts` FFNs of width ffn each, an F32
    router, top_k of them used a token. qwen3moe and olmoe are MoEs (experts: 8 unless given), as
    llama.cpp loads them (src/models/qwen3moe.cpp, olmoe.cpp): qwen3moe's expert width in
    expert_feed_forward_length (its feed_forward_length, 3 * ffn here, is not it), per-head Q/K
    norms; olmoe's Q/K norms over the whole projections, as many kv heads as heads (its K norm is
    n_embd wide), and an untied output matrix (llama.cpp requires one).
    gemma3: sliding-window layers of `window` keys, every swa_pattern-th layer global, rope base
    1e6 (global layers) and llama.cpp's default 1e4 (sliding ones). meta: more metadata, {key
    after "ARCH.": a str or a float}."""
    matrix, table = getattr(matrix, "name", matrix), getattr(table, "name", table)
    types = {k: getattr(v, "name", v) for k, v in (types or {}).items()}
    hd = head_dim
    heads = heads or dim // hd
    kv_heads = kv_heads or (heads if arch == "olmoe" else max(1, heads // 2))
    experts = experts or (8 if arch in ("qwen3moe", "olmoe") else 0)
    q_dim, kv_dim = heads * hd, kv_heads * hd
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers), w.add_context_length(context), w.add_embedding_length(dim)
    w.add_feed_forward_length(3 * ffn if arch == "qwen3moe" else ffn)
    w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab), w.add_key_length(hd), w.add_value_length(hd)
    if experts:
        w.add_expert_count(experts), w.add_expert_used_count(top_k)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(ffn)
    if arch == "gemma3":
        w.add_sliding_window(window), w.add_sliding_window_pattern(swa_pattern)
    for key, value in (meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm")
    filler = [f"<t{i}>" for i in range(max(0, vocab - 257))]
    w.add_token_list((byte_tokens() + ["ĠĠ"] + filler)[:vocab]), w.add_token_types([1] * vocab)
    w.add_token_merges(["Ġ Ġ"]), w.add_eos_token_id(0), w.add_bos_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,),
              **({"output.weight": (vocab, dim)} if arch == "olmoe" else {}),
              **{name: (hd // 2,) if name == "rope_freqs.weight" else (hd,) if "norm" in name else (8,)
                 for name in extra}}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (dim,), b + "ffn_norm.weight": (dim,),
                       b + "attn_q.weight": (q_dim, dim), b + "attn_k.weight": (kv_dim, dim),
                       b + "attn_v.weight": (kv_dim, dim), b + "attn_output.weight": (dim, q_dim)})
        if experts:
            shapes.update({b + "ffn_gate_inp.weight": (experts, dim),
                           b + "ffn_gate_exps.weight": (experts, ffn, dim),
                           b + "ffn_up_exps.weight": (experts, ffn, dim),
                           b + "ffn_down_exps.weight": (experts, dim, ffn)})
        else:
            shapes.update({b + "ffn_gate.weight": (ffn, dim), b + "ffn_up.weight": (ffn, dim),
                           b + "ffn_down.weight": (dim, ffn)})
        if arch == "gemma3":                                # sublayer outputs normed
            shapes.update({b + "post_attention_norm.weight": (dim,), b + "post_ffw_norm.weight": (dim,)})
        if arch in ("qwen3", "gemma3", "qwen3moe"):         # per-head Q/K norms
            shapes.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        if arch == "olmoe":                                 # Q/K norms over the whole projection
            shapes.update({b + "attn_q_norm.weight": (q_dim,), b + "attn_k_norm.weight": (kv_dim,)})
        if arch == "qwen2":
            shapes.update({b + "attn_q.bias": (q_dim,), b + "attn_k.bias": (kv_dim,),
                           b + "attn_v.bias": (kv_dim,)})
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        if name == "rope_freqs.weight":                    # Llama 3.1's divisors: 1 .. 8
            w.add_tensor(name, np.linspace(1.0, 8.0, shape[0], dtype=np.float32))
            continue
        if len(shape) == 1:
            w.add_tensor(name, x + 1 if "norm" in name else x)
            continue
        qtype = types.get(name, table if name in ("token_embd.weight", "output.weight") else matrix)
        if name.endswith("ffn_gate_inp.weight"):      # a router: F32, as llama.cpp keeps it
            qtype, x = types.get(name, "F32"), x * 10
        if len(shape) == 3:                            # experts [E, out, in]: quantized by rows
            x = x.reshape(-1, shape[2])
        if qtype == "F32":
            w.add_tensor(name, x.reshape(shape))
        elif random and qtype in FORMATS:
            size = {"Q4_K": 2e-3, "Q5_K": 1e-3, "Q6_K": 5e-4}.get(qtype, 0.01)
            raw = random_blocks(qtype, *x.shape, rng, lambda n: rng.uniform(0.5, 1.0, n) * size)
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=QT[qtype])
        else:
            raw = blocks(qtype, x, rng)
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=QT[qtype])
    write(w)
    return str(path)


def byte_tokens() -> list:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write(w: GGUFWriter):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
