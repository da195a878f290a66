"""The tensor partition solver (policies/rowcut.py, HeteroLLM §4.3) and the row-cut pass
(graph/partition.py), on their own: no Ray, no kernels."""
from __future__ import annotations

import pytest

from socllm.graph.build import build_graph
from socllm.graph.partition import ALIGN, row_cut
from socllm.policies.rowcut import plan_rows, solve


def linear(per_row_s: float, rows=(64, 256, 1536)) -> dict:
    """A profile table of a processor whose time grows linearly with the rows."""
    return {str(r): r * per_row_s for r in rows}


def test_equal_processors_cut_in_half():
    c = solve(linear(1e-6), linear(1e-6), 1536, sync_s=1e-5)
    assert c.rows_other == 768 and c.pays
    assert c.seconds == pytest.approx(768e-6 + 1e-5)


def test_a_faster_dominant_processor_keeps_more_rows():
    c = solve(linear(1e-6), linear(3e-6), 1536, sync_s=0.0)
    assert c.rows_other % ALIGN == 0
    assert c.rows_other == 384                     # 1152 * 1 = 384 * 3: both finish together


def test_no_cut_when_synchronisation_costs_more_than_it_saves():
    c = solve(linear(1e-7), linear(1e-7), 576, sync_s=1e-3)
    assert c.rows_other == 0 and not c.pays
    assert c.seconds == c.single_s                 # never slower than the best single processor


def test_everything_moves_when_the_other_processor_is_much_faster():
    c = solve(linear(1e-5), linear(1e-7), 576, sync_s=1e-6)
    assert c.rows_other == 576


def test_the_tensor_plan_asks_for_a_proper_cut_even_when_it_does_not_pay():
    c = solve(linear(1e-7), linear(1e-7), 576, sync_s=1e-3, cut_only=True)
    assert 0 < c.rows_other < 576 and c.rows_other % ALIGN == 0 and not c.pays


def test_plan_rows_without_a_profile_halves_aligned():
    rows = plan_rows("decode", {"ffn_up": 1536, "attn_q": 576, "attn_k": 64, "attn_v": 192})
    # 288 rows round to an aligned 256; attn_k is too small to cut; V writes the KV cache
    assert rows == {"ffn_up": 768, "attn_q": 256}


def test_plan_rows_follows_a_profile():
    prof = {"decode": {"sync_s": 0.0, "dominant": {"ffn_up": linear(1e-6)},
                       "other": {"ffn_up": linear(3e-6)}}}
    assert plan_rows("decode", {"ffn_up": 1536}, prof) == {"ffn_up": 384}


def test_row_cut_rejects_what_it_cannot_cut(model_config):
    g = build_graph(model_config, 1)
    with pytest.raises(ValueError, match="attn_v"):
        row_cut(g, {"attn_v": 64}, "gpu", "npu")
    with pytest.raises(ValueError, match="multiple"):
        row_cut(g, {"ffn_up": 100}, "gpu", "npu")
    with pytest.raises(ValueError, match="1536"):
        row_cut(g, {"ffn_up": 2048}, "gpu", "npu")


def test_row_cut_leaves_the_model_graph_alone(model_config):
    g = build_graph(model_config, 1)
    kinds = [op.kind for op in g.ops]
    cut = row_cut(g, {"ffn_up": 512, "ffn_down": 576}, "gpu", "npu")
    assert [op.kind for op in g.ops] == kinds and all("on" not in op.attrs for op in g.ops)
    up = [op for op in cut.ops if op.inputs.get("w") == "blk.0.ffn_up.weight"]
    assert [(op.attrs["on"], op.attrs["rows"]) for op in up] == [("npu", (1024, 1536)), ("gpu", (0, 1024))]
    down = [op for op in cut.ops if op.inputs.get("w") == "blk.0.ffn_down.weight"]
    assert [(op.attrs["on"], "rows" in op.attrs) for op in down] == [("npu", False)]   # moved whole
    assert len(cut.ops) == len(g.ops) + 1
