"""An agent workload (Agent.xpu §6.1): reactive and proactive arrivals, Poisson and independent,
with lengths shaped like §6.1 Figure 7: reactive prompts and outputs long-tailed (log-normal,
most short, a few long), proactive prompts longer (summaries of documents) with moderate outputs.
Pure: the caller gives the text prompts are cut from and how to count a prompt's tokens.
"""
from __future__ import annotations

import math
import random

# (median, log-sigma, low, high): prompt words and output tokens per class (Figure 7's shapes)
LENGTHS = {"reactive": {"words": (40, 1.0, 4, 700), "tokens": (72, 0.8, 8, 400)},
           "proactive": {"words": (320, 0.6, 60, 1000), "tokens": (96, 0.5, 16, 256)}}


def trace(minutes: float, rates: dict, seed: int, words: list, count, lengths: dict = LENGTHS) -> list:
    """[(arrival s, class, prompt text, output tokens, prompt tokens)], arrivals of each class
    Poisson at its rate per minute, generated independently (§6.1); prompts are runs of `words`,
    count(text) their tokens; lengths: LENGTHS or another table of its form."""
    rng = random.Random(seed)
    out = []
    for cls in ("reactive", "proactive"):
        t, rate = 0.0, rates[cls] / 60.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= minutes * 60:
                break
            n = min(_draw(rng, *lengths[cls]["words"]), len(words) - 1)
            start = rng.randrange(0, len(words) - n)
            text = " ".join(words[start:start + n])
            out.append((t, cls, text, _draw(rng, *lengths[cls]["tokens"]), count(text)))
    return sorted(out)


def _draw(rng, median, sigma, lo, hi) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))
