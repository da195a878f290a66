"""Speculative decoding on the simulated Jetson Xavier NX (policies/sim/speculative.py): Ghidorah's
Figure 9 (arXiv 2505.23219) from the device's published characteristics. Everything here is
simulated; pure and fast (no kernel runs)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from socllm.policies.sim.soc import load_soc
from socllm.policies.sim.speculative import (ACCEPTANCE, METHODS, RATIO_STEP, VICUNA_7B, _gemm_s,
                                             against_text, arca_ratio, published_figure,
                                             speculative_curve, step_alone, step_hcmp)

SOC = "jetson-xavier-nx"
CTX, WB = 256, 2.0


@pytest.fixture(scope="module")
def soc():
    return load_soc(SOC)


@pytest.fixture(scope="module")
def curves(soc):
    return {ds: speculative_curve(soc, acceptance=acc) for ds, acc in ACCEPTANCE.items()}


def test_the_methods_keep_the_papers_order_at_every_width_from_two(curves):
    """Figure 9: Sequential < Medusa < Medusa+EM < Ghidorah (MT-bench acceptance, every width)."""
    for r in curves["mt-bench"]["rows"]:
        if r["width"] >= 2:
            n = r["normalized"]
            assert [n[m] for m in METHODS] == sorted(n[m] for m in METHODS), r
            assert len({n[m] for m in METHODS}) == len(METHODS), r


def test_sequential_at_width_one_is_the_unit(curves):
    r1 = curves["mt-bench"]["rows"][0]
    assert r1["width"] == 1 and r1["normalized"]["sequential"] == 1.0
    # Medusa at width 1 is sequential decoding: the same step on the GPU alone
    assert r1["normalized"]["medusa"] == pytest.approx(1.0, rel=1e-12)


def test_ghidorah_peaks_at_width_16_and_medusa_at_64(curves):
    """§IV-C: Ghidorah's best width is 16 (the CPU's knee), Medusa's on the GPU alone 64; with
    Table I's MT-bench acceptance and with every other dataset's."""
    for ds, c in curves.items():
        assert c["best_width"] == 16, ds
        g = {r["width"]: r["normalized"]["ghidorah"] for r in c["rows"]}
        assert g[16] > g[8] and g[16] > g[32] > g[64], (ds, g)
        med = {r["width"]: r["normalized"]["medusa"] for r in c["rows"]}
        assert max(med, key=med.get) == 64, ds


def test_the_partition_ratio_lies_between_0_and_1_and_beats_either_processor_alone(soc, curves):
    for r in curves["mt-bench"]["rows"]:
        share, st = r["cpu_share"]["ghidorah"], r["step_s"]
        assert 0 < share < 1, r
        assert st["ghidorah"] < min(st["gpu"], st["cpu"]), r
        assert 0 < r["cpu_share"]["medusa+em"] < 1, r


@pytest.mark.parametrize("W", [4, 16, 64])
def test_arcas_step_by_step_adjustment_finds_the_best_ratio_on_the_grid(soc, W):
    """§III-C3: from the solo times' ratio, adjusted under contention; the adjustment ends at the
    fastest ratio of its grid (the step time is unimodal in the ratio)."""
    share, s = arca_ratio(soc, VICUNA_7B, W, CTX, WB)
    n = round(1 / RATIO_STEP)
    grid = min(step_hcmp(soc, VICUNA_7B, W, CTX, WB, k * RATIO_STEP) for k in range(n + 1))
    assert s == pytest.approx(grid, rel=1e-12)
    assert step_hcmp(soc, VICUNA_7B, W, CTX, WB, share) == s


def test_the_cpu_is_flat_to_16_rows_and_the_gpu_to_64(soc):
    """§IV-C: the GPU keeps a similar execution time from 4 to 64 rows, the ARM CPU only to 16."""
    def t(p, W):
        return step_alone(soc, p, VICUNA_7B, W, CTX, WB)
    assert t("gpu", 64) / t("gpu", 4) < 1.05
    assert t("cpu", 16) / t("cpu", 4) < 1.05
    assert t("cpu", 32) / t("cpu", 16) > 1.8


def test_the_gpus_compute_is_wave_quantized(soc):
    """Flat until the rows fill a tensor-core tile, then a step; columns by whole waves of SMs."""
    g = soc.processors["gpu"]
    tr, tc, sms = g.gemm_tile_rows, g.gemm_tile_cols, g.sms
    K = VICUNA_7B.dim
    assert len({_gemm_s(g, rows, K, 4096) for rows in range(1, tr + 1)}) == 1
    assert _gemm_s(g, tr + 1, K, 4096) > _gemm_s(g, tr, K, 4096)
    wave = sms * tc
    assert _gemm_s(g, 1, K, wave) == _gemm_s(g, 1, K, wave - tc + 1)
    assert _gemm_s(g, 1, K, wave + 1) == pytest.approx(2 * _gemm_s(g, 1, K, wave))


def test_within_a_fifth_of_figure_9(soc, curves):
    """The issue's target: every simulated bar within +-20 % of Figure 9 (as the paper text's
    image description reads its bars), for the four datasets, widths 4-64."""
    n = 0
    for ds, c in curves.items():
        fig = published_figure(soc, ds)
        for r in c["rows"]:
            for m in ("medusa", "medusa+em", "ghidorah"):
                if (m, r["width"]) in fig:
                    n += 1
                    assert r["normalized"][m] == pytest.approx(fig[(m, r["width"])], rel=0.2), (ds, m, r)
    assert n == 60


def test_the_numbers_the_paper_states(soc, curves):
    """MBPP (§I, §IV-C): 7.6x at width 16 = 3.27 x 2.31, and 1.20x over Medusa+EM on average (the
    profile is calibrated to these); 2.06x over Medusa on average (a result: within 5 %)."""
    rows = {(t["what"], t["method"]): t for t in against_text(soc, curves["mbpp"], "mbpp")}
    assert rows[("normalized decode speed", "ghidorah")]["ratio"] == pytest.approx(1, abs=0.02)
    assert rows[("parallel speedup", "ghidorah")]["ratio"] == pytest.approx(1, abs=0.02)
    assert rows[("mean speedup over medusa+em", "ghidorah")]["ratio"] == pytest.approx(1, abs=0.02)
    free = rows[("mean speedup over medusa", "ghidorah")]
    assert not free["calibrated"] and free["ratio"] == pytest.approx(1, abs=0.05)


def test_medusa_ems_gap_comes_from_asymmetric_contention(soc):
    """A ratio from solo times is only wrong under contention that hits the processors unequally:
    with no contention at all, Medusa+EM's Megatron split comes within 5 % of Ghidorah's (here a
    little ahead: 4 barriers a layer against HCMP's 5, and HCMP's attention phase, all of the
    dense part on the GPU, is not balanced at context 256)."""
    procs = {p: dataclasses.replace(q, contention_loss=0.0) for p, q in soc.processors.items()}
    even = dataclasses.replace(soc, processors=procs)
    for W in (4, 16):
        r = speculative_curve(even, widths=(W,))["rows"][0]["normalized"]
        assert r["ghidorah"] / r["medusa+em"] == pytest.approx(1.0, abs=0.05)


def test_it_refuses_a_soc_without_a_cpu_and_widths_without_acceptance(soc):
    with pytest.raises(ValueError, match="CPU and GPU"):
        speculative_curve(load_soc("snapdragon-8gen3"))
    with pytest.raises(ValueError, match="acceptance"):
        speculative_curve(soc, widths=(3,))


def test_socllm_simulate_spec_names_the_simulated_device():
    cli = [sys.executable, "-m", "socllm.actors.front.cli", "simulate"]
    r = subprocess.run(cli + ["--spec", "--widths", "4,16", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["simulated"] is True and out["soc"] == SOC
    assert out["title"] == "simulated Jetson Xavier NX (published figures)"
    c = out["datasets"]["mt-bench"]
    assert [row["width"] for row in c["rows"]] == [4, 16] and c["best_width"] == 16
    assert c["rows"][1]["paper_figure"] == {"medusa": 2.9, "medusa+em": 5.3, "ghidorah": 6.8}
    r = subprocess.run(cli + ["--spec"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "simulated Jetson Xavier NX (published figures)" in r.stdout
    # HeteroLLM's strategies need an NPU: one line, status 2
    r = subprocess.run(cli + ["--soc", SOC], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--spec" in r.stderr
