"""Draft heads for speculative decoding, as files beside the models (scripts/train_heads.py
trains them; policies/drafting.py Heads runs them): heads/<model file's stem>.npz holds each
head's ResBlock (W [K, D, D], b [K, D]; Hydra's heads also A [K, D, D]), the token subset
their logits cover (vocab [V']) and a JSON record (meta: the model file's sha256, the accuracies
measured on held-out rows)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .gguf_file import file_digest

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
    if file_digest(model_path) != meta["model_sha256"]:
        return None
    vocab = z["vocab"].astype(np.int64)
    return {"W": z["W"].astype(np.float32), "b": z["b"].astype(np.float32), "vocab": vocab,
            "embed": embedding_rows(model_path, vocab), "meta": meta,
            "A": z["A"].astype(np.float32) if "A" in z.files else None}


def embedding_rows(model_path: str, rows: np.ndarray) -> np.ndarray:
    """The token embedding's rows `rows`, f32 [len(rows), D], read without the rest of the model
    (a Q8_0 table: only those rows are dequantized)."""
    from .gguf_file import open_gguf
    from .oracle import _dequant
    from .quant import dequant_q8_0, float_matrix, planar, repack_q8_0
    reader = open_gguf(model_path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    cols, n = (int(x) for x in t.shape)
    kind = t.tensor_type.name
    # those rows' bytes only (a row is whole blocks): a copy of the whole table (27 MB for
    # SmolLM2's Q8_0 codes) would stay in the service's memory, at the top of a thread's
    # malloc arena that malloc_trim does not give back
    raw, k = np.asarray(t.data).reshape(n, -1)[rows], len(rows)
    if kind == "Q8_0":
        w = repack_q8_0(raw, k, cols)
        out = dequant_q8_0(w["qs"], w["d"])
    else:
        w = float_matrix(kind, raw, k, cols) if kind in ("F32", "F16", "BF16") else planar(kind, raw, k, cols)
        out = _dequant(w)
    return np.ascontiguousarray(out, dtype=np.float32)
