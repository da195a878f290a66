"""The Llama-family model description: its config and its weights, read from a GGUF.

Llama (SmolLM2, Llama-3), Qwen2/3 and Gemma 3 are one network: RMSNorm, GQA attention with RoPE,
a gated MLP. They differ in data only — Qwen2 adds Q/K/V biases and uses NEOX rope, Qwen3 normalizes
Q and K per head, Llama 3.1 divides rope frequencies, Gemma 3 adds all of Qwen3's and scales its
embeddings, normalizes each sublayer's output before the residual add, gates with tanh-GELU and
interleaves sliding-window layers (their own rope base) with global ones — so all load here.
The mixtures of experts are the same network with the MLP swapped for top-k of E SwiGLU experts:
Mixtral-style `llama`, Qwen3-MoE (Qwen3's attention; experts of expert_feed_forward_length) and
OLMoE (NEOX rope, Q and K normalized over the whole projection, routing weights not renormalized),
as llama.cpp builds them (src/models/qwen3moe.cpp, olmoe.cpp; src/llama-graph.cpp build_moe_ffn).

Weights keep GGUF's tensor names. A matrix W [out, in] (y = x @ W.T) stays in its file's format, in
the planar layout of models/quant.py; only norms and biases are float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader

from .gguf_file import ModelError
from .quant import FLOAT_TYPES, MATRIX_TYPES, QK, float_matrix, planar, repack_q8_0

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "olmoe")
MOE_ARCHS = ("qwen3moe", "olmoe")      # no dense form: llama.cpp refuses them without experts
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class ModelConfig:
    arch: str              # one of SUPPORTED_ARCHS
    n_layers: int
    dim: int               # residual width
    ffn_dim: int
    n_heads: int
    n_kv_heads: int        # GQA: each kv head serves n_heads / n_kv_heads query heads
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float             # RMSNorm epsilon
    context_length: int
    tied_embeddings: bool  # no output.weight: the lm_head is token_embd
    qkv_bias: bool         # attn_q/k/v carry a bias (Qwen2)
    rope_freqs: bool = False   # rope_freqs.weight divides each pair's frequency (Llama 3.1)
    # RMSNorm of Q and K before rope: "head" each head's row (Qwen3, Gemma 3; weights [head_dim]),
    # "all" the whole projection (OLMoE; weights [q_dim] and [kv_dim]), "" none
    qk_norm: str = ""
    # Gemma 3
    post_norms: bool = False   # RMSNorm of the attention's and the MLP's outputs before each add
    act: str = "silu"          # the MLP's gate: "silu" (SwiGLU) or "gelu" (tanh-GELU: GeGLU)
    embed_scale: float = 1.0   # the embedding rows times this (Gemma: sqrt(dim))
    window: int = 0            # sliding-window layers see their last `window` keys; 0: none
    swa_layers: tuple = ()     # the sliding-window layers
    rope_theta_swa: float = 0.0   # their rope base
    # Mixture of experts (Mixtral-style `llama`, Qwen3-MoE, OLMoE; NPUMoE): n_experts FFNs of
    # ffn_dim each, a router ffn_gate_inp [E, dim]; each token takes n_experts_used of them (0: a
    # dense model)
    n_experts: int = 0
    n_experts_used: int = 0
    moe_norm: bool = True      # the chosen experts' softmax weights renormalized to sum 1 (OLMoE: not)

    def layer_window(self, i: int) -> int:
        """Keys layer i sees behind a query, itself included (0: all of them)."""
        return self.window if i in self.swa_layers else 0

    def layer_theta(self, i: int) -> float:
        return self.rope_theta_swa if i in self.swa_layers else self.rope_theta

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelError(f"unsupported architecture {self.arch!r} (supported: "
                             f"{', '.join(SUPPORTED_ARCHS)})")
        for name in ("n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim",
                     "vocab", "context_length"):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"model config: {self.n_heads} heads do not group over "
                             f"{self.n_kv_heads} kv heads")
        if self.head_dim % 2:
            raise ModelError(f"model config: rope needs an even head_dim, got {self.head_dim}")
        # Every matrix's input width must fill whole quant blocks.
        for name in ("dim", "ffn_dim"):
            if getattr(self, name) % QK:
                raise ModelError(f"model config: {name}={getattr(self, name)} is not a multiple of {QK}")
        if self.act not in ("silu", "gelu"):
            raise ModelError(f"model config: unknown MLP gate {self.act!r}")
        if self.swa_layers and (self.window <= 0 or self.rope_theta_swa <= 0):
            raise ModelError(f"model config: sliding-window layers need a window and a rope base "
                             f"(got {self.window}, {self.rope_theta_swa})")
        if self.qk_norm not in ("", "head", "all"):
            raise ModelError(f"model config: unknown Q/K norm {self.qk_norm!r}")
        if self.arch in MOE_ARCHS and not self.n_experts:
            raise ModelError(f"model config: {self.arch} needs {self.arch}.expert_count")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ModelError(f"model config: {self.n_experts_used} experts used of "
                             f"{self.n_experts} (need 1 .. {self.n_experts})")
        if self.rope_theta <= 0 or not 0 < self.eps < 1:
            raise ModelError(f"model config: bad rope_theta {self.rope_theta} or eps {self.eps}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def neox_rope(self) -> bool:
        """Qwen rotates pairs (i, i+half); GGUF's llama Q/K are permuted for pairs (2i, 2i+1).
        llama.cpp's llama_model_rope_type: NEOX for qwen2, qwen3, qwen3moe, gemma3, olmoe."""
        return self.arch in ("qwen2", "qwen3", "gemma3", "qwen3moe", "olmoe")


