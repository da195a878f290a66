"""The oracle's greedy tokens on an MoE GGUF, teacher-forced through llama.cpp on the same file
(issue 29's first target): at each generated position, is the oracle's token llama.cpp's top-1,
or within --margin (0.5) of llama.cpp's top logit (a near-tie)? On a MoEfied model the router is
nearly flat, and llama.cpp picks experts by probability where socllm picks them by logit
(docs/moe-engine.md), so a near-tie in routing can move a logit.

    python -m socllm.scripts.moe_tokens --model F.gguf [--tokens 16] [--greedy-set 12|48] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.tokenizer import Tokenizer
from socllm.scripts.perplexity import GREEDY_SETS, llama_logits, llama_model, prompt_ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe_tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--greedy-set", type=int, choices=sorted(GREEDY_SETS), default=12)
    p.add_argument("--margin", type=float, default=0.5)
    p.add_argument("--json")
    a = p.parse_args(argv)
    reader = open_gguf(a.model)
    cfg = load_config(reader)
    oracle = Oracle(cfg, load_weights(reader, cfg))
    prompts = prompt_ids(reader, Tokenizer(reader), GREEDY_SETS[a.greedy_set])
    llm = llama_model(a.model, max(len(x) for x in prompts) + a.tokens, threads=2)
    top1 = near = positions = 0
    gaps, distinct = [], set()
    for ids in prompts:
        want = oracle.greedy(ids, a.tokens)
        distinct.update(want)
        z = llama_logits(llm, ids + want)[len(ids) - 1: len(ids) - 1 + a.tokens]    # [tokens, V]
        gap = z.max(1) - z[np.arange(a.tokens), want]       # 0 where the oracle's is llama.cpp's top-1
        top1 += int((z.argmax(1) == np.asarray(want)).sum())
        near += int((gap <= a.margin).sum())
        positions += a.tokens
        gaps.append(float(gap.max()))
    out = {"model": Path(a.model).name, "prompts": len(prompts), "positions": positions,
           "distinct_tokens": len(distinct), "llamacpp_top1": top1, f"within_{a.margin}": near,
           "largest_gap": max(gaps), "gap_by_prompt": [round(g, 4) for g in gaps]}
    print(f"{positions} positions of {len(prompts)} prompts ({len(distinct)} distinct tokens): the "
          f"oracle's token is llama.cpp's top-1 at {top1}, within {a.margin} of its top logit at "
          f"{near}; the largest gap {max(gaps):.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
