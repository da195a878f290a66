"""The service's step runner over an f16 paged KV cache (its default), in process: sequences
prefilled in chunks and decoded together in one batch follow the oracle; a prefill chunk in the
second activation buffer, run a few layers at a time with other steps between, gives the same
logits as the whole chunk."""
from __future__ import annotations

import numpy as np
import pytest

from testlib import PROMPTS, prefill_then_decode


@pytest.fixture(scope="module")
def engine16(gguf_reader, ray_session):
    from socllm.actors.pool import Pool
    from socllm.actors.service import KV_DTYPE
    eng = Pool(reader=gguf_reader, context=256, processors_=("cpu", "gpu"), max_seqs=4,
               kv_mb=8, kv_dtype=KV_DTYPE["q8"], double_rows=8)
    yield eng
    eng.close()


# precision -> (top-1 agreements of 16 at least, largest logit error relative to the largest
# logit): f32 linears over f16 K/V measured 16 of 16 and errors <= 8e-4; q8 rounds every
# activation to int8 per 32-block as llama.cpp does: measured 15 of 16 and 0.065 (0.10-0.15
# before its block sums were taken from the rounded values, as llama.cpp's Q8_1 takes them);
# since its batches' LM head rounds its input too (cl/batch.cl lm_head_tile, as a one-row step's
# and llama.cpp's do) 13-16 of 16 and 0.037-0.07, every disagreement a near tie: the oracle's
# top two within 0.04-0.22 of each other. A disagreement where they are NEAR_TIE apart or more
# fails at any precision.
BOUNDS = {"f32": (16, 2e-3), "q8": (12, 0.1)}
NEAR_TIE = 0.5


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_a_batch_over_an_f16_cache_follows_the_oracle(engine16, oracle, oracle_greedy, precision):
    """Teacher-forced with the oracle's greedy tokens: each prompt prefilled in chunks of 5 rows
    (its K/V written through its block table, blocks not in order), then all prompts decoded as
    one batch, every row at its own position; top-1 and logits against the oracle's."""
    from socllm.actors.runner import Runner
    runner = Runner(engine16, "gpu", precision)
    assert runner.lay.kv_dtype == "f16"
    prompts = [oracle_greedy[p] for p in PROMPTS[:3]]
    _, got = prefill_then_decode(runner, [ids for ids, _ in prompts], [want for _, want in prompts], 15)
    agree, tol = BOUNDS[precision]
    for s, (ids, want) in enumerate(prompts):
        ref = oracle.logits_for(ids + want)[len(ids) - 1: len(ids) + 15]
        top = [int(g.argmax()) for g in got[s]]
        assert sum(int(a == b) for a, b in zip(top, ref.argmax(axis=1))) >= agree, (PROMPTS[s], top)
        two = np.sort(ref, axis=1)[:, -2:]
        apart = [float(t[1] - t[0]) for t, a, b in zip(two, top, ref.argmax(axis=1)) if a != b]
        assert all(m < NEAR_TIE for m in apart), (PROMPTS[s], apart)
        err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got[s], ref))
        assert err <= tol, (PROMPTS[s], err)


def test_programs_come_from_the_planner_or_the_disk_and_outlive_it(engine16, oracle, oracle_greedy):
    """The planner actor is stopped once the programs are compiled (the service does so after
    warming a GPU-only plan): a processor's programs are installed again from the engine's copy,
    without it. A program neither compiled by this engine nor on disk starts it again; one
    another engine of the same code, model and pool layout compiled is read from disk (the
    planner stays stopped), and a damaged file is compiled again. Every way gives the oracle's
    logits, under ids no other program of the engine has."""
    import os
    import shutil

    from socllm.actors.runner import Runner
    old = Runner(engine16, "gpu", "f32")
    engine16.release_planner()
    assert engine16._planner is None and not engine16.release_planner()
    old.reinstall()
    assert engine16._planner is None
    ids, want = oracle_greedy[PROMPTS[1]]
    ref = oracle.logits_for(ids + want)[len(ids) - 1: len(ids) + 4]
    keys = [("gpu", True, 0, 0), ("gpu", False, 0, 0)]   # (the CPU's took 20 s more, in numpy)
    seen = {v[0] for v in engine16._compiled.values()}

    def fresh_runner():
        for k in keys:
            engine16._compiled.pop(k, None)
        run = Runner(engine16, "gpu", "f32")
        new = {engine16._compiled[k][0] for k in keys}
        assert not new & seen, "a program id given twice"
        seen.update(new)
        _, got = prefill_then_decode(run, [ids], [want], 4)
        assert np.abs(np.stack(got[0]) - ref).max() <= 2e-3 * np.abs(ref).max()

    shutil.rmtree(engine16.store.folder, ignore_errors=True)
    fresh_runner()                                # compiled: the planner started again
    assert engine16._planner is not None
    assert all(os.path.exists(engine16.store.path(k)) for k in keys)
    engine16.release_planner()
    fresh_runner()                                # read from disk
    assert engine16._planner is None
    with open(engine16.store.path(keys[1]), "wb") as f:
        f.write(b"\x01 damaged")
    fresh_runner()                                # compiled again
    assert engine16._planner is not None