def load_config(reader: GGUFReader) -> ModelConfig:
    """Read the config from GGUF metadata, and check every tensor is one socllm can run."""
    cfg = read_config(reader)
    _check_tensors(reader, cfg)
    return cfg


def read_config(reader: GGUFReader) -> ModelConfig:
    """The config from GGUF metadata alone (models/inspect.py lists the tensors' problems)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    dim = int(_field(reader, f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens else 0)
    n_experts_used = int(_field(reader, f"{arch}.expert_used_count", 0))
    cfg = ModelConfig(
        arch=arch,
        n_layers=int(_field(reader, f"{arch}.block_count")),
        dim=dim,
        ffn_dim=_ffn_dim(reader, arch, n_experts_used),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", dim // n_heads)),
        vocab=int(vocab),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, f"{arch}.context_length")),
        tied_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        rope_freqs="rope_freqs.weight" in names,
        qk_norm={"qwen3": "head", "gemma3": "head", "qwen3moe": "head", "olmoe": "all"}.get(arch, ""),
        n_experts=int(_field(reader, f"{arch}.expert_count", 0)),
        n_experts_used=n_experts_used,
        # llama.cpp's build_moe_ffn norm_w: true for llama and qwen3moe, false for olmoe (hard-coded
        # per family in src/models/*.cpp; an {arch}.expert_weights_norm key is not read for them)
        moe_norm=arch != "olmoe",
        **(_gemma3(reader, arch) if arch == "gemma3" else {}),
    )
    return cfg


def _ffn_dim(reader: GGUFReader, arch: str, k: int) -> int:
    """The FFN width: Qwen3-MoE's experts are expert_feed_forward_length wide, or, without that
    key, feed_forward_length / k (llama.cpp's llama_model_qwen3moe n_ff_exp); the others'
    (Mixtral-style llama and OLMoE experts too) feed_forward_length."""
    if arch == "qwen3moe":
        width = int(_field(reader, f"{arch}.expert_feed_forward_length", 0))
        return width or int(_field(reader, f"{arch}.feed_forward_length")) // max(k, 1)
    return int(_field(reader, f"{arch}.feed_forward_length"))


SWA_PATTERN = 6     # llama.cpp's default for Gemma 3: five sliding-window layers, then a global one


def _gemma3(reader: GGUFReader, arch: str) -> dict:
    """Gemma 3's differences (llama.cpp's reading: its defaults where the metadata is silent)."""
    n = int(_field(reader, f"{arch}.block_count"))
    dim = int(_field(reader, f"{arch}.embedding_length"))
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0))
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", SWA_PATTERN)
    if isinstance(pattern, list):         # one flag per layer
        swa = tuple(i for i, on in enumerate(pattern) if on)
    else:                                 # every pattern-th layer is global
        p = int(pattern)
        swa = tuple(i for i in range(n) if p == 0 or i % p < p - 1)
    if _field(reader, f"{arch}.final_logit_softcapping", 0.0):
        raise ModelError("gemma3: final logit softcapping is not supported")
    if n == 62:     # the 27B scales queries by 1/sqrt(dim / heads), not 1/sqrt(head_dim)
        raise ModelError("gemma3: the 27B's query scale is not supported")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", "") and factor != 1.0:
        raise ModelError(f"gemma3: rope scaling (factor {factor:g}, the 4B-27B's global layers) "
                         "is not supported")
    return dict(post_norms=True, act="gelu", embed_scale=float(np.sqrt(np.float32(dim))),
                window=window, swa_layers=swa if window else (),
                rope_theta_swa=float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)))


TABLES = ("token_embd.weight", "output.weight")   # read by rows (embedding) and by the lm-head


def load_weights(reader: GGUFReader, cfg: ModelConfig) -> dict[str, dict | np.ndarray]:
    """GGUF name -> float32 array (norms, biases) or a matrix: the token embedding table in Q8_0
    as {"qs", "d"} (natural order), any other matrix as models/quant.py's planar dict."""
    weights: dict[str, dict | np.ndarray] = {}
    for t in reader.tensors:
        if len(t.shape) == 1:
            weights[t.name] = np.array(t.data, np.float32).reshape(-1)  # copy: off the mmap
            continue
        # GGUF lists ne0 (the input width) first; experts [E, M, K] stack as one [E*M, K] matrix
        cols, rows = int(t.shape[0]), int(np.prod([int(n) for n in t.shape[1:]]))
        kind = t.tensor_type.name
        if t.name in TABLES and kind == "Q8_0":
            weights[t.name] = repack_q8_0(t.data, rows, cols)
        elif kind in FLOAT_TYPES:
            weights[t.name] = float_matrix(kind, t.data, rows, cols)
        else:
            weights[t.name] = planar(kind, t.data, rows, cols)
    return weights


