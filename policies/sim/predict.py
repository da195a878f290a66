"""The profiler's prediction mode (HeteroLLM §4.3): op times for shapes never run, fitted to the
real-execution profile (scripts/profile_ops.py).

  gpu  a roofline: t = c0 + flops / F + bytes / B per op kind, F and B fitted (the paper
       estimates the GPU "using a fixed TFLOPS rate": its times follow the work linearly)
  npu  a regression over shapes per op kind on the NPU's own features (§3.2): the matmul's
       FLOPs with its dimensions padded to the array's tile (stage performance) and the weight
       bytes it streams (order and shape sensitivity), t = c0 + c1 padded_flops + c2 bytes

Coefficients are least squares, kept non-negative. `held_out_error` reports the error on row
counts the fit did not see. Everything is per device: a profile is a file.
"""
from __future__ import annotations

import json
import os

import numpy as np

from .soc import work

PROFILE_PATH = os.path.join(os.path.expanduser("~"), ".cache", "socllm", "op-profile.json")
NPU_TILE = 32          # HeteroLLM §3.2: the stage performance's step (a 32 x 32 array)


# MoE ops (graph/build.py _moe) predicted as what they compute: an expert linear as a linear of
# every row's k slots (the same weight bytes a row: the k experts' M rows); the route as an
# element-wise op over the router's E logits
STAND_INS = {"moe_linear": lambda a, n: ("linear", {k: a[k] for k in ("K", "M", "w") if k in a}, n * a["k"]),
             "moe_route": lambda a, n: ("add", {"D": a["E"]}, n)}


def _pad(x: float, tile: int) -> float:
    return -(-x // tile) * tile


def features(proc: str, op: str, args: dict, n: int, pos0: int = 0) -> np.ndarray:
    flops, nbytes, mm = work(op, args, n, pos0)
    if proc == "npu" and mm is not None:
        rows, K, M = mm
        flops = 2.0 * _pad(rows, NPU_TILE) * _pad(K, NPU_TILE) * _pad(M, NPU_TILE)
    return np.array([1.0, flops, nbytes])


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (drop the columns that come out negative)."""
    keep = list(range(X.shape[1]))
    while True:
        c = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        c[keep] = sol
        bad = [k for k in keep if c[k] < 0]
        if not bad:
            return c
        keep = [k for k in keep if k not in bad]


class Predictor:
    """Fitted op times per processor and op kind; `seconds(proc, op, args, n, pos0)`."""

    def __init__(self, points: list, device: dict | None = None, sync_s: float = 0.0,
                 contention: float = 1.0):
        self.device, self.sync_s = device or {}, sync_s      # a hop between processors
        self.contention = contention       # two processors at once over the slower alone
        self.coef: dict = {}
        groups: dict = {}
        for p in points:
            groups.setdefault((p["proc"], p["op"]), []).append(p)
        for key, pts in groups.items():
            X = np.stack([features(key[0], key[1], p["args"], p["n"]) for p in pts])
            y = np.array([p["s"] for p in pts])
            w = 1.0 / y                        # relative error: small ops count as much as big
            self.coef[key] = _nnls(X * w[:, None], y * w)

    def seconds(self, proc: str, op: str, args: dict, n: int, pos0: int = 0) -> float:
        if op in STAND_INS:            # an op the profile does not time: as the ops it is made of
            op, args, n = STAND_INS[op](args, n)
        c = self.coef.get((proc, op))
        if c is None:
            raise KeyError(f"the profile has no {op} on the {proc}")
        return float(features(proc, op, args, n, pos0) @ c)


def load_predictor(path: str | None = None) -> Predictor:
    path = path or PROFILE_PATH
    if not os.path.exists(path):
        raise FileNotFoundError(f"no op profile at {path}: run `python -m socllm.scripts.profile_ops`")
    try:
        with open(path) as f:
            prof = json.load(f)
        prof["points"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an op profile ({type(e).__name__}: {e})") from None
    return Predictor(prof["points"], prof.get("device"), prof.get("sync_s", 0.0),
                     prof.get("contention", 1.0))


def held_out_error(points: list, test_rows: set) -> dict:
    """Fit on the points whose row count is not in test_rows, predict those: per processor, the
    mean and the largest relative error (|predicted - measured| / measured)."""
    fit = Predictor([p for p in points if p["n"] not in test_rows])
    errs: dict = {}
    for p in points:
        if p["n"] in test_rows:
            got = fit.seconds(p["proc"], p["op"], p["args"], p["n"])
            errs.setdefault(p["proc"], []).append(abs(got - p["s"]) / p["s"])
    return {proc: {"mean": float(np.mean(e)), "max": float(np.max(e)), "points": len(e)}
            for proc, e in errs.items()}
