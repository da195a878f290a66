"""NPUMoE's ablation on the simulated SoCs (policies/sim/moe.py): Phi-3.5-MoE and Qwen3-30B-A3B by
their published shapes, experts as static NPU graphs under policies/moe.py's plans. Everything is
simulated; pure and fast (no kernel runs, no model read)."""
from __future__ import annotations

import numpy as np
import pytest

from socllm.policies.sim.moe import ABLATIONS, SHAPES, ablation, routed_counts, table
from socllm.policies.sim.soc import load_soc, soc_names


@pytest.fixture(scope="module")
def runs():
    return {(s, m): ablation(load_soc(s), SHAPES[m], prompt=1024, chunk=256)
            for s in soc_names() for m in SHAPES}


def test_every_npu_soc_is_simulated(runs):
    assert {s for s, _ in runs} == {"snapdragon-8gen3", "core-ultra"}


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("soc", ["snapdragon-8gen3", "core-ultra"])
def test_prefill_follows_npumoes_ablation_order(runs, soc, model):
    # NPUMoE §5.8, Figure 17: Ours-base slowest, then tiers, tiers+grouping, all fastest
    r = runs[soc, model]
    t = [r["variants"][v]["prefill_s"] for v in ABLATIONS]
    assert t == sorted(t, reverse=True) and len(set(t)) == 4, t
    assert r["simulated"] and r["all_vs_base"] > 1.5


def test_tiers_cut_padding_grouping_cuts_calls_residency_uses_the_fallback(runs):
    v = runs["snapdragon-8gen3", "qwen3-30b-a3b"]["variants"]
    assert v["tiers"]["padding"] < v["base"]["padding"]
    assert v["tiers+grouping"]["npu_calls_per_chunk"] * 4 < v["tiers"]["npu_calls_per_chunk"]
    assert v["tiers"]["fallback"] == v["tiers+grouping"]["fallback"] == 0 < v["all"]["fallback"]


def test_the_order_holds_with_socllms_fast_sync_too():
    r = ablation(load_soc("snapdragon-8gen3"), SHAPES["phi-3.5-moe"], fast_sync=True)
    t = [r["variants"][v]["prefill_s"] for v in ABLATIONS]
    assert t == sorted(t, reverse=True)


def test_the_assumed_router_routes_t_times_k_pairs_a_chunk():
    shape = SHAPES["phi-3.5-moe"]
    counts, pop = routed_counts(shape, 128, 3, seed=1)
    assert counts.shape == (3, 32, 16) and (counts.sum(-1) == 128 * 2).all()
    np.testing.assert_allclose(pop.sum(1), 1)


def test_the_table_says_simulated_and_a_soc_without_an_npu_is_refused(runs):
    assert table(runs["snapdragon-8gen3", "phi-3.5-moe"]).startswith("SIMULATED")
    with pytest.raises(ValueError, match="no NPU"):
        ablation(load_soc("jetson-xavier-nx"), SHAPES["phi-3.5-moe"])


def test_socllm_simulate_moe_prints_the_ablation_and_refuses_a_bad_chunk():
    """`socllm simulate --moe`: the ablation of a 1,024-token prompt, marked simulated; a chunk
    longer than the prompt is one clear line and exit 2."""
    import json
    import subprocess
    import sys
    cli = [sys.executable, "-m", "socllm.actors.front.cli", "simulate", "--moe"]
    r = subprocess.run(cli + ["--moe-model", "phi-3.5-moe", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    (out,) = json.loads(r.stdout)
    assert out["simulated"] and out["model"] == "phi-3.5-moe" and out["prompt"] == 1024
    t = [out["variants"][v]["prefill_s"] for v in ABLATIONS]
    assert t == sorted(t, reverse=True)
    r = subprocess.run(cli + ["--prompt-len", "128", "--chunk", "256"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "--chunk" in r.stderr and len(r.stderr.strip().splitlines()) == 1