VECTOR = ("F32",)
MATRIX = MATRIX_TYPES      # any weight format of models/quant.py


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every tensor the network reads: name -> (the types it may have, shape [out, in] or [n])."""
    c = cfg
    table = {"token_embd.weight": (MATRIX, (c.vocab, c.dim)),
             "output_norm.weight": (VECTOR, (c.dim,))}
    if not c.tied_embeddings:
        table["output.weight"] = (MATRIX, (c.vocab, c.dim))
    block = {"attn_norm.weight": (VECTOR, (c.dim,)),
             "attn_q.weight": (MATRIX, (c.q_dim, c.dim)),
             "attn_k.weight": (MATRIX, (c.kv_dim, c.dim)),
             "attn_v.weight": (MATRIX, (c.kv_dim, c.dim)),
             "attn_output.weight": (MATRIX, (c.dim, c.q_dim)),
             "ffn_norm.weight": (VECTOR, (c.dim,))}
    if c.n_experts:          # [E, out, in]: expert e's matrix is rows e*out .. (e+1)*out
        E = c.n_experts
        block.update({"ffn_gate_inp.weight": (FLOAT_TYPES, (E, c.dim)),
                      "ffn_gate_exps.weight": (MATRIX, (E, c.ffn_dim, c.dim)),
                      "ffn_up_exps.weight": (MATRIX, (E, c.ffn_dim, c.dim)),
                      "ffn_down_exps.weight": (MATRIX, (E, c.dim, c.ffn_dim))})
    else:
        block.update({"ffn_gate.weight": (MATRIX, (c.ffn_dim, c.dim)),
                      "ffn_up.weight": (MATRIX, (c.ffn_dim, c.dim)),
                      "ffn_down.weight": (MATRIX, (c.dim, c.ffn_dim))})
    if c.rope_freqs:
        table["rope_freqs.weight"] = (VECTOR, (c.head_dim // 2,))
    if c.qk_norm:
        whole = c.qk_norm == "all"
        block.update({"attn_q_norm.weight": (VECTOR, (c.q_dim if whole else c.head_dim,)),
                      "attn_k_norm.weight": (VECTOR, (c.kv_dim if whole else c.head_dim,))})
    if c.post_norms:
        block.update({"post_attention_norm.weight": (VECTOR, (c.dim,)),
                      "post_ffw_norm.weight": (VECTOR, (c.dim,))})
    if c.qkv_bias:
        block.update({"attn_q.bias": (VECTOR, (c.q_dim,)),
                      "attn_k.bias": (VECTOR, (c.kv_dim,)),
                      "attn_v.bias": (VECTOR, (c.kv_dim,))})
    for i in range(c.n_layers):
        table.update({f"blk.{i}.{k}": v for k, v in block.items()})
    return table


def tensor_problems(reader: GGUFReader, cfg: ModelConfig):
    """Yields one line per tensor socllm cannot run as it is in the file."""
    want = expected_tensors(cfg)
    have = {t.name: t for t in reader.tensors}
    for name, (types, shape) in want.items():
        t = have.get(name)
        if t is None:
            yield f"tensor {name} is missing from the model file"
        elif t.tensor_type.name not in types:
            yield (f"tensor {name} has unsupported type {t.tensor_type.name} "
                   f"(socllm runs {'/'.join(types)} here)")
        elif tuple(int(n) for n in reversed(t.shape)) != shape:
            yield (f"tensor {name} has shape {list(reversed(t.shape.tolist()))}, "
                   f"expected {list(shape)}")
    # A tensor the math would silently ignore means wrong output.
    extra = sorted(set(have) - set(want))
    if extra:
        yield f"unsupported tensor {extra[0]} ({len(extra)} unexpected in all)"


def _check_tensors(reader: GGUFReader, cfg: ModelConfig) -> None:
    for problem in tensor_problems(reader, cfg):
        raise ModelError(problem)


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelError(f"model metadata lacks {key}")
        return default
    return field.contents()


def matrix_types(reader: GGUFReader) -> dict:
    """Matrix name -> its GGUF type name (what policies/placement.weight_problem checks)."""
    return {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
