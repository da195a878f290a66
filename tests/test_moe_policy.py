"""MoE on static-shape graphs (policies/moe.py, NPUMoE §4) and its offline calibration
(models/calibrate.py, §3.3 and §5.8): tiers, dispatch under each overflow policy against exact
routing, grouping, residency, the plan's JSON, and `socllm calibrate`'s bad input."""
from __future__ import annotations

import numpy as np
import pytest

from socllm.models import calibrate as cal
from socllm.models.synthetic import write_tiny
from socllm.policies import moe

T, K, E, DIM = 64, 2, 8, 16


def routing(seed, T=T, k=K, E=E, skew=1.5):
    """Random top-k routing (distinct experts a token, skewed like a real router), saliency,
    weights summing to 1 and the exact outputs y [T, k, dim] of every pair."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((T, E)) + skew * np.linspace(1, 0, E)   # low ids are hot
    sel = np.argsort(-z, axis=1, kind="stable")[:, :k]
    sal = rng.random(T).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    w /= w.sum(1, keepdims=True)
    y = rng.standard_normal((T, k, DIM)).astype(np.float32)
    return sel, sal, w, y


def exact(y, w, keep=None):
    """Exact routing's output, summed in rank order as the oracle does; keep [T, k] bool: the
    pairs that count (the rest contribute 0)."""
    y = y if keep is None else y * keep[..., None]
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, w.shape[1]):
        out = out + w[:, j, None] * y[:, j]
    return out


# -- capacity tiers (§4.1) --

def test_tiers_follow_p95_under_the_imbalance_cap():
    p95 = [70, 40, 20, 16, 9, 8, 3, 0]              # T*k/E = 16 pairs an expert when balanced
    tiers, cap = moe.capacity_tiers(p95, rho=4.5, T=64, k=2, row=8)
    assert tiers == [8, 16, 32, 64]                 # C_base/2 .. 4 C_base, all under ceil(4.5*16)
    assert cap.tolist() == [64, 64, 32, 16, 16, 8, 8, 8]   # smallest tier >= p95, else the largest
    tiers, cap = moe.capacity_tiers(p95, rho=2.5, T=64, k=2, row=8)
    assert tiers == [8, 16, 32, 40]                 # 4 C_base capped at ceil(2.5*16) = 40
    assert cap[:2].tolist() == [40, 40]


def test_tiers_round_up_to_the_row_multiple():
    tiers, cap = moe.capacity_tiers([30, 12, 5, 1], rho=2.1, T=30, k=2, row=16)   # C_base 15
    assert all(t % 16 == 0 for t in tiers) and tiers == [16, 32]
    assert cap.tolist() == [32, 16, 16, 16]


# -- dispatch and the overflow policies (§3.2, §4.2) --

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overflow", moe.OVERFLOW)
def test_every_policy_is_exact_when_caps_hold_the_true_counts(seed, overflow):
    sel, sal, w, y = routing(seed)
    cap = np.bincount(sel.ravel(), minlength=E) + seed % 2          # = or > the counts
    np.testing.assert_array_equal(moe.assemble(y, w, sel, sal, cap, overflow), exact(y, w))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overflow", ("spill", "pad"))
def test_spill_and_pad_are_exact_under_any_caps(seed, overflow):
    sel, sal, w, y = routing(seed)
    cap = np.full(E, 6)                             # the hot experts get ~30 pairs
    assert (np.bincount(sel.ravel(), minlength=E) > cap).any()
    np.testing.assert_array_equal(moe.assemble(y, w, sel, sal, cap, overflow), exact(y, w))


@pytest.mark.parametrize("seed", range(4))
def test_prune_drops_exactly_the_lowest_saliency_overflow(seed):
    sel, sal, w, y = routing(seed)
    cap = np.array([4, 8, 8, 16, 16, 16, 0, 32])
    d = moe.dispatch(sel, sal, cap, "prune")
    keep = np.ones(sel.shape, bool)
    for e in range(E):
        t, j = np.nonzero(sel == e)
        order = np.argsort(-sal[t], kind="stable")
        keep[t[order[cap[e]:]], j[order[cap[e]:]]] = False    # the least salient beyond cap
    assert sorted(zip(d.dropped_token, d.dropped_slot)) == sorted(zip(*np.nonzero(~keep)))
    assert len(d.fallback_token) == 0
    np.testing.assert_array_equal(moe.assemble(y, w, sel, sal, cap, "prune"), exact(y, w, keep))


def test_rows_fill_each_experts_slice_from_its_start():
    sel, sal, w, y = routing(7)
    cap = np.full(E, 10)
    base = np.arange(E)[::-1] * 10                  # slices in reverse expert order
    d = moe.dispatch(sel, sal, cap, "prune", base=base)
    e = sel[d.token, d.slot]
    assert len(set(d.row.tolist())) == len(d.row) and d.rows == 80
    assert ((d.row >= base[e]) & (d.row < base[e] + cap[e])).all()
    for x in range(E):                              # packed at the front, most salient first
        rows = d.row[e == x] - base[x]
        assert sorted(rows.tolist()) == list(range(len(rows)))
        assert (np.diff(sal[d.token[e == x][np.argsort(rows)]]) <= 0).all()


def test_experts_left_off_the_buffer_run_on_the_fallback():
    sel, sal, w, y = routing(3)
    static = np.arange(E) < 4
    cap = np.bincount(sel.ravel(), minlength=E)
    d = moe.dispatch(sel, sal, cap, "prune", static=static)
    assert not static[sel[d.fallback_token, d.fallback_slot]].any() and len(d.dropped_token) == 0
    assert d.rows == cap[:4].sum()
    np.testing.assert_array_equal(moe.assemble(y, w, sel, sal, cap, "prune", static=static), exact(y, w))


def test_an_unknown_overflow_policy_is_refused():
    sel, sal, _, _ = routing(0)
    with pytest.raises(ValueError, match="overflow"):
        moe.dispatch(sel, sal, np.full(E, 8), "drop")


# -- grouping (§4.2) and residency (§4.3) --

def test_groups_hold_one_tier_hot_with_hot():
    cap = np.array([64, 64, 64, 64, 64, 32, 32, 16, 16, 16, 16, 16])
    mean = np.array([50, 60, 40, 55, 45, 20, 25, 3, 9, 1, 7, 5])
    groups = moe.group_experts(cap, mean, size=4)
    assert [(g.capacity, g.experts) for g in groups] == [
        (64, [1, 3, 0, 4]), (64, [2]), (32, [6, 5]), (16, [8, 10, 11, 7]), (16, [9])]
    assert sorted(e for g in groups for e in g.experts) == list(range(12))
    assert groups[0].expected_rows == 210
    assert max(len(g.experts) for g in moe.group_experts(cap, mean, 8, max_size=2)) == 2


PROFILE = {"npu": {"launch_ms": 1.0, "ms_per_row": 0.001}, "fallback": {"launch_ms": 0.01, "ms_per_row": 0.02},
           "npu_mb": 100.0, "graph_mb": 1000.0, "max_graphs": 10}


def test_residency_keeps_groups_that_amortise_their_launch():
    hot = moe.Group([0, 1, 2, 3], 64, expected_rows=200)     # NPU 1.26 ms, fallback 4.04 ms
    cold = moe.Group([4, 5, 6, 7], 16, expected_rows=20)     # NPU 1.06 ms, fallback 0.44 ms
    moe.place([[cold, hot]], PROFILE, expert_bytes=2**20)
    assert (hot.processor, cold.processor) == ("npu", "fallback")


def test_residency_balances_a_layer_between_the_npu_and_the_fallback():
    # each group 1.0 ms on the NPU, 0.9 on the fallback: running side by side, half of them move
    groups = [moe.Group([i], 100, expected_rows=90) for i in range(4)]
    flat = {"npu": {"launch_ms": 0, "ms_per_row": 0.01}, "fallback": {"launch_ms": 0, "ms_per_row": 0.01}}
    moe.place([groups], {**PROFILE, **flat}, expert_bytes=2**20)
    assert sorted(g.processor for g in groups) == ["fallback"] * 2 + ["npu"] * 2


def test_residency_stops_at_the_npus_memory_and_graph_budgets():
    groups = [moe.Group([4 * i + j for j in range(4)], 64, expected_rows=200 - i) for i in range(6)]
    layers = [[g] for g in groups]                  # a layer each: nothing to balance
    moe.place(layers, PROFILE, expert_bytes=10 * 2**20)     # 40 MB a group, 100 MB in all
    assert [g.processor for g in groups] == ["npu"] * 2 + ["fallback"] * 4
    moe.place(layers, {**PROFILE, "npu_mb": 1e6, "max_graphs": 3}, expert_bytes=10 * 2**20)
    assert [g.processor for g in groups] == ["npu"] * 3 + ["fallback"] * 3


def synthetic_calibration(chunks=8, seed=0, L=2):
    rng = np.random.default_rng(seed)
    p = np.linspace(3, 0.2, E) ** 2
    counts = np.stack([[np.bincount(np.array([rng.choice(E, K, replace=False, p=p / p.sum())
                                              for _ in range(T)]).ravel(), minlength=E)
                        for _ in range(L)] for _ in range(chunks)])             # [C, L, E]
    held = np.roll(counts, 1, axis=0)
    sal = rng.random((L, chunks * T)).astype(np.float32)
    return {"gguf_sha256": "0" * 64, "chunk": T, "top_k": K, "n_experts": E, "dim": 64,
            "ffn_dim": 64, **cal.summarize(counts, held, sal, K)}


def test_a_plan_round_trips_through_json_and_lays_out_its_groups():
    c = synthetic_calibration()
    p = moe.plan(c, PROFILE, group_size=4, row=8)
    assert moe.MoEPlan.from_json(p.to_json()) == p
    lp = p.layers[0]
    base, static, rows = lp.layout()
    npu = [g for g in lp.groups if g.processor == "npu"]
    assert rows == sum(len(g.experts) * g.capacity for g in npu)
    assert static.sum() == sum(len(g.experts) for g in npu)


def test_effects_count_padding_and_pruned_pairs():
    c = synthetic_calibration()
    p = moe.plan(c, PROFILE, group_size=4, row=8, residency=False)
    lp = p.layers[0]
    lp.cap = [16] * E                               # one layer, by hand: every expert 16 rows
    p.layers = [lp]
    counts = np.zeros((2, 1, E), int)
    counts[:, 0] = [40, 30, 20, 10, 10, 10, 8, 0]   # 128 pairs: 24+14+4 over, 6+6+6+8+16 padding
    e = moe.effects(p, counts)
    assert e["pruned"] == pytest.approx(42 / 128) and e["padding"] == pytest.approx(42 / 128)
    p.overflow = "pad"
    e = moe.effects(p, counts)
    assert e["pruned"] == 0 and e["padding"] == pytest.approx(42 / (128 + 42))


def test_uniform_capacity_pads_more_than_tiers():
    c = synthetic_calibration()
    tiers = moe.effects(moe.plan(c, PROFILE, row=8, residency=False), c["heldout_counts"])
    base = moe.effects(moe.plan(c, PROFILE, row=8, residency=False, tiers=False), c["heldout_counts"])
    assert base["padding"] > tiers["padding"]


# -- calibration (§3.3, §5.8) on a tiny synthetic MoE GGUF --

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return str(write_tiny(d / "moe.gguf", experts=8, top_k=2, layers=2, dim=64, ffn=64, vocab=300))


def test_calibration_counts_every_pair_of_every_chunk(tiny_moe, tmp_path):
    r = cal.calibrate(tiny_moe, tokens=256, chunk=32, cache_dir=str(tmp_path))
    counts = np.asarray(r["counts"])
    assert counts.shape == (8, 2, 8) and (counts.sum(-1) == 32 * 2).all()
    assert np.asarray(r["heldout_counts"]).shape == (8, 2, 8)
    assert r["heldout"]["first_token"] == r["calibration"]["tokens"] == 256
    for x in r["layers"]:
        assert sum(x["popularity"]) == pytest.approx(1, abs=1e-3)
        assert x["rho"] >= 1 and x["saliency"]["p5"] <= x["saliency"]["p50"] <= x["saliency"]["p95"]
    assert set(r["overlap_median"]) == {"4"}        # K = 8 = E would overlap trivially


def test_skip_leaves_out_the_texts_first_tokens(tiny_moe, tmp_path):
    r = cal.calibrate(tiny_moe, tokens=64, chunk=32, skip=100, cache_dir=str(tmp_path))
    assert (r["calibration"]["first_token"], r["heldout"]["first_token"]) == (100, 164)
    assert r["text"]["skip"] == 100 and "-S100-" in r["cache"]["path"]


def test_overlap_of_a_text_with_itself_is_one(tiny_moe):
    counts = np.asarray(cal.calibrate(tiny_moe, tokens=128, chunk=32)["counts"])
    s = cal.summarize(counts, counts, np.ones((2, 128), np.float32), 2)
    assert s["overlap_median"] == s["overlap_mean"] == {"4": 1.0}
    assert cal.overlap_at([5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5], 2) == 0
    assert cal.overlap_at([5, 4, 3, 2, 1, 0], [4, 5, 0, 3, 1, 2], 4) == 0.75


def test_the_cache_is_reused(tiny_moe, tmp_path, monkeypatch):
    first = cal.calibrate(tiny_moe, tokens=128, chunk=32, cache_dir=str(tmp_path))
    assert not first["cache"]["hit"]
    monkeypatch.setattr(cal, "Oracle", None)        # a second run must not route again
    second = cal.calibrate(tiny_moe, tokens=128, chunk=32, cache_dir=str(tmp_path))
    assert second["cache"]["hit"] and second["layers"] == first["layers"]
    assert second["gguf_sha256"] in second["cache"]["path"]


def _cli(capsys, *args):
    from socllm.actors.front.cli import main
    rc = main(["calibrate", *args])
    return rc, capsys.readouterr()


def test_cli_prints_a_table_and_a_plan(tiny_moe, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc, out = _cli(capsys, tiny_moe, "--tokens", "128", "--chunk", "32", "--plan", "--row", "8")
    assert rc == 0 and "median" in out.out and "padding" in out.out and out.err == ""


@pytest.mark.parametrize("what, needle", [("missing", "model file not found"),
                                          ("dense", "not a mixture-of-experts model"),
                                          ("chunk", "--chunk"), ("text", "calibration text")])
def test_cli_bad_input_is_one_line_and_exit_2(what, needle, tmp_path, tiny_moe, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = {"missing": str(tmp_path / "none.gguf"), "dense": write_tiny(tmp_path / "dense.gguf"),
            "chunk": tiny_moe, "text": tiny_moe}[what]
    extra = {"chunk": ["--chunk", "0"], "text": ["--text", str(tmp_path / "none.txt")]}.get(what, [])
    rc, out = _cli(capsys, path, *extra)
    lines = out.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("socllm: error:") and needle in lines[0]