@pytest.mark.parametrize("plan", ["gpu", "cpu"])
def test_a_chunk_stopped_between_layers_resumes_without_recomputing(engine16, oracle_greedy, plan):
    """Agent.xpu §4.4: a proactive chunk in the second activation buffer runs its stages in three
    spans; between them another sequence prefills (buffer 0) and decodes. Its activations and
    row metadata survive in its own buffer, so its logits equal those of the whole chunk run
    at once (same kernels: equal to float rounding), and the other sequence's are unchanged."""
    from socllm.actors.runner import Runner
    runner = Runner(engine16, plan, "f32")
    stages = runner.stages
    (a, _), (b, b_next) = oracle_greedy[PROMPTS[0]], oracle_greedy[PROMPTS[1]]
    a, b = a[:8], b[:8]
    tab = {0: [3, 1], 1: [5, 0], 2: [2, 4]}        # slot -> blocks (2 each, out of order)
    rows = lambda ids, slot: [(t, i, slot) for i, t in enumerate(ids)]

    whole = runner.step(rows(a, 0), {0: tab[0]}, all_rows=False).copy()
    b_ref = runner.step(rows(b, 1), {1: tab[1]}, all_rows=False).copy()
    b_dec = runner.step([(b_next[0], len(b), 1)], {1: tab[1]}, all_rows=True).copy()

    cuts = [0, 3, stages - 4, stages]
    for k, span in enumerate(zip(cuts, cuts[1:])):
        got = runner.step(rows(a, 2), {2: tab[2]}, all_rows=False, buffer=1, span=span)
        if k == 0:       # the other sequence prefills anew, then decodes, in buffer 0
            assert np.allclose(runner.step(rows(b, 1), {1: tab[1]}, all_rows=False), b_ref,
                               rtol=0, atol=1e-5)
        elif k == 1:
            assert np.allclose(runner.step([(b_next[0], len(b), 1)], {1: tab[1]}, all_rows=True),
                               b_dec, rtol=0, atol=1e-5)
    scale = float(np.abs(whole).max())
    assert float(np.abs(got - whole).max()) <= 1e-5 * scale
    with pytest.raises(ValueError, match="stages"):
        runner.step(rows(a, 2), {2: tab[2]}, all_rows=False, span=(0, 3))    # buffer 0: whole


def test_npu_prefill_chunks_and_gpu_decode_share_the_paged_cache(engine_npu, oracle, tokenizer):
    """Agent.xpu §4.3: a prompt prefilled in the NPU's static 32-row chunk graphs (its K/V
    written to their blocks through a block table out of order; attention gathering its rows
    through it), the last chunk padded (no padding row reaches a KV row); then decoded on the GPU over the same f16
    blocks. Every logit follows the oracle's (f32 linears: as the GPU's own chunks do), and a
    chunk that does not start a block, or spans two sequences, is refused."""
    from socllm.actors.runner import Runner
    runner = Runner(engine_npu, "gpu", "f32", npu_chunk=32)
    ids = tokenizer.encode("It is a truth universally acknowledged, that a single man in possession "
                           "of a good fortune, must be in want of a wife. However little known the "
                           "feelings or views of such a man may be on his first entering a "
                           "neighbourhood, this truth is so well fixed in the minds of the "
                           "surrounding families, that he is considered as the rightful property")
    want = oracle.greedy(ids, 8)
    assert len(ids) > 64 and len(ids) % 32
    ref = oracle.logits_for(ids + want)[len(ids) - 1:]
    blocks = [int(b) for b in np.random.default_rng(1).permutation(runner.lay.kv_blocks)[:8]]
    lay, buf = runner.lay, runner.eng.arena.buf
    regions = [buf[off: off + lay.kv_rows * lay.kv_cols * lay.kv_bytes].reshape(lay.kv_rows, -1)
               for off in lay.kv.values()]
    for region in regions:
        region[:] = 0x55
    for lo in range(0, len(ids), 32):
        rows = [(t, lo + i, 1) for i, t in enumerate(ids[lo: lo + 32])]
        got = [runner.step(rows, {1: blocks}, all_rows=False, on="npu")[0].copy()]
    br = lay.block_rows       # the padding rows of the last chunk reached no KV row
    written = {blocks[p // br] * br + p % br for p in range(len(ids))}
    others = [r for r in range(lay.kv_rows) if r not in written]
    assert all((region[others] == 0x55).all() and (region[sorted(written)] != 0x55).any(axis=1).all()
               for region in regions)
    for i, t in enumerate(want[:-1]):
        got.append(runner.step([(t, len(ids) + i, 1)], {1: blocks}, all_rows=True)[0].copy())
    assert [int(g.argmax()) for g in got] == want
    err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))
    assert err <= 2e-3, err
    with pytest.raises(ValueError, match="block boundary"):
        runner.step([(ids[0], 3, 1)], {1: blocks}, all_rows=False, on="npu")
    with pytest.raises(ValueError, match="one sequence"):
        runner.step([(ids[0], 0, 0), (ids[1], 0, 1)], {0: blocks[:1], 1: blocks}, all_rows=False,
                    on="npu")


