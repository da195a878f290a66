"""Models known by their published configurations only: no weights, no file. The simulated SoCs
(policies/sim/simulate.py) plan and run socllm's own step programs for them, so their shapes must be
the real ones; their weights are never read.

Sources: each model's configuration as its authors published it (config.json on its model card).
HeteroLLM's "Llama-8B" is taken to be Llama 3 8B and its "Llama-3B" Llama 3.2 3B (the paper gives
parameter counts only); InternLM-1.8B is InternLM2 1.8B.
"""
from __future__ import annotations

import numpy as np

from .llama import ModelConfig

PUBLISHED = {
    # meta-llama/Meta-Llama-3-8B
    "llama-8b": ModelConfig(arch="llama", n_layers=32, dim=4096, ffn_dim=14336, n_heads=32,
                            n_kv_heads=8, head_dim=128, vocab=128256, rope_theta=500000.0,
                            eps=1e-5, context_length=8192, tied_embeddings=False, qkv_bias=False),
    # meta-llama/Llama-3.2-3B
    "llama-3b": ModelConfig(arch="llama", n_layers=28, dim=3072, ffn_dim=8192, n_heads=24,
                            n_kv_heads=8, head_dim=128, vocab=128256, rope_theta=500000.0,
                            eps=1e-5, context_length=131072, tied_embeddings=True, qkv_bias=False),
    # internlm/internlm2-1_8b
    "internlm-1.8b": ModelConfig(arch="llama", n_layers=24, dim=2048, ffn_dim=8192, n_heads=16,
                                 n_kv_heads=8, head_dim=128, vocab=92544, rope_theta=1000000.0,
                                 eps=1e-5, context_length=32768, tied_embeddings=False,
                                 qkv_bias=False),
}


def shape_only(shape, dtype) -> np.ndarray:
    """An array that has a shape, a type and a size in bytes, and holds no memory (a broadcast of
    one element): what the pool's layout needs of a weight it will never read."""
    return np.broadcast_to(np.zeros(1, dtype), shape)


def shape_weights(cfg: ModelConfig) -> dict:
    """The weights of a W4 model as the pool lays them out (models/llama.load_weights: Q4_1
    matrices in the planar layout of models/quant.py, Q8_0 token table, f32 vectors), shapes only.
    W4 is HeteroLLM's W4A16 storage (§5.1)."""
    from .llama import expected_tensors
    out = {}
    for name, (_, shape) in expected_tensors(cfg).items():
        if len(shape) == 1:
            out[name] = shape_only(shape, np.float32)
        elif name == "token_embd.weight":
            rows, cols = shape
            out[name] = {"qs": shape_only((rows, cols), np.int8),
                         "d": shape_only((rows, cols // 32), np.float16)}
        else:
            rows, cols = shape
            out[name] = {"fmt": "Q4_1", "qs": shape_only((rows, cols // 2), np.uint8),
                         "d": shape_only((rows, cols // 32), np.float16),
                         "m": shape_only((rows, cols // 32), np.float16)}
    return out
