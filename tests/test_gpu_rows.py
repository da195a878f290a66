"""A decode step of several rows of ONE sequence (speculative decoding's verification: the last
token and the drafted ones, every row's logits) on the GPU at the default precision q16, against
the one-row path: the same sequence teacher-forced one decode step a token (the fused decode
kernels).

The rows' linears run in int16 weight tiles (cl/batch.cl linear_tile, ACT_BITS 16) and, on x86,
their LM head too (lm_head_tile; elsewhere in f32, cl/paged.cl lm_head_rows); the one-row path's
run fused, its LM head over the int16 row (lm_head_act). Both round the same activations to int16
per 32-block, so they differ by float rounding only: measured here (PoCL, AVX-512 VNNI) <= 2e-4 of
the largest logit for 2, 3, 5 and 8 rows (MAX_ERR: 5x that; test_precision holds q16 within 3e-3
of the oracle). The tiles' products against the previous int16 kernel (linear_rows_act) and the
int16 reference: test_kernels_cl.py."""
from __future__ import annotations

import numpy as np
import pytest

from testlib import PROMPTS

MAX_ERR = 1e-3          # largest |error| / largest |logit|


@pytest.fixture(scope="module")
def runner(gguf_reader, ray_session):
    from socllm.actors.pool import Pool
    from socllm.actors.runner import Runner
    from socllm.actors.service import KV_DTYPE
    eng = Pool(reader=gguf_reader, context=128, processors_=("gpu",), max_seqs=8, kv_mb=8,
               kv_dtype=KV_DTYPE["q16"])
    yield Runner(eng, "gpu", "q16")
    eng.close()


@pytest.mark.parametrize("prompt", PROMPTS[1:])
def test_rows_of_one_sequence_match_one_row_steps(runner, tokenizer, prompt):
    ids = tokenizer.encode(prompt + " and then the rest of the story, which goes on for a while")
    L = len(ids)
    assert L >= 9
    blocks = list(range(-(-L // runner.lay.block_rows)))
    ref = runner.logits_after(ids)                     # [L, V], one row a step
    # n ascending: a step of n rows rewrites KV rows L-n .. L-1 and reads the rows before them,
    # which the one-row steps wrote
    for n in (2, 3, 5, 8):
        rows = [(ids[p], p, 0) for p in range(L - n, L)]
        got = runner.step(rows, {0: blocks}, all_rows=True).copy()
        want = ref[L - n:]
        assert got.shape == want.shape
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{n} rows: largest error / largest logit {err:.2g}")
        assert err <= MAX_ERR, (n, err)
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * MAX_ERR * np.abs(want).max()   # not a near tie
        assert (got.argmax(axis=1) == want.argmax(axis=1))[clear].all(), n
