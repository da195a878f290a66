"""Ghidorah's hetero-core model parallelism in the one engine (`--plan hcmp`, graph/hcmp.py): a
decode batch's attention split into its dense part (the KV cache, on the GPU's kernels) and its
sparse part (the drafted rows' keys, on the CPU actor), merged by online softmax, with the
verifying steps of speculative decoding on it: the same tokens as plain decoding and as the
oracle at f32, drafted chains and trees, several sequences in a step."""
from __future__ import annotations

import pytest

from testlib import PROMPTS
from test_speculative import COPY, LIST, _spec


@pytest.fixture(scope="module")
def llm(ray_session):
    import socllm
    with socllm.LLM(precision="f32", context=512, max_seqs=8, kv_mb=24, plan="hcmp",
                    policy="fcfs", speculate="lookup", draft_max=6) as llm:
        yield llm


def _ran(llm, before: dict) -> dict:
    after = llm.status()["steps_by_program"]
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def test_the_plan_runs_decode_batches_on_the_gpu_and_the_cpu_and_prefill_on_the_gpu(llm):
    pl = llm.describe["placement"]
    assert llm.describe["plan"] == "hcmp" and pl["decode"] == "hcmp" and pl["prefill"] == "gpu"
    assert {p["processor"] for p in llm.status()["processors"]} == {"gpu", "cpu"}


def test_arca_chose_the_share_where_no_neighbour_ran_faster(llm):
    """No --hcmp-share: Ghidorah's ARCA at start (policies/arca.py). A verifying step of
    1 + draft_max rows at position 128 (a context of 512 has one band) timed on the GPU and the
    CPU alone, the climb started at their solo share, the share kept where both neighbours (of
    those that exist) were timed slower; cached per model, device and knobs."""
    from socllm.policies.arca import SHARE_UNITS, start_step
    arca = llm.describe["placement"]["hcmp"]
    assert arca["from"] in ("timed", "cached") and arca["rows"] == 7
    [(pos, share)] = arca["bands"]
    ms = arca["ms"][str(pos)]
    assert pos == 128 and ms["gpu"] > 0 and ms["cpu"] > 0
    assert ms["solo_share"] == pytest.approx(ms["gpu"] / (ms["gpu"] + ms["cpu"]), abs=2e-3)
    timed = {round(float(s) * SHARE_UNITS): t for s, t in ms["shares"].items()}
    assert start_step(ms["solo_share"], SHARE_UNITS) in timed
    k = round(share * SHARE_UNITS)
    near = [j for j in (k - 1, k + 1) if 0 <= j <= SHARE_UNITS]
    assert all(j in timed and timed[j] >= timed[k] for j in near), (share, timed)


def _cpu_steps(llm) -> int:
    return next(p["steps"] for p in llm.status()["processors"] if p["processor"] == "cpu")


def test_verifying_steps_split_across_processors_give_the_oracles_tokens(llm, oracle, tokenizer):
    ids = tokenizer.encode(COPY)
    want = oracle.greedy(ids, 24)
    before, cpu = llm.status()["steps_by_program"], _cpu_steps(llm)
    [out] = llm.generate(COPY, max_tokens=24)
    assert _spec(out)["accepted_prediction_tokens"] >= 10       # drafted rows decided tokens
    assert out.text == tokenizer.decode(want)
    ran = _ran(llm, before)
    assert ran.get("hcmp batch", 0) > 0 and ran.get("gpu chunk", 0) > 0, ran
    assert _cpu_steps(llm) - cpu == ran["hcmp batch"]          # the sparse parts: every batch


def test_several_sequences_drafting_in_one_split_step_keep_plain_decodings_tokens(llm):
    prompts = [COPY, LIST, *PROMPTS]
    plain = llm.generate(prompts, max_tokens=32, speculate="off")
    drafted = llm.generate(prompts, max_tokens=32)
    assert [o.text for o in drafted] == [o.text for o in plain]
    assert len({o.text for o in plain}) == len(prompts)
    assert sum(_spec(o)["accepted_prediction_tokens"] for o in drafted) >= 20


