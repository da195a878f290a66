"""A reactive request's decode beside proactive ones, under `--policy agent` (Agent.xpu §4.5 ②):
how long its tokens take when background agents decode at the same time.

    python -m socllm.scripts.reactive_decode [--reps 4] [--proactive 6] [--json FILE]

One socllm.LLM engine (policy agent, serve's other defaults). Each repetition starts --proactive
proactive requests (input-grounded chat prompts of scripts/data/spec_prompts.json, 400 tokens,
EOS ignored), waits until they decode, then sends one reactive request (another grounded prompt,
160 tokens, EOS ignored) and times its decode: the service's own record of it (first token to
the last, stamped where the engine accepts a sampled token: Service.request(rid)["timings"]).
The proactive requests are cancelled before the next repetition; repetition r uses the same
prompts on any code, so two checkouts' runs compare prompt by prompt.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

PROMPTS = pathlib.Path(__file__).resolve().parent / "data" / "spec_prompts.json"


def run(reps: int, proactive: int, wait_s: float = 6.0) -> list:
    import ray
    import socllm
    grounded = [p for p in json.loads(PROMPTS.read_text())["prompts"] if p["kind"] == "grounded"]
    out = []
    with socllm.LLM(policy="agent") as llm:
        client = llm._client
        for rep in range(reps):
            bg = [client.submit(messages=grounded[(rep + i) % len(grounded)]["messages"], max_tokens=400,
                                ignore_eos=True, priority="proactive") for i in range(proactive)]
            time.sleep(wait_s)
            rid = client.submit(messages=grounded[(rep + proactive + 1) % len(grounded)]["messages"],
                                max_tokens=160, ignore_eos=True, priority="reactive")
            for _ in client.pieces(rid):
                pass
            req = ray.get(client.service.request.remote(rid))
            t = req["timings"]
            out.append({"rep": rep, "tokens": req["tokens"] if isinstance(req["tokens"], int) else len(req["tokens"]),
                        "decode_tok_s": t.get("decode_tok_s"), "ttft_s": t.get("ttft_s"),
                        "speculation": req.get("speculation")})
            print(json.dumps(out[-1]), flush=True)
            for b in bg:
                client.cancel(b)
            time.sleep(2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--proactive", type=int, default=6)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    out = run(a.reps, a.proactive)
    rates = [o["decode_tok_s"] for o in out if o["decode_tok_s"]]
    print(f"reactive decode tok/s: min {min(rates):.1f} / median {statistics.median(rates):.1f} / max {max(rates):.1f}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"settings": vars(a), "runs": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
