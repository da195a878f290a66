"""What a GGUF file holds and whether socllm runs it (`socllm inspect`), and what this build runs
(`socllm models`). Every reason a file does not run is listed, not only the first."""
from __future__ import annotations

import os
import re
from collections import Counter

from .gguf_file import ModelError, open_gguf
from .llama import matrix_types, read_config, tensor_problems

# families the processors' kernels run, and those only the numpy oracle reads so far
FAMILIES = {
    "llama": {"runs": True, "what": "Llama layout (SmolLM2, TinyLlama, Llama 2, Llama 3.x): RMSNorm, "
              "GQA attention with RoPE (Llama 3.1's rope_freqs too), SwiGLU MLP or Mixtral-style "
              "experts (top-k, renormalized); tied or untied output"},
    "qwen2": {"runs": True, "what": "Qwen2 / Qwen2.5: the Llama layout with Q/K/V biases and NEOX rope"},
    "qwen3": {"runs": True, "what": "Qwen3: the Llama layout with per-head Q/K RMSNorm and NEOX rope"},
    "gemma3": {"runs": True, "what": "Gemma 3: per-head Q/K RMSNorm, NEOX rope, norms after each "
               "sublayer too, scaled embeddings, GeGLU (tanh-GELU), sliding-window layers with their "
               "own rope base between global ones, a SentencePiece-style tokenizer"},
    "qwen3moe": {"runs": True, "what": "Qwen3-MoE: Qwen3's attention, top-k of E SwiGLU experts of "
                 "expert_feed_forward_length, renormalized softmax weights"},
    "olmoe": {"runs": True, "what": "OLMoE: Q/K RMSNorm over the whole projections, NEOX rope, top-k "
              "of E SwiGLU experts, softmax weights not renormalized"},
}


def tensor_types() -> dict:
    """Tensor types per role, as they are in the file, and the processors that read each."""
    from socllm.policies.placement import MATRIX_FORMATS, TABLE_FORMATS
    return {"attention and MLP matrices": {p: list(v) for p, v in MATRIX_FORMATS.items()},
            "token embedding, output": {p: list(v) for p, v in TABLE_FORMATS.items()},
            "norms, biases": {p: ["F32"] for p in MATRIX_FORMATS}}
_TYPE_PROBLEM = re.compile(r"tensor (\S+) has unsupported type (\S+) \(socllm runs (\S+) here\)")


def supported() -> dict:
    return {"families": FAMILIES, "tensor_types": tensor_types()}


def processors(reader) -> dict:
    """processor -> None if its kernels read every weight of the file, else why not."""
    from socllm.policies.placement import MATRIX_FORMATS, weight_problem
    types = matrix_types(reader)
    return {p: weight_problem(p, types) for p in MATRIX_FORMATS}


def problems(reader) -> list:
    """One line per reason socllm cannot run this file; [] if it runs."""
    arch = _get(reader, "general.architecture")
    if arch not in FAMILIES or not FAMILIES[arch]["runs"]:
        why = f": {FAMILIES[arch]['what']}" if arch in FAMILIES else ""
        return [f"architecture {arch!r} is not supported{why} (socllm runs: "
                f"{', '.join(k for k, v in FAMILIES.items() if v['runs'])})"]
    try:
        cfg = read_config(reader)
    except ModelError as e:
        return [str(e)]
    out, types = [], Counter()
    example = {}
    for line in tensor_problems(reader, cfg):
        m = _TYPE_PROBLEM.fullmatch(line)
        if m:                                   # one line per (found, wanted) type pair
            types[m.group(2), m.group(3)] += 1
            example.setdefault((m.group(2), m.group(3)), m.group(1))
        else:
            out.append(line)
    for (found, want), n in types.items():
        out.append(f"{n} tensor(s) of type {found} where socllm runs {want} "
                   f"(e.g. {example[found, want]})")
    return out


def inspect(path: str) -> dict:
    """Architecture, sizes, tensor types, tokenizer, chat template, and whether socllm runs it."""
    reader = open_gguf(path)
    arch = _get(reader, "general.architecture")
    types: dict = {}
    params = 0
    for t in reader.tensors:
        n = 1
        for d in t.shape:
            n *= int(d)
        params += n
        e = types.setdefault(t.tensor_type.name, {"tensors": 0, "mb": 0.0})
        e["tensors"] += 1
        e["mb"] += int(t.n_bytes) / 2**20
    cfg = {k: _get(reader, f"{arch}.{key}") for k, key in (
        ("layers", "block_count"), ("dim", "embedding_length"), ("ffn_dim", "feed_forward_length"),
        ("heads", "attention.head_count"), ("kv_heads", "attention.head_count_kv"),
        ("context", "context_length"), ("rope_base", "rope.freq_base"))}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    template = _get(reader, "tokenizer.chat_template")
    why = problems(reader)
    return {"file": os.path.abspath(path), "file_mb": round(os.path.getsize(path) / 2**20, 1),
            "name": _get(reader, "general.name"), "architecture": arch, "parameters": params,
            "config": cfg | {"vocab": len(tokens.data) if tokens else None},
            "tensor_types": {k: {"tensors": v["tensors"], "mb": round(v["mb"], 1)} for k, v in types.items()},
            "tokenizer": {"model": _get(reader, "tokenizer.ggml.model"),
                          "pre": _get(reader, "tokenizer.ggml.pre")},
            "chat_template": template,
            "runs": not why, "problems": why,
            "processors": {p: why_not or "runs" for p, why_not in processors(reader).items()}
            if not why else {}}


def _get(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()
