"""Tiny Llama-family GGUFs written in a test (no download): 1 layer, dim 32, 2 heads of 16
(1 kv head), ffn 64, vocab 16, seeded random weights."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFWriter
from gguf.quants import quantize


def write_tiny(path, arch="llama", matrix=QT.Q4_1, f16=frozenset(), extra=()) -> str:
    """matrix: the type of the layer's matrices; f16: tensors written as F16 instead; extra:
    [8] f32 tensors beside the Llama ones (rope_freqs.weight, say)."""
    dim, ffn, vocab, kv_dim = 32, 64, 16, 16
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn), w.add_head_count(2), w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,),
              "blk.0.attn_norm.weight": (dim,), "blk.0.ffn_norm.weight": (dim,),
              "blk.0.attn_q.weight": (dim, dim), "blk.0.attn_k.weight": (kv_dim, dim),
              "blk.0.attn_v.weight": (kv_dim, dim), "blk.0.attn_output.weight": (dim, dim),
              "blk.0.ffn_gate.weight": (ffn, dim), "blk.0.ffn_up.weight": (ffn, dim),
              "blk.0.ffn_down.weight": (dim, ffn), **{name: (8,) for name in extra}}
    if arch == "qwen2":
        shapes.update({"blk.0.attn_q.bias": (dim,), "blk.0.attn_k.bias": (kv_dim,),
                       "blk.0.attn_v.bias": (kv_dim,)})
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        if name in f16:
            w.add_tensor(name, x.astype(np.float16))
        elif len(shape) == 1:
            w.add_tensor(name, x + 1 if "norm" in name else x)
        else:
            qtype = QT.Q8_0 if name == "token_embd.weight" else matrix
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    write(w)
    return str(path)


def write(w: GGUFWriter):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
