"""Perplexity of the numpy oracle on a fixed public-domain text, per 4-bit weight format.

    .venv/bin/python -m socllm.scripts.perplexity [--window 512] [--json]

Variants of the same model (every Q4_1 matrix; the Q8_0 embedding / lm_head and f32 norms as is):
  q4_1          the GGUF's Q4_1 weights
  q4_1-requant  the control: Q4_1 values quantized again to Q4_1 (llama.cpp's min-max rounding);
                a 4-bit format re-fitted to values already on its grid should change ~nothing
  e0m4          the Q4_1 values requantized to E0M4 FP4 (Transformer-Lite §2.3, models/e0m4.py).
                The GGUF has no original float weights, so this is Q4_1 error plus E0M4 error:
                an upper bound on what E0M4 from the float model would cost, not its measure.
  e0m4-q4codes  E0M4's decode (and kernel) over the Q4_1 codes themselves: the bias is not
                snapped to the code grid (zero is not exact), so nothing is requantized.
The text (scripts/data/) is cut into non-overlapping windows, each run from an empty KV cache;
every token after a window's first is scored: PPL = exp(mean NLL).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from socllm.models.e0m4 import dequantize_e0m4, from_q4_1
from socllm.models.gguf_file import default_model_path, open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.quant import QK, dequant_q4_1
from socllm.models.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1-2.txt"


def requantize_q4_1(t: dict) -> dict:
    """Planar Q4_1 -> its values -> Q4_1 again, as llama.cpp's quantize_row_q4_1_ref rounds:
    d = (max - min) / 15 and m = min per block (stored f16), q = trunc((w - min) / d + 0.5)."""
    w = dequant_q4_1(t["qs"], t["d"], t["m"])
    M, K = w.shape
    g = w.reshape(M, K // QK, QK)                                  # [M, K/32, 32]
    lo, hi = g.min(axis=2), g.max(axis=2)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.minimum(((g - lo[:, :, None]) * inv[:, :, None] + np.float32(0.5)).astype(np.uint8), 15)
    qs = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(M, K // 2)
    return {"qs": qs, "d": d.astype(np.float16), "m": lo.astype(np.float16)}


VARIANTS = {  # planar Q4_1 -> a planar Q4_1 dict or the f32 values an E0M4 kernel computes [M, K]
    "q4_1": lambda t: t,
    "q4_1-requant": requantize_q4_1,
    "e0m4": lambda t: dequantize_e0m4(*from_q4_1(t)),
    "e0m4-q4codes": lambda t: dequantize_e0m4(*from_q4_1(t, snap_bias=False)),
}


def variant_weights(weights: dict, kind: str) -> tuple[dict, float]:
    """The model with every Q4_1 matrix converted; -> (weights, mean |w - w_q4_1| over them)."""
    out, err, n = dict(weights), 0.0, 0
    for name, t in weights.items():
        if isinstance(t, dict) and "m" in t:                       # a Q4_1 matrix
            out[name] = VARIANTS[kind](t)
            if kind != "q4_1":
                new = out[name] if isinstance(out[name], np.ndarray) else \
                    dequant_q4_1(out[name]["qs"], out[name]["d"], out[name]["m"])
                err += float(np.abs(new - dequant_q4_1(t["qs"], t["d"], t["m"])).sum())
                n += new.size
    return out, err / max(n, 1)


def score(oracle: Oracle, ids: list[int], window: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (NLL of every scored token [S] f64, the oracle's argmax there [S])."""
    nll, top = [], []
    for s in range(0, len(ids) - 1, window):
        w = ids[s: s + window]
        if len(w) < 2:
            break
        logits = oracle.logits_for(w)[:-1].astype(np.float64)     # [T-1, vocab]: predicts w[1:]
        mx = logits.max(axis=1, keepdims=True)
        lse = mx[:, 0] + np.log(np.exp(logits - mx).sum(axis=1))
        nll.append(lse - logits[np.arange(len(w) - 1), w[1:]])
        top.append(logits.argmax(axis=1))
    return np.concatenate(nll), np.concatenate(top)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args(argv)
    reader = open_gguf(default_model_path())
    cfg = load_config(reader)
    weights = load_weights(reader, cfg)
    ids = Tokenizer(reader).encode(TEXT.read_text())
    res = {"text": TEXT.name, "tokens": len(ids), "window": a.window, "variants": {}}
    base_top = None
    for kind in a.variants.split(","):
        t0 = time.perf_counter()
        w, mae = variant_weights(weights, kind)
        nll, top = score(Oracle(cfg, w), ids, a.window)
        del w
        base_top = top if base_top is None else base_top
        res["variants"][kind] = {"ppl": float(np.exp(nll.mean())), "mean_nll": float(nll.mean()),
                                 "scored": int(nll.size), "weight_mae_vs_q4_1": mae,
                                 "top1_agree_first": float((top == base_top).mean()),
                                 "seconds": time.perf_counter() - t0}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['text']}: {res['tokens']} tokens, {a.window}-token windows, numpy fp32 oracle")
    first = next(iter(res["variants"]))
    print(f"{'weights':<14}{'PPL':>9}{'mean NLL':>10}{'top-1 = ' + first:>18}{'|w - q4_1|':>13}")
    for kind, r in res["variants"].items():
        print(f"{kind:<14}{r['ppl']:>9.4f}{r['mean_nll']:>10.5f}{r['top1_agree_first']:>18.4f}"
              f"{r['weight_mae_vs_q4_1']:>13.3e}")


if __name__ == "__main__":
    main()
