"""One thread budget per machine (DESIGN.md §6): OpenVINO, PoCL and numpy's BLAS are set from it.

The plans of today run one processor at a time within a step (layer-level placement: a hop hands
the whole step over), and idle actors block in the kernel, so each processor actor may use the
whole budget without oversubscribing the cores. A plan that runs two processors concurrently
(row-cut) must split the budget between them: `split`.
"""
from __future__ import annotations

import os


def machine_budget() -> int:
    """One thread per core this process may run on (SOCLLM_THREADS sets another budget:
    policies/config.py EngineConfig.budget)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def actor_env(threads: int) -> dict:
    """Environment of one actor's process for a budget of `threads`: the thread pools that the
    libraries size when they load (BLAS, PoCL). socllm's own knobs travel in the config object
    the actors receive (policies/config.py), not in the environment."""
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "MKL_NUM_THREADS": t,
            "POCL_MAX_PTHREAD_COUNT": t}


def split(budget: int, shares: dict) -> dict:
    """Split a budget between processors that run at the same time, at least one thread each."""
    total = sum(shares.values())
    out = {p: max(1, round(budget * s / total)) for p, s in shares.items()}
    return out
