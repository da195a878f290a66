"""Mixture-of-experts models in the one engine (issue 29, part 2): exact top-k routing on every
processor, against the numpy oracle's, in one-shot plans and in the service's paged steps; the
Mixtral-style llama layout, and users' qwen3moe and olmoe files (issue 29, part 1).

The tiny MoE (models/synthetic.py, experts=8, top 2, two layers) routes its tokens over dozens of
expert pairs (asserted), so an engine that ignored the router, or took the wrong expert's rows,
would be far from the oracle's logits."""
from __future__ import annotations

import numpy as np
import pytest
from testlib import every_plan_gives_the_oracles_tokens_and_logits, prefill_then_decode
from tiny_gguf import write_tiny

from socllm.models.gguf_file import ModelError, open_gguf
from socllm.models.llama import load_config, load_weights, read_config, tensor_problems
from socllm.models.oracle import Oracle, route

LOGITS_TOL = 2e-4        # f32 sums in another order (tests/test_formats.py)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("moe") / "moe.gguf", dim=64, ffn=64, head_dim=32,
                      matrix="Q4_1", layers=2, experts=8, top_k=2, vocab=300)
    reader = open_gguf(path)
    cfg = load_config(reader)
    return path, Oracle(cfg, load_weights(reader, cfg))


def test_routing_is_llamas_softmax_top_k_renormalized():
    z = np.array([[0.0, 2.0, 1.0, 2.0], [3.0, -1.0, 0.5, 0.0]], np.float32)
    sel, w = route(z, 2)
    assert sel.tolist() == [[1, 3], [0, 2]]                   # a tie goes to the lower id
    np.testing.assert_allclose(w[0], [0.5, 0.5], rtol=1e-6)
    p = np.exp(z[1] - 3.0) / np.exp(z[1] - 3.0).sum()
    np.testing.assert_allclose(w[1], p[[0, 2]] / p[[0, 2]].sum(), rtol=1e-6)
    _, raw = route(z, 2, norm=False)                          # OLMoE: no renormalization
    np.testing.assert_allclose(raw[1], p[[0, 2]], rtol=1e-6)


def test_an_moe_file_loads_with_its_experts_and_a_wrong_one_is_refused(moe, tmp_path):
    path, oracle = moe
    c = oracle.cfg
    assert (c.n_experts, c.n_experts_used, c.ffn_dim) == (8, 2, 64)
    sels = []
    oracle.tap = lambda i, name, v: sels.append(v) if name == "moe_sel" else None
    try:
        oracle.logits_for(list(range(20, 60)))
    finally:
        oracle.tap = None
    assert len({tuple(r) for s in sels for r in s}) >= 8       # routes vary token to token
    # a quantized router: llama.cpp keeps it in floats, and so does socllm's loader
    bad = write_tiny(tmp_path / "q8router.gguf", dim=64, ffn=64, head_dim=32, layers=1, experts=4,
                     top_k=2, types={"blk.0.ffn_gate_inp.weight": "Q8_0"})
    reader = open_gguf(bad)
    assert list(tensor_problems(reader, read_config(reader))) == [
        "tensor blk.0.ffn_gate_inp.weight has unsupported type Q8_0 (socllm runs F32/F16/BF16 here)"]
    with pytest.raises(ModelError, match="5 experts used of 4"):
        load_config(open_gguf(write_tiny(tmp_path / "k5.gguf", dim=64, ffn=64, head_dim=32,
                                         layers=1, experts=4, top_k=5)))


def test_every_processor_runs_moe_layers_with_the_oracles_routing(moe, ray_session):
    from socllm.actors.pool import Pool
    path, oracle = moe
    eng = Pool(model=path, context=64, threads=2, moe_graphs="grouped")
    try:
        every_plan_gives_the_oracles_tokens_and_logits(eng, oracle, LOGITS_TOL)
        npu = next(i for i in eng.info() if i["processor"] == "npu")["moe"]
        # the npu plan's prefill ran the MoE layers in grouped expert graphs (npu/experts.py),
        # with spilled overflow: exact; the decode steps in the one-graph form
        assert npu["grouped_layers"] >= 2 and npu["npu_rows"] > 0 and npu["pruned"] == 0
    finally:
        eng.close()


@pytest.mark.parametrize("arch,qk_norm,moe_norm", [("qwen3moe", "head", True), ("olmoe", "all", False)])
def test_qwen3moe_and_olmoe_files_run_on_every_processor(tmp_path, ray_session, arch, qk_norm, moe_norm):
    """The other MoE families llama.cpp runs (its own logits for them: tests/test_llamacpp.py):
    Qwen3-MoE's per-head Q/K norms and experts of expert_feed_forward_length, OLMoE's Q/K norms
    over the whole projections and routing weights left unrenormalized, on every processor."""
    from socllm.actors.pool import Pool
    path = write_tiny(tmp_path / f"{arch}.gguf", arch=arch, dim=64, ffn=64, head_dim=32,
                      matrix="Q4_1", layers=2, top_k=2, vocab=300)
    reader = open_gguf(path)
    cfg = load_config(reader)
    assert (cfg.n_experts, cfg.ffn_dim, cfg.qk_norm, cfg.moe_norm) == (8, 64, qk_norm, moe_norm)
    eng = Pool(model=path, context=64, threads=2)
    try:
        every_plan_gives_the_oracles_tokens_and_logits(eng, Oracle(cfg, load_weights(reader, cfg)),
                                                       LOGITS_TOL)
    finally:
        eng.close()


