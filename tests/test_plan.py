"""The solver's step plan (policies/sim/plan_report.py), the profiler's prediction mode
(policies/sim/predict.py) and `socllm plan`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from socllm.policies.sim.plan_report import plan_step
from socllm.policies.sim.predict import Predictor, features, held_out_error

PROFILE = os.path.join(os.path.dirname(__file__), "..", "scripts", "results", "op-profile-2core.json")
CLI = [sys.executable, "-m", "socllm.actors.front.cli", "plan"]


SHAPES = [{"K": 576, "M": 1536, "w": ["w4"]}, {"K": 1536, "M": 576, "w": ["w4"]},
          {"K": 576, "M": 192, "w": ["w4"]}]


def _points(coef: dict, rows=(32, 64, 96, 128, 256)):
    """Op times made from known coefficients (c0, per FLOP, per byte) per processor, for linears
    of three shapes (one shape alone cannot tell FLOPs from bytes: both grow with the rows)."""
    return [{"proc": p, "op": "linear", "n": n, "args": a, "s": float(features(p, "linear", a, n) @ c)}
            for p, c in coef.items() for a in SHAPES for n in rows]


def test_prediction_mode_recovers_a_roofline_and_predicts_held_out_rows():
    coef = {"gpu": np.array([20e-6, 1 / 0.5e12, 1 / 40e9]), "npu": np.array([5e-6, 1 / 2e12, 1 / 30e9])}
    pts = _points(coef)
    fit = Predictor(pts)
    for p in coef:
        for a, n in ((SHAPES[0], 48), (SHAPES[1], 200), (SHAPES[2], 512)):
            want = float(features(p, "linear", a, n) @ coef[p])
            assert fit.seconds(p, "linear", a, n) == pytest.approx(want, rel=1e-6)
    err = held_out_error(pts, {96})
    assert err["gpu"]["mean"] < 1e-6 and err["npu"]["points"] == 3


def test_the_npu_pays_for_its_arrays_tile():
    """HeteroLLM §3.2 stage performance: rows 1..32 cost the NPU the same FLOPs."""
    a = {"K": 576, "M": 576, "w": ["w4"]}
    assert features("npu", "linear", a, 1)[1] == features("npu", "linear", a, 32)[1]
    assert features("gpu", "linear", a, 1)[1] < features("gpu", "linear", a, 32)[1]


class _Task:
    def __init__(self, op, args, layer=0):
        self.op, self.args, self.layer = op, args, layer


def _tasks():
    lin = {"K": 576, "M": 1536, "w": ("w4", 0, 0, 0), "x": ("a", 0), "out": ("a", 0)}
    return [_Task("rmsnorm", {"D": 576}), _Task("linear", lin), _Task("add", {"D": 576})]


def _cost(npu_over_gpu: float):
    """Hand-made costs: time grows with the rows of the step and of the weight; the NPU takes
    `npu_over_gpu` times the GPU's for every op."""
    def cost(p, op, args, n, pos0):
        return 1e-6 * n * args.get("M", 100) / 100 * (npu_over_gpu if p == "npu" else 1.0)
    return cost


@pytest.mark.parametrize("ratio,kept", [(0.3, "npu alone"), (3.0, "gpu alone")])
def test_one_much_faster_processor_takes_every_op(ratio, kept):
    out = plan_step(_cost(ratio), _tasks(), "decode", 300, sync_s=50e-6, contention=1.5)
    assert out["strategy"] == kept
    assert out["predicted_total_s"] == pytest.approx(sum(e["predicted_s"] for e in out["ops"]))
    assert {e["strategy"] for e in out["ops"]} == {kept.split()[0]}


def test_a_row_cut_is_kept_only_where_it_beats_both_processors():
    """Equal processors, no sync, no contention: the linear is cut in half (each half takes half
    the time) and the step beats either processor alone; with contention 2 the cut gains
    nothing and the solver keeps one processor."""
    out = plan_step(_cost(1.0), _tasks(), "decode", 300, sync_s=0.0, contention=1.0)
    lin = out["ops"][1]
    assert lin["strategy"] == "row-cut" and [p["rows"] for p in lin["parts"]] == [[0, 768], [768, 1536]]
    assert lin["predicted_s"] == pytest.approx(lin["alternatives"]["gpu"] / 2)
    assert out["strategy"] == "per op" and out["predicted_total_s"] < out["alternatives_total_s"]["gpu alone"]
    slow = plan_step(_cost(1.0), _tasks(), "decode", 300, sync_s=0.0, contention=2.0)
    assert slow["strategy"].endswith(" alone") and all(e["strategy"] != "row-cut" for e in slow["ops"])


def test_socllm_plan_json_for_a_simulated_soc_and_this_machine():
    r = subprocess.run(CLI + ["--soc", "snapdragon-8gen3", "--prompt-len", "300", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["simulated"] and out["phase"] == "prefill" and out["prompt_len"] == 300
    assert out["predicted_total_s"] > 0 and len(out["ops"]) > 100
    for e in out["ops"]:
        assert {"op", "layer", "strategy", "parts", "predicted_s"} <= set(e)
        assert all("processor" in p for p in e["parts"])
    r = subprocess.run(CLI + ["--prompt-len", "256", "--profile", PROFILE, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not json.loads(r.stdout)["simulated"]
    r = subprocess.run(CLI + ["--prompt-len", "256", "--profile", "/nonexistent.json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "profile_ops" in r.stderr
    r = subprocess.run(CLI + ["--prompt-len", "5000"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "prompt-len" in r.stderr
