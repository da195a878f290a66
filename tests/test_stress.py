"""Stress (marked slow; `pytest -m slow`): many requests on every plan, each greedy answer still
the oracle's; a generation to the end of the context; the service under many concurrent clients —
nothing lost, no segment left behind."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_many_requests_on_every_plan_give_the_oracle_tokens(engine, oracle):
    """Prompts of 1 .. 199 tokens, one after the other through generate_ids (concurrent requests
    are the service's: test_service_stress_short_loses_nothing)."""
    rng = np.random.default_rng(123)
    plans = ("gpu", "npu", "hetero", "tensor", "seqcut", "hybrid")
    for i in range(24):
        n = int(rng.integers(1, 200))
        ids = [int(x) for x in rng.integers(100, 40000, n)]
        plan = plans[i % len(plans)]
        out = engine.generate_ids(ids, plan=plan, precision="f32", max_tokens=4, ignore_eos=True)
        assert out["tokens"] == oracle.greedy(ids, 4), f"{plan} with {len(ids)} prompt tokens"


def test_long_generation_to_the_end_of_the_context(engine, tokenizer):
    ids = tokenizer.encode("Write a long story about a robot.")
    out = engine.generate_ids(ids, plan="gpu", max_tokens=10_000, ignore_eos=True)
    # stops at the context, no error: prompt and generated tokens fill it, as a served
    # request's do (policies/request.py Sequence.rows; the last token is never fed back)
    assert len(ids) + len(out["tokens"]) == engine.context
    segs = [f for f in os.listdir("/dev/shm") if f.startswith("socllm-")]
    assert segs == [engine.arena.name]


def test_service_stress_short_loses_nothing(tmp_path, ray_session):
    """scripts/stress.py for one minute: 32 clients (Python API and HTTP), mixed lengths, some
    cancelling mid-stream; nothing lost or failed, nothing left in the table, every block free."""
    import json
    import subprocess
    import sys
    out = tmp_path / "stress.json"
    r = subprocess.run([sys.executable, "-m", "socllm.scripts.stress", "--minutes", "1",
                        "--clients", "32", "--json", str(out)], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    c = rep["counts"]
    assert c["lost"] == 0 and c["failed"] == 0 and c["completed"] > 32 and c["cancelled"] > 0
    assert rep["left_in_table"] == {} and rep["kv_blocks_used_at_end"] == 0
