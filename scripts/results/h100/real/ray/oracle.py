"""The numpy oracle's greedy continuations of the prompts, and checks against them.

    python oracle.py greedy MODEL N OUT.json          the oracle's N greedy tokens for each prompt
    python oracle.py local ORACLE.json GEN.jsonl       `socllm generate --local --json` runs against them
"""
import json
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, there was a little robot who"]


def greedy(model: str, n: int, out: str):
    from socllm.models.gguf_file import open_gguf
    from socllm.models.llama import load_config, load_weights
    from socllm.models.oracle import Oracle
    from socllm.models.tokenizer import Tokenizer
    r = open_gguf(model)
    cfg = load_config(r)
    tok = Tokenizer(r)
    o = Oracle(cfg, load_weights(r, cfg))
    stops = set(tok.stop_ids())
    res = []
    for p in PROMPTS:
        t0 = time.perf_counter()
        ids = tok.encode(p, bos=tok.add_bos)
        want = o.greedy(ids, n)
        cut = next((i for i, t in enumerate(want) if t in stops), len(want))
        res.append({"prompt": p, "prompt_tokens": ids, "tokens": want, "stop_at": cut,
                    "text": tok.decode(want[:cut]), "s": round(time.perf_counter() - t0, 2)})
        print(f"oracle {p!r}: {len(want)} tokens in {res[-1]['s']} s, stop at {cut}: {res[-1]['text']!r}")
    json.dump({"model": model, "n": n, "stop_ids": sorted(stops), "prompts": res}, open(out, "w"), indent=1)


def local(oracle: str, gen: str):
    ora = {d["prompt"]: d for d in json.load(open(oracle))["prompts"]}
    for line in open(gen):
        run = json.loads(line)
        g, want = run.get("out"), ora[run["prompt"]]
        if not g:
            print(f"{run['precision']} {run['prompt']!r}: rc {run['rc']}, no output"); continue
        ok_p = g["prompt_tokens"] == want["prompt_tokens"]
        w = want["tokens"][:len(g["tokens"])]
        same = sum(a == b for a, b in zip(g["tokens"], w))
        first = next((i for i, (a, b) in enumerate(zip(g["tokens"], w)) if a != b), None)
        t = g["timings"]
        print(f"{g['precision']:>4} {run['prompt']!r}: plan {g['plan']} {g['placement']}, prompt tokens "
              f"equal {ok_p}, tokens == oracle {g['tokens'] == w} ({same}/{len(w)}, first difference "
              f"{first}), ttft {t['ttft_s'] * 1e3:.0f} ms, prefill {t['prefill_tok_s']:.0f} tok/s, decode "
              f"{t['decode_tok_s']:.1f} tok/s, wall {run['wall_s']} s, rc {run['rc']}")


if __name__ == "__main__":
    if sys.argv[1] == "greedy":
        greedy(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        local(sys.argv[2], sys.argv[3])
