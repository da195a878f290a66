"""Two mask libraries on the default model's tokenizer: llguidance (socllm's) and outlines-core
(measured only if installed: `pip install outlines-core numba`, not a socllm dependency).
xgrammar, the third well-kept one, requires torch, transformers and triton (its wheel's
Requires-Dist), which socllm's run time never loads.

    python -m socllm.scripts.mask_bench [--steps 64] [--json FILE]

Per library and schema (agent_api_bench's five): the time to compile the schema for this
vocabulary, and the time of one step's mask (median and max over a walk of --steps tokens,
each a random allowed token; the walk restarts when the text completes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .agent_api_bench import SCHEMAS


def _walk(first, allowed, advance, steps, rng) -> list:
    """Mask times (s) over `steps` steps: allowed(state) -> ids, advance(state, id) -> state."""
    times, state = [], first()
    for _ in range(steps):
        t = time.perf_counter()
        ids = allowed(state)
        times.append(time.perf_counter() - t)
        if len(ids) == 0:
            state = first()
            continue
        state = advance(state, int(ids[rng.integers(len(ids))]))
        if state is None:
            state = first()
    return times


def llguidance_costs(tokenizer, steps: int, rng) -> list:
    import llguidance
    import llguidance.numpy as llnp
    t = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=len(tokenizer._tokens),
                                 eos_token=tokenizer.stop_ids())
    setup = time.perf_counter() - t
    out, mask = [], llnp.allocate_token_bitmask(1, len(tokenizer._tokens))
    for schema in SCHEMAS:
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                defaults={"whitespace_flexible": False})
        first = lambda: llguidance.LLMatcher(tok, grammar, log_level=0)
        first()
        compile_s = time.perf_counter() - t

        def allowed(m):
            llnp.fill_next_token_bitmask(m, mask)
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:len(tokenizer._tokens)]
            return np.flatnonzero(bits)

        def advance(m, i):
            if i in tokenizer.stop_ids() or not m.consume_token(i) or m.is_stopped():
                return None
            return m
        times = _walk(first, allowed, advance, steps, rng)
        out.append({"compile_s": compile_s, "mask_ms_median": 1e3 * statistics.median(times),
                    "mask_ms_max": 1e3 * max(times)})
    return [{"tokenizer_s": setup}] + out


def outlines_costs(tokenizer, steps: int, rng) -> list:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t = time.perf_counter()
    stops = set(tokenizer.stop_ids())
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: dict = {}
    for i, s in enumerate(tokenizer._tokens):
        if i in stops:
            continue
        try:
            key = bytes(byte_of[c] for c in s)
        except KeyError:                       # a special token: never in JSON
            continue
        vocab.setdefault(key, []).append(i)
    voc = Vocabulary(tokenizer.stop_ids()[0], vocab)
    setup = time.perf_counter() - t
    out = []
    for schema in SCHEMAS:
        t = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(schema)), voc)
        compile_s = time.perf_counter() - t
        first = lambda: Guide(index)

        def advance(g, i):
            if i in stops:
                return None
            g.advance(i)
            return None if g.is_finished() else g
        times = _walk(first, lambda g: np.asarray(g.get_tokens()), advance, steps, rng)
        out.append({"compile_s": compile_s, "mask_ms_median": 1e3 * statistics.median(times),
                    "mask_ms_max": 1e3 * max(times)})
    return [{"tokenizer_s": setup}] + out


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies spell bytes so)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mask_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from socllm.models.gguf_file import default_model_path, open_gguf
    from socllm.models.tokenizer import Tokenizer
    tokenizer = Tokenizer(open_gguf(default_model_path()))
    report = {"device": "2-core CPU", "vocab": len(tokenizer._tokens), "steps": a.steps, "results": {}}
    for name, fn in (("llguidance", llguidance_costs), ("outlines-core", outlines_costs)):
        try:
            report["results"][name] = r = fn(tokenizer, a.steps, np.random.default_rng(0))
        except ImportError as e:
            report["results"][name] = f"not installed: {e}"
            print(f"{name}: not installed", flush=True)
            continue
        print(f"{name}: tokenizer {r[0]['tokenizer_s']:.2f} s; per schema compile s "
              f"{[round(x['compile_s'], 3) for x in r[1:]]}, mask ms median "
              f"{[round(x['mask_ms_median'], 3) for x in r[1:]]}, max "
              f"{[round(x['mask_ms_max'], 2) for x in r[1:]]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