def test_draft_trees_off_their_chains_keep_plain_decodings_tokens(llm):
    """The heads' trees: an off-chain node's sparse part is its ancestors' keys (its tree entry),
    a chain row's its sequence's drafted keys; accepted paths off the chain are fed again."""
    convs = [[{"role": "user", "content": c}] for c in
             ("Write a short poem about the sea.", "Explain what a volcano is.")]
    plain = llm.chat(convs, max_tokens=40, speculate="off")
    tree = llm.status()["speculation"]["tree"]
    drafted = llm.chat(convs, max_tokens=40, speculate="heads")
    assert [o.text for o in drafted] == [o.text for o in plain]
    after = llm.status()["speculation"]["tree"]
    assert after["ranks"] == 2 and after["steps"] > tree["steps"]
    assert sum(_spec(o)["accepted_prediction_tokens"] for o in drafted) >= 5


def test_a_share_of_each_linears_columns_goes_to_the_cpu_and_keeps_the_logits(
        ray_session, gguf_reader, model_config, tokenizer):
    """Ghidorah §III-B1: every cuttable linear split by output columns (aligned to 64 rows of its
    weight), each processor writing its columns of the same output; at hcmp_share 0.25 the CPU
    actor computes a quarter of q, o, gate, up and down (k's 48 rows align to none). A verifying
    step of a chain and a lone row beside it: every row's logits the gpu plan's at f32."""
    import numpy as np

    from socllm.actors.pool import Pool
    from socllm.graph.hcmp import hcmp
    from socllm.policies.planner import PlannerCore
    core = PlannerCore(model_config)
    assert core.hcmp_rows(0.25) == {"attn_q": 128, "attn_output": 128, "ffn_gate": 384, "ffn_up": 384,
                              "ffn_down": 128}
    core.pool = type("P", (), {"block_rows": 32, "max_blocks": 8, "max_seqs": 4})()
    g = hcmp(core.paged_graph(True), rows_on_sparse=core.hcmp_rows(0.25))
    on_cpu = [op for op in g.ops if op.kind == "linear" and op.attrs["on"] == "cpu"]
    assert len(on_cpu) == 5 * model_config.n_layers and all(op.attrs["rows"][1] == op.attrs["M"]
                                                             for op in on_cpu)
    eng = Pool(reader=gguf_reader, context=128, processors_=("cpu", "gpu"), max_seqs=4, kv_mb=4,
               hcmp_share=0.25)
    try:
        ids = tokenizer.encode(COPY)[:40]
        gpu, split = eng.runner("gpu", "f32"), eng.runner("hcmp", "f32")
        tables = {0: [0, 1], 1: [2]}
        gpu.step([(t, i, 0) for i, t in enumerate(ids[:37])], {0: [0, 1]}, all_rows=False)
        gpu.step([(t, i, 1) for i, t in enumerate(ids[:5])], {1: [2]}, all_rows=False)
        rows = [(ids[37], 37, 0), (ids[38], 38, 0), (ids[39], 39, 0), (ids[5], 5, 1)]
        want = gpu.step(rows, tables, all_rows=True).copy()
        steps = next(d["steps"] for d in eng.info() if d["processor"] == "cpu")
        got = split.step(rows, tables, all_rows=True).copy()
        assert next(d["steps"] for d in eng.info() if d["processor"] == "cpu") == steps + 1
        # ARCA's bands (policies/arca.py band_of): a step takes the share of the band timed
        # nearest its rows' mean position (here 29.75: the band at 64, log scale), a program each
        split.hcmp_bands = [(8, 0.0), (64, 0.25)]
        again = split.step(rows, tables, all_rows=True).copy()
        early = [(ids[1], 1, 0), (ids[2], 2, 0), (ids[1], 1, 1)]       # mean 1.33: the band at 8
        want_early = gpu.step(early, tables, all_rows=True).copy()
        got_early = split.step(early, tables, all_rows=True).copy()
        assert split.steps[("hcmp", True, 0, 256)] == 2 and split.steps[("hcmp", True, 0, 0)] == 1
    finally:
        eng.close()
    for have, ref in ((got, want), (again, want), (got_early, want_early)):
        assert np.abs(have - ref).max() < 1e-4 * np.abs(ref).max()
    assert len(set(want.argmax(axis=1).tolist())) > 1
