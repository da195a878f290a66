"""Draft heads for speculative decoding, as files beside the models (scripts/train_heads.py
trains them; policies/drafting.py Heads runs them): heads/<model file's stem>.npz holds each
head's ResBlock (W [K, D, D], b [K, D]), the token subset their logits cover (vocab [V']) and a
JSON record (meta: the model file's sha256, the accuracies measured on held-out rows)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

HEADS_DIR = Path(__file__).resolve().parent / "heads"


def heads_path(model_path: str) -> str:
    return str(HEADS_DIR / (Path(model_path).stem + ".npz"))


def load_heads(model_path: str) -> dict | None:
    """The heads trained for this model file (its sha256 must match the one they were trained
    on), with the embedding rows of their token subset in f32; None if there are none."""
    path = Path(heads_path(model_path))
    if not path.exists():
        return None
    z = np.load(path)
    meta = json.loads(bytes(z["meta"]).decode())
    with open(model_path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != meta["model_sha256"]:
            return None
    from .gguf_file import open_gguf
    from .llama import load_config, load_weights
    from .oracle import _dequant
    reader = open_gguf(model_path)
    cfg = load_config(reader)
    vocab = z["vocab"].astype(np.int64)
    embed = _dequant(load_weights(reader, cfg)["token_embd.weight"])[vocab].astype(np.float32)
    return {"W": z["W"].astype(np.float32), "b": z["b"].astype(np.float32), "vocab": vocab,
            "embed": np.ascontiguousarray(embed), "meta": meta}
