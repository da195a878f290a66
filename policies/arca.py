"""Ghidorah's ARCA partition (§III-C3) as a policy: pure, no Ray, no kernels.

The hcmp plan (graph/hcmp.py) puts a share of each linear's output columns on the CPU. ARCA
starts from the share the processors' speeds alone give (EdgeNN: each in proportion to its
speed), then moves it one step at a time in whichever direction makes the split step faster,
timed under contention (both processors at once, on whatever they share: cores, bandwidth),
and stops where neither direction does. The engine times real steps (actors/service.py, a
share per band of context: the best share moves as the KV cache grows); the simulated SoCs
time modelled ones (policies/sim/speculative.py arca_ratio). Both climb here.
"""
from __future__ import annotations

import math

SHARE_UNITS = 8           # the engine's step of the CPU's share: 1/8 of each linear's columns
POSITIONS = (128, 1024)   # where the engine times a verifying step: a short and a long context
KEY_UNITS = 1024          # an hcmp program's bucket (its key's last field): its CPU share in 1/1024


def share_key(share: float) -> int:
    """The bucket of the hcmp program that puts `share` of each linear's columns on the CPU."""
    if not 0 <= share <= 1:
        raise ValueError(f"an hcmp share is in [0, 1], not {share}")
    return round(share * KEY_UNITS)


def solo_share(gpu_s: float, cpu_s: float) -> float:
    """The CPU's share from the processors' step times alone (EdgeNN; ARCA's start): each
    processor's share of the work in proportion to its speed."""
    if not (gpu_s > 0 and cpu_s > 0):
        raise ValueError(f"step times must be positive, got {gpu_s}, {cpu_s}")
    return gpu_s / (gpu_s + cpu_s)


def climb(time_at, start: int, lo: int, hi: int) -> tuple:
    """ARCA's adjustment: from step `start` (in lo .. hi), move to the faster neighbour while one
    is faster than where it stands. time_at(k) -> seconds at step k, called once per k.
    -> (the step chosen, its seconds, {step: seconds} of every step timed)."""
    if not lo <= start <= hi:
        raise ValueError(f"start {start} outside {lo} .. {hi}")
    seen = {}

    def t(k):
        if k not in seen:
            seen[k] = time_at(k)
        return seen[k]

    k, best = start, t(start)
    while True:
        moves = [(t(j), j) for j in (k - 1, k + 1) if lo <= j <= hi]
        if not moves:
            return k, best, seen
        s, j = min(moves)
        if s >= best:
            return k, best, seen
        k, best = j, s


def start_step(share: float, units: int) -> int:
    """The step nearest a share, at least 1 and at most units - 1 (both processors take part:
    the climb may still reach either end)."""
    return min(units - 1, max(1, round(share * units)))


def positions(context: int, rows: int) -> tuple:
    """The positions a verifying step of `rows` rows is timed at, for a context of `context`:
    POSITIONS that fit (at least the first, moved down to fit a small context)."""
    fit = tuple(p for p in POSITIONS if p + rows <= context)
    return fit or (max(0, context - rows),)


def band_of(bands: list, pos: float) -> float:
    """The share of a step whose rows' mean position is pos: bands [(position timed, share)],
    ascending; a step goes to the band timed nearest to it on a log scale."""
    if len(bands) == 1:
        return bands[0][1]
    x = math.log(max(pos, 1.0))
    return min(bands, key=lambda b: abs(math.log(max(b[0], 1)) - x))[1]
