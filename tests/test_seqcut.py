"""Sequence-length cutting (HeteroLLM §4.1.1, graph/seqcut.py): a prefill step's rows split into
static NPU chunks and a GPU margin that run at the same time, exchanging only the K/V rows that
causal attention needs; on the real actors the prompt's greedy tokens are the oracle's."""
from __future__ import annotations

import os

import pytest

from socllm.graph.build import build_graph
from socllm.graph.seqcut import seq_cut
from socllm.policies.placement import seq_parts

TEXT = os.path.join(os.path.dirname(__file__), "..", "scripts", "data", "pride_and_prejudice_ch1-2.txt")


@pytest.mark.parametrize("rows,parts", [
    (300, [(0, 256, "npu"), (256, 300, "gpu")]),                        # the paper's seq-cut
    (600, [(0, 512, "npu"), (512, 544, "npu"), (544, 600, "gpu")]),    # its multi-sequence cut
    (256, [(0, 256, "npu")]), (40, [(0, 40, "gpu")])])
def test_seq_parts_are_static_npu_chunks_and_a_gpu_margin(rows, parts):
    assert seq_parts(rows) == parts


def test_the_cut_graph_runs_every_op_per_part_and_the_logits_in_the_last(model_config):
    g = build_graph(model_config, n_layers=2)
    cut = seq_cut(g, [(0, 256, "npu"), (256, 300, "gpu")])
    per_part = {p: [op for op in cut.ops if op.attrs["on"] == p] for p in ("npu", "gpu")}
    assert len(per_part["npu"]) == len(g.ops) - 2 and len(per_part["gpu"]) == len(g.ops)
    assert [op.kind for op in per_part["gpu"][-2:]] == ["rmsnorm", "lm_head"]
    assert all(op.attrs["seq_lo"] == 256 and op.attrs["seq_n"] == 44 for op in per_part["gpu"])
    npu_acts = {n for op in per_part["npu"] for n in op.outputs.values() if cut.tensors[n].kind == "act"}
    gpu_acts = {n for op in per_part["gpu"] for n in op.outputs.values() if cut.tensors[n].kind == "act"}
    assert not npu_acts & gpu_acts and all(n.endswith("@256") for n in gpu_acts)
    with pytest.raises(ValueError, match="cover"):
        seq_cut(g, [(0, 256, "npu"), (250, 300, "gpu")])


def test_the_lowered_cut_syncs_only_on_the_kv_cache(engine):
    """Parts exchange nothing but K/V: the GPU margin's K/V writes of a layer wait for the NPU's
    use of that layer's cache; no activation of one part waits for the other."""
    import ray
    from socllm.graph.program import StepProgram
    _, blob, procs = ray.get(engine.planner.program.remote("seqcut", "prefill", 300))
    prog = StepProgram.from_bytes(blob)
    assert set(procs) == {"npu", "gpu"}
    waiting = [t for t in prog.tasks["gpu"] if t.waits]
    assert waiting and all(t.args["out"][0] == "kv" for t in waiting)
    assert not any(t.waits for t in prog.tasks["npu"])
    assert len(waiting) == 2 * engine.n_layers



def test_hybrid_prefill_gives_the_oracles_greedy_tokens(engine, oracle, tokenizer):
    """300 rows padded to the NPU's 512 bucket, its linears row-cut with the GPU, f32."""
    ids = tokenizer.encode(open(TEXT).read())[:300]
    out = engine.generate_ids(ids, plan="hybrid", precision="f32", max_tokens=8)
    assert out["placement"] == {"prefill": "tensor", "decode": "gpu"}
    assert out["tokens"] == oracle.greedy(ids, 8)


@pytest.mark.parametrize("rows", [300, 600])
def test_seqcut_prefill_gives_the_oracles_greedy_tokens(engine, oracle, tokenizer, rows):
    """300 = 256 (NPU) + 44 (GPU) and 600 = 512 + 32 (NPU) + 56 (GPU), f32."""
    ids = tokenizer.encode(open(TEXT).read())[:rows]
    out = engine.generate_ids(ids, plan="seqcut", precision="f32", max_tokens=8)
    assert out["placement"] == {"prefill": "seqcut", "decode": "gpu"}
    assert out["tokens"] == oracle.greedy(ids, 8)