@pytest.mark.parametrize("graphs", ["per_expert", "dense"])
def test_the_npus_other_moe_graphs_give_the_oracles_logits(moe, ray_session, monkeypatch, graphs):
    """NPUMoE's baselines, kept for measuring against: a graph per expert at the chunk's full
    size, and one graph running every row through every expert."""
    from socllm.actors.pool import Pool
    monkeypatch.setenv("SOCLLM_MOE_GRAPHS", graphs)
    path, oracle = moe
    eng = Pool(model=path, context=64, threads=2, processors_=("cpu", "npu"))
    try:
        ids = eng.encode_prompt("Hello, world! 123")
        ref = oracle.logits_for(ids)
        logits = eng.logits_after(ids, "npu", "f32")
        assert float(np.abs(logits - ref).max() / np.abs(ref).max()) <= LOGITS_TOL
        npu = next(i for i in eng.info() if i["processor"] == "npu").get("moe", {})
        assert npu.get("grouped_layers", 0) == (2 if graphs == "per_expert" else 0)
    finally:
        eng.close()


# q8 rounds the attention's activations to 8 bits before the router reads them: a route near a
# tie may flip (measured 0.10 of the logits' scale on the gpu, 0.03 on the npu; dense: < 0.1)
TOL = {"f32": 2e-3, "q16": 2e-3, "q8": 0.2}


@pytest.mark.parametrize("proc", ["gpu", "npu", "cpu"])
def test_the_service_runner_batches_moe_rows_across_sequences(moe, ray_session, proc):
    """Prefill chunks over an f16 paged KV cache, then decode batches whose rows (three
    sequences) take different experts, then one sequence alone (the GPU's fused one-row decode):
    teacher-forced logits against the oracle at every precision."""
    from socllm.actors.pool import Pool
    from socllm.actors.runner import Runner
    path, oracle = moe
    eng = Pool(model=path, context=64, processors_=("cpu", "gpu", "npu"), max_seqs=4, kv_mb=1,
               kv_dtype="f16", double_rows=8, moe_graphs="grouped")
    rng = [np.random.default_rng(s) for s in range(3)]
    prompts = [[int(t) for t in r.integers(1, 250, n)] for r, n in zip(rng, (9, 3, 14))]
    forced = [oracle.greedy(p, 10) for p in prompts]
    try:
        for precision, tol in TOL.items():
            tables, got = prefill_then_decode(Runner(eng, proc, precision), prompts, forced, 7)
            runner = Runner(eng, proc, precision)
            for i in range(7, 9):
                logits = runner.step([(forced[0][i], len(prompts[0]) + i, 0)], {0: tables[0]},
                                     all_rows=True)
                got[0].append(logits[0].copy())
            for s, ids in enumerate(prompts):
                n = 10 if s == 0 else 8
                ref = oracle.logits_for(ids + forced[s])[len(ids) - 1: len(ids) - 1 + n]
                err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got[s], ref))
                assert err <= tol, (proc, precision, s, err)
    finally:
        eng.close()


def test_the_npus_pruned_expert_graphs_compute_the_policys_layer(moe, ray_session, tmp_path):
    """overflow "prune" (NPUMoE §4.1): a prefill chunk's pairs beyond a resident expert's
    capacity are dropped, the least salient first. The NPU's grouped graphs give the logits of
    the oracle whose MoE layers dispatch as policies/moe.py says (Oracle.moe_assemble, what
    scripts/moe_ppl.py measures perplexity with), and those differ from exact routing's."""
    import json
    from socllm.actors.pool import Pool
    from socllm.actors.runner import Runner
    from socllm.models.gguf_file import _sha256
    from socllm.policies import moe as policy
    from socllm.scripts.moe_ppl import pruning
    path, oracle = moe
    T, cfg = 32, oracle.cfg
    # every expert at capacity 16 (T * k / E = 8 pairs on average): the busiest overflow
    calib = {"chunk": T, "top_k": 2, "n_experts": 8, "dim": cfg.dim, "ffn_dim": cfg.ffn_dim,
             "gguf_sha256": _sha256(path),
             "layers": [{"layer": i, "mean": [8.0] * 8, "p95": [8.0] * 8, "rho": 1.0} for i in range(2)]}
    profile = {**policy.EXAMPLE_PROFILE, "npu": {"launch_ms": 0.01, "ms_per_row": 0.001}}
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / f"{calib['gguf_sha256']}-T{T}-test.json").write_text(json.dumps(calib))
    (tmp_path / "moe" / f"profile-d{cfg.dim}-f{cfg.ffn_dim}.json").write_text(json.dumps(profile))
    plan = policy.plan(calib, profile, "prune", 8)
    assert all(lp.layout()[1].all() for lp in plan.layers)            # every expert resident
    ids = [int(t) for t in np.random.default_rng(7).integers(1, 250, T)]
    eng = Pool(model=path, context=64, processors_=("cpu", "gpu", "npu"), max_seqs=2, kv_mb=1,
               moe_graphs="grouped", moe_overflow="prune", cache_dir=str(tmp_path))
    try:
        runner = Runner(eng, "npu", "f32", npu_chunk=T)
        got = runner.step([(t, i, 0) for i, t in enumerate(ids)], {0: list(range(T // eng.layout.block_rows))},
                          all_rows=False)[0].copy()
        npu = next(i for i in eng.info() if i["processor"] == "npu")["moe"]
    finally:
        eng.close()
    tally = {"pairs": 0, "dropped": 0}
    oracle.moe_assemble = pruning(plan, "prune", tally)
    try:
        want = oracle.logits_for(ids)[-1]
    finally:
        oracle.moe_assemble = None
    exact = oracle.logits_for(ids)[-1]
    assert npu["pruned"] == tally["dropped"] > 0
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= LOGITS_TOL
    assert float(np.abs(exact - want).max() / np.abs(want).max()) > 100 * LOGITS_TOL
