"""The oracle's greedy tokens on an MoE GGUF, teacher-forced through llama.cpp on the same file
(issue 29's first target): at each generated position, is the oracle's token llama.cpp's top-1,
or within --margin (0.5) of llama.cpp's top logit (a near-tie)? On a MoEfied model the router is
nearly flat, and llama.cpp picks experts by probability where socllm picks them by logit
(docs/moe-engine.md), so a near-tie in routing can move a logit.

    python -m socllm.scripts.moe_tokens --model F.gguf [--tokens 16] [--greedy-set 12|48]
        [--against llama.cpp|rounded] [--json OUT]

--against rounded: the same check with the oracle itself in llama.cpp's place, computing as
llama.cpp's CPU path rounds (`RoundedOracle`: each activation row cut to 8-bit blocks of 32 with
an f16 scale before every quantized matmul, as ggml's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products
take it; K and V kept in f16, as llama.cpp's cache): how far rounding alone, with no other
difference, moves the tokens of this file. On the dense model it moves none past the margin; on a
MoEfied file as many as llama.cpp does (docs/moe-engine.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import KVCache, Oracle
from socllm.models.tokenizer import Tokenizer
from socllm.scripts.perplexity import GREEDY_SETS, llama_logits, llama_model, prompt_ids


QUANTIZED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
             "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")     # the router stays f32


def q8_blocks(x: np.ndarray) -> np.ndarray:
    """Rows of x cut to ggml's 8-bit activation blocks: per 32 values an f16 scale d = max|x| /
    127 and round(x / d) (Q8_0 / Q8_1's values), back as f32."""
    x = np.asarray(x, np.float32)
    b = x.reshape(-1, x.shape[-1] // 32, 32)
    d = (np.abs(b).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    q = np.round(b / np.where(d > 0, d, 1))
    return (q * d).reshape(x.shape)


class _Rounded:
    """A weight matrix whose products `x @ w.T` take x through q8_blocks (the oracle's forms:
    w.T, w.reshape(...)[e].T)."""
    __array_ufunc__ = None                  # numpy leaves `x @ self` to __rmatmul__

    def __init__(self, w):
        self.w = w

    @property
    def T(self):
        return _Rounded(self.w.T)

    def reshape(self, *shape):
        return _Rounded(self.w.reshape(*shape))

    def __getitem__(self, i):
        return _Rounded(self.w[i])

    def __rmatmul__(self, x):
        return q8_blocks(x) @ self.w


class RoundedOracle(Oracle):
    """An oracle computing as llama.cpp's CPU path rounds (module docstring), over the given
    oracle's dequantized weights (shared, not copied)."""

    def __init__(self, oracle: Oracle):
        self.__dict__.update(oracle.__dict__)
        self.layers = [{k: _Rounded(v) if k.removesuffix(".weight") in QUANTIZED else v
                        for k, v in lw.items()} for lw in oracle.layers]
        self.lm_head = _Rounded(oracle.lm_head)

    def new_cache(self, ctx: int) -> KVCache:
        kv = KVCache(self.cfg, ctx)
        kv.k, kv.v = kv.k.astype(np.float16), kv.v.astype(np.float16)
        return kv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe_tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--greedy-set", type=int, choices=sorted(GREEDY_SETS), default=12)
    p.add_argument("--margin", type=float, default=0.5)
    p.add_argument("--against", choices=("llama.cpp", "rounded"), default="llama.cpp")
    p.add_argument("--json")
    a = p.parse_args(argv)
    reader = open_gguf(a.model)
    cfg = load_config(reader)
    oracle = Oracle(cfg, load_weights(reader, cfg))
    prompts = prompt_ids(reader, Tokenizer(reader), GREEDY_SETS[a.greedy_set])
    if a.against == "rounded":
        logits = RoundedOracle(oracle).logits_for
    else:
        llm = llama_model(a.model, max(len(x) for x in prompts) + a.tokens, threads=2)
        logits = lambda ids: llama_logits(llm, ids)     # noqa: E731
    top1 = near = positions = 0
    gaps, distinct = [], set()
    for ids in prompts:
        want = oracle.greedy(ids, a.tokens)
        distinct.update(want)
        z = logits(ids + want)[len(ids) - 1: len(ids) - 1 + a.tokens]    # [tokens, V]
        gap = z.max(1) - z[np.arange(a.tokens), want]       # 0 where the oracle's is llama.cpp's top-1
        top1 += int((z.argmax(1) == np.asarray(want)).sum())
        near += int((gap <= a.margin).sum())
        positions += a.tokens
        gaps.append(float(gap.max()))
    out = {"model": Path(a.model).name, "against": a.against, "prompts": len(prompts), "positions": positions,
           "distinct_tokens": len(distinct), "llamacpp_top1": top1, f"within_{a.margin}": near,
           "largest_gap": max(gaps), "gap_by_prompt": [round(g, 4) for g in gaps]}
    print(f"{positions} positions of {len(prompts)} prompts ({len(distinct)} distinct tokens): the "
          f"oracle's token is {a.against}'s top-1 at {top1}, within {a.margin} of its top logit at "
          f"{near}; the largest gap {max(gaps):.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
