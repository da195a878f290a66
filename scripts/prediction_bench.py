"""OpenAI's Predicted Outputs in the one engine: one stream regenerating a reply it has made
before (an edited file's "apply" step, say), plain, with speculation on its own (`auto`), and
with the reply as the `prediction`: exact, with one word changed, or with every 20th word changed;
a story (`PROMPT`), and a chat reply whose lines repeat (`RECORDS`). Greedy; every run's text is
checked to be plain decoding's. Interleaved, 3 repetitions; tokens a second, min/median/max.

    python -m socllm.scripts.prediction_bench [--tokens 200] [--reps 3] [--json F]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# a reply whose lines repeat (the model writes the same record keys over and over): once the reply
# leaves an edited prediction, where it rejoins it matters
RECORDS = [{"role": "user", "content": "Write a JSON list of 6 users, each with id, name, email and age."}]


def _edits(text: str) -> dict:
    words = text.split(" ")
    one = " ".join(words[:len(words) // 3] + ["storm"] + words[len(words) // 3 + 1:])
    many = " ".join("storm" if i % 20 == 10 else w for i, w in enumerate(words))
    return {"auto + prediction": {"prediction": text},
            "auto + prediction, one word changed": {"prediction": one},
            "auto + prediction, every 20th word changed": {"prediction": many}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import socllm
    with socllm.LLM() as llm:
        ask = {"story": lambda **kw: llm.generate(PROMPT, max_tokens=args.tokens, ignore_eos=True, **kw),
               "records": lambda **kw: llm.chat(RECORDS, max_tokens=args.tokens, ignore_eos=True, **kw)}
        refs = {w: f(speculate="off")[0].text for w, f in ask.items()}
        runs = {(w, k): kw for w in ask for k, kw in
                ({"off": {"speculate": "off"}, "auto": {}} | _edits(refs[w])).items()}
        out = {k: [] for k in runs}
        for _ in range(args.reps):
            for (w, name), kw in runs.items():
                t = time.perf_counter()
                [o] = ask[w](**kw)
                dt = time.perf_counter() - t
                if o.text != refs[w]:
                    raise SystemExit(f"{w}, {name}: the text differs from plain decoding's")
                out[w, name].append(round(args.tokens / dt, 1))
    res = {"command": "python -m socllm.scripts.prediction_bench", "machine": platform.node(),
           "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
           "tokens": args.tokens, "prompt": PROMPT, "records": RECORDS,
           "tok_s": {f"{w}: {k}": {"runs": v, "min": min(v), "median": statistics.median(v), "max": max(v)}
                     for (w, k), v in out.items()}}
    for k, v in res["tok_s"].items():
        print(f"{k:54s} {v['min']:7.1f} {v['median']:7.1f} {v['max']:7.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