def test_the_npu_takes_only_chunks_of_npu_from_rows_or_more(engine_npu, oracle, tokenizer):
    """A hetero plan whose NPU chunk graph costs its bucket whatever the rows (the service's auto
    sets npu_from from the chunks it timed): a chunk of fewer rows runs on the GPU, one of more
    on the NPU, over the same sequence's blocks; the last row's logits are the oracle's."""
    from socllm.actors.runner import Runner
    runner = Runner(engine_npu, "hetero", "f32", npu_chunk=32)
    runner.npu_from = 20
    ids = tokenizer.encode("Call me Ishmael. Some years ago, never mind how long precisely, having "
                           "little or no money in my purse, and nothing particular to interest me "
                           "on shore, I thought I would sail about a little")
    assert 16 + 20 <= len(ids) <= 16 + 32, len(ids)
    blocks = list(range(4))
    before = dict(runner.ran)
    runner.step([(t, i, 0) for i, t in enumerate(ids[:16])], {0: blocks}, all_rows=False)
    assert dict(runner.ran)["gpu chunk"] == before.get("gpu chunk", 0) + 1
    got = runner.step([(t, 16 + i, 0) for i, t in enumerate(ids[16:])], {0: blocks}, all_rows=False)
    assert dict(runner.ran)["npu chunk 32"] == before.get("npu chunk 32", 0) + 1
    ref = oracle.logits_for(ids)[-1]
    assert float(np.abs(got[0] - ref).max() / np.abs(ref).max()) <= 2e-3



def _hetero(engine_npu, tokenizer, text: str, n: int, **attrs):
    """A hetero runner (the NPU's 32-row chunk graphs) with these attributes set, and the first
    n token ids of text."""
    from socllm.actors.runner import Runner
    runner = Runner(engine_npu, "hetero", "f32", npu_chunk=32)
    for k, v in attrs.items():
        setattr(runner, k, v)
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return runner, ids[:n]


def _chunk(runner, ids, lo: int, hi: int, **kw):
    """Prefill rows lo .. hi-1 of ids (sequence slot 0, blocks 0-3) in one step."""
    runner.step([(t, lo + i, 0) for i, t in enumerate(ids[lo:hi])], {0: list(range(4))},
                all_rows=False, **kw)


def test_a_prompts_first_static_chunk_is_timed_for_the_preemption_bound(engine_npu, tokenizer):
    """The agent policy lets a proactive prompt's first chunk run whole on the NPU's static graph
    only where such chunks took at most its bound (actors/engine.py _whole_within_bound). The
    runner learns that time from the chunks at position 0 that its static program ran; a chunk
    the GPU takes, or a later chunk, teaches nothing."""
    runner, ids = _hetero(engine_npu, tokenizer, "Call me Ishmael. Some years ago, never mind how "
                          "long precisely, having little or no money in my purse, and nothing "
                          "particular to interest me on shore, I thought I would sail about a little "
                          "and see the watery part of the world. It is a way I have of driving off "
                          "the spleen", 56, npu_from=20)
    assert runner.whole_chunk_s(24, 0) is None                  # nothing ran yet
    _chunk(runner, ids, 0, 16)
    assert runner.whole_chunk_s(16, 0) is None                  # the GPU's chunk
    _chunk(runner, ids, 0, 24)
    took = runner.whole_chunk_s(24, 0)
    assert took is not None and 0 < took < 60
    key = ("npu", False, 0, 32)
    assert len(runner.first_s[key]) == 1
    _chunk(runner, ids, 32, 56)
    assert dict(runner.ran)["npu chunk 32"] >= 2 and len(runner.first_s[key]) == 1
    assert runner.whole_chunk_s(8, 0) is None                   # fewer than npu_from: the GPU's


def test_chunks_past_a_prompts_start_go_where_the_service_timed_them_faster(engine_npu, tokenizer):
    """auto (actors/service.py _time_plan) times a chunk past a prompt's start apart when the
    first ran the NPU's whole-model graph; npu_later False: such chunks run on the GPU, the
    prompt's first on the NPU, and an explicit on="npu" still runs there."""
    runner, ids = _hetero(engine_npu, tokenizer, "It was the best of times, it was the worst of "
                          "times, it was the age of wisdom, it was the age of foolishness, it was the "
                          "epoch of belief, it was the epoch of incredulity, it was the season of "
                          "Light, it was the season of Darkness, it was the spring of hope, it was "
                          "the winter of despair", 64, npu_later=False)
    before = dict(runner.ran)
    _chunk(runner, ids, 0, 32)
    _chunk(runner, ids, 32, 64)
    after = dict(runner.ran)
    assert after["npu chunk 32"] == before.get("npu chunk 32", 0) + 1
    assert after["gpu chunk"] == before.get("gpu chunk", 0) + 1
    _chunk(runner, ids, 32, 64, on="npu")
    assert dict(runner.ran)["npu chunk 32"] == after["npu chunk 32"] + 1
