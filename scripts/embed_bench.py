"""Embeddings, socllm against llama.cpp: 32 distinct texts of ~100 tokens (public-domain text),
embedded one request each (socllm.LLM.embed: queued together; llama-cpp-python's Llama.embed one
text after another, mean pooling, normalized), thread budget 2 for both, engines alternating.

    python -m socllm.scripts.embed_bench [--rounds 2] [--reps 3] [--words 80] [--texts 32]
        [--engines socllm,llamacpp] [--json FILE]

Reports input tokens/s per engine (min/median/max over every repetition) and the cosine between
the two engines' vectors (llama.cpp rounds activations to int8; socllm at its default q16).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from socllm.scripts.serve_bench import prompts


def _socllm(reps: int, texts: list) -> dict:
    import socllm
    with socllm.LLM() as llm:
        llm.embed(texts[:2])
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            vecs = llm.embed(texts)
            ts.append(time.perf_counter() - t)
        n = sum(len(llm._client.tokenize(x)) for x in texts)
    return {"s": ts, "tokens": n, "vectors": vecs}


def _llamacpp(reps: int, texts: list) -> dict:
    import llama_cpp
    from socllm.models.gguf_file import default_model_path
    m = llama_cpp.Llama(default_model_path(), embedding=True, n_ctx=2048, n_threads=2,
                        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)
    m.embed(texts[:2])
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        vecs = [m.embed(x, normalize=True) for x in texts]
        ts.append(time.perf_counter() - t)
    return {"s": ts, "tokens": sum(len(m.tokenize(x.encode())) for x in texts), "vectors": vecs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--words", type=int, default=80, help="words a text (80: ~100 tokens)")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--engines", default="socllm,llamacpp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", choices=("socllm", "llamacpp"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    texts = prompts(a.texts, a.words, 3)
    if a.one:                      # one engine in its own process (its own threads and memory)
        print(json.dumps((_socllm if a.one == "socllm" else _llamacpp)(a.reps, texts)))
        return 0
    engines = a.engines.split(",")
    runs: dict = {e: [] for e in engines}
    vecs = {}
    for r in range(a.rounds):
        for eng in engines if r % 2 == 0 else engines[::-1]:
            out = json.loads(subprocess.run([sys.executable, "-m", "socllm.scripts.embed_bench",
                                             "--one", eng, "--reps", str(a.reps), "--words",
                                             str(a.words), "--texts", str(a.texts)],
                                            capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            runs[eng] += [out["tokens"] / s for s in out["s"]]
            vecs[eng] = out["vectors"]
    import numpy as np
    from socllm.policies.plan_cache import cpu_name
    cpu = cpu_name()
    res = {"device": f"{cpu}, 2 threads", "texts": len(texts), "words": a.words,
           "tok_s": {k: [round(min(v)), round(statistics.median(v)), round(max(v))] for k, v in runs.items()}}
    if len(engines) == 2:
        cos = [float(np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in zip(*vecs.values())]
        res |= {"ratio_median": round(statistics.median(runs[engines[0]]) / statistics.median(runs[engines[1]]), 2),
                "cosine_min_median": [round(min(cos), 5), round(statistics.median(cos), 5)]}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
