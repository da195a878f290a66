"""The figures of run.sh's outputs in one table: python summary.py RESULTS_FOLDER...

check-*: gpu_decode --check (greedy tokens and each step's logits against the numpy oracle);
speed-*: gpu_decode's decode tok/s, one value a rep; llama-bench-*: llama.cpp's tg64 / pp128,
one value a repetition (samples_ts). min / median / max over every value of an engine and precision.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"{os.path.basename(path)}: no result ({e})")
        return None


def mmm(xs):
    return f"min {min(xs):.1f} / median {statistics.median(xs):.1f} / max {max(xs):.1f} (n={len(xs)})"


def main(folders: list) -> None:
    def files(pattern):
        return sorted(p for res in folders for p in glob.glob(f"{res}/{pattern}"))

    print("== correctness: gpu_decode --check 32 (greedy tokens vs the numpy oracle; logits fed the GPU's tokens)")
    for path in files("check-*.json") + files("speed-*-1.json"):
        r = load(path)
        if r is None or "oracle_equal" not in r:
            continue
        print(f"{os.path.basename(path):20s} {r['precision']:4s} prompt {r['prompt_len']:3d} tok: "
              f"tokens equal {r['oracle_tokens_equal']}/{len(r['oracle_tokens'])}"
              f" (first difference {r['oracle_first_difference']}), top-1 on the same tokens "
              f"{r['oracle_top1_agree']}/{len(r['oracle_tokens'])}, logit max|err|/max|logit| "
              f"max {r['logit_rel_err_max']:.2e} median {r['logit_rel_err_median']:.2e}")
    print("== speed: decode tok/s (prompt 128, 64 tokens)")
    speed = {}
    for prec in ("q16", "f32"):
        xs = []
        for path in files(f"speed-{prec}-*.json"):
            r = load(path)
            if r:
                xs += r["decode_tok_s"]
                print(f"  {os.path.basename(path)}: decode {[round(x, 1) for x in r['decode_tok_s']]},"
                      f" prefill {[round(x, 1) for x in r['prefill_tok_s']]}, step median {r['decode_step_ms_median']:.3f} ms")
        if xs:
            speed[prec] = xs
            print(f"socllm {prec}: {mmm(xs)}")
    lb = {"tg": [], "pp": []}
    for path in files("llama-bench-*.json"):
        for r in load(path) or []:
            kind = "tg" if r["n_gen"] else "pp"
            lb[kind] += r["samples_ts"]
            print(f"  {os.path.basename(path)}: {kind} {r['n_prompt'] or r['n_gen']}: {[round(x, 1) for x in r['samples_ts']]}"
                  f" ({r.get('gpu_info', '')}, {r.get('type_k', '')}, n_gpu_layers {r.get('n_gpu_layers')})")
    for kind in ("tg", "pp"):
        if lb[kind]:
            print(f"llama.cpp CUDA {'tg64' if kind == 'tg' else 'pp128'}: {mmm(lb[kind])}")
    if lb["tg"]:
        t = lb["tg"]
        for prec, xs in speed.items():
            print(f"ratio socllm {prec} / llama.cpp tg64: median {statistics.median(xs) / statistics.median(t):.3f}"
                  f" (range {min(xs) / max(t):.3f}-{max(xs) / min(t):.3f})")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
