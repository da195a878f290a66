"""What a GGUF file holds and whether socllm runs it (`socllm inspect`), and what this build runs
(`socllm models`). Every reason a file does not run is listed, not only the first."""
from __future__ import annotations

import os
import re
from collections import Counter

from .gguf_file import ModelError, open_gguf
from .llama import read_config, tensor_problems

# families the processors' kernels run, and those only the numpy oracle reads so far
FAMILIES = {
    "llama": {"runs": True, "what": "Llama layout (SmolLM2, TinyLlama, Llama 2): RMSNorm, GQA "
              "attention with RoPE, SwiGLU MLP; tied or untied output; no rope_freqs (Llama 3.1)"},
    "qwen2": {"runs": False, "what": "read by the numpy oracle; the processors' kernels lack its "
              "Q/K/V biases and NEOX rope"},
}
# tensor types per role, as they must be in the file, and where each runs
TENSOR_TYPES = {
    "attention and MLP matrices": {"cpu": ["Q4_1"], "gpu": ["Q4_1"], "npu": ["Q4_1"]},
    "token embedding, output": {"cpu": ["Q8_0"], "gpu": ["Q8_0"], "npu": ["Q8_0"]},
    "norms, biases": {"cpu": ["F32"], "gpu": ["F32"], "npu": ["F32"]},
}
_TYPE_PROBLEM = re.compile(r"tensor (\S+) has unsupported type (\S+) \(socllm runs (\S+) here\)")


def supported() -> dict:
    return {"families": FAMILIES, "tensor_types": TENSOR_TYPES}


def problems(reader) -> list:
    """One line per reason socllm cannot run this file; [] if it runs."""
    arch = _get(reader, "general.architecture")
    if arch not in FAMILIES:
        return [f"architecture {arch!r} is not supported (socllm runs: "
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
    if not FAMILIES[arch]["runs"]:
        out.append(f"architecture {arch!r}: {FAMILIES[arch]['what']}")
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
            "runs": not why, "problems": why}


def _get(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()
