"""Paged decode batches on the NPU's static graphs (npu/segment.py per_row): N rows of different
sequences, each at its own position, in a graph of B >= N rows. Row i's K/V go to KV row
rows[i] alone, padding rows' nowhere in the cache; row i's attention reads sequence seq[i]'s
rows 0 .. pos[i] through its block table. First against the numpy specification (the segments
alone), then the whole model in the engine: prompts prefilled on the GPU, decoded as one batch on
the NPU, against the oracle."""
from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from socllm.actors.cpu.kernels import NumpyKernels
from socllm.actors.npu.segment import OVSegment

from ov_layout import CONFIG, D, H, HD, KVH, THETA, Layout, close, f32, rand_rows
from testlib import PROMPTS

BR, MB, SEQS = 16, 20, 4          # block rows, a table's blocks (320 rows: KV buckets 256, 320)
KV_ROWS = SEQS * MB * BR          # the region: every table its own blocks
KV_NP = {"f32": np.float32, "f16": np.float16}


def _batch_layer(L: Layout, kv_dtype: str):
    """One layer's paged K/V writes and attention as the npu plan splits them: the projections
    and ropes (K, V to their KV rows), then the attention alone, over the step's row metadata."""
    s = {k: L.put(np.zeros(8, np.int32)) for k in ("pos", "rows", "seq")}
    s["btab"] = L.put(np.zeros((SEQS, MB), np.int32))
    s.update(h=L.slot(8, D), q=L.slot(8, H * HD), k=L.slot(8, KVH * HD), qr=L.slot(8, H * HD),
             att=L.slot(8, H * HD), kc=L.slot(KV_ROWS, KVH * HD, KV_NP[kv_dtype]),
             vc=L.slot(KV_ROWS, KVH * HD, KV_NP[kv_dtype]))
    a = lambda name: ("a", s[name])
    kv = lambda name: ("kv", s[name])
    rope = dict(head_dim=HD, theta=THETA)
    writes = [
        ("linear", dict(x=a("h"), w=L.w4(KVH * HD, D), rows=a("rows"), out=kv("vc"), K=D, M=KVH * HD)),
        ("linear", dict(x=a("h"), w=L.w4(KVH * HD, D), out=a("k"), K=D, M=KVH * HD)),
        ("rope", dict(x=a("q"), pos=a("pos"), out=a("qr"), heads=H, **rope)),
        ("rope", dict(x=a("k"), pos=a("pos"), rows=a("rows"), out=kv("kc"), heads=KVH, **rope)),
    ]
    att = [("attention", dict(q=a("qr"), k=kv("kc"), v=kv("vc"), pos=a("pos"), seq=a("seq"),
                              btab=a("btab"), out=a("att"), heads=H, kv_heads=KVH, head_dim=HD,
                              block_rows=BR, max_blocks=MB))]
    return s, writes, att


def _i32(arena, off, n):
    return arena[off: off + 4 * n].view(np.int32)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_batch_segments_match_numpy_and_padding_writes_no_kv(kv_dtype):
    """Rows of sequences 2, 0, 3 at positions 300, 17, 45 (KV bucket 320), then 2 rows at 40, 3
    (bucket 256), in a graph of 4 rows: attention and K/V rows as numpy's, padding rows finite,
    and no KV row other than the step's own written (rows metadata past N holds stale rows)."""
    L = Layout()
    s, writes, att = _batch_layer(L, kv_dtype)
    arena, rng = L.arena(), np.random.default_rng(4)
    kv_np = KV_NP[kv_dtype]
    for c in ("kc", "vc"):
        region = arena[s[c]: s[c] + KV_ROWS * KVH * HD * kv_np().itemsize].view(kv_np)
        region[:] = rng.standard_normal(region.size).astype(kv_np)
    tables = rng.permutation(KV_ROWS // BR)[:SEQS * MB].reshape(SEQS, MB)     # out of order
    _i32(arena, s["btab"], SEQS * MB)[:] = tables.reshape(-1)
    pool = {"kv_dtype": kv_dtype, "kv_rows": KV_ROWS, "max_seqs": SEQS, "block_rows": BR}
    core, shared = ov.Core(), {}
    segs = [OVSegment(core, tasks, arena, 4, live, MB * BR, config=CONFIG, shared=shared,
                      pool=pool, per_row=True)
            for tasks, live in ((writes, {s["kc"], s["vc"], s["qr"]}), (att, {s["att"]}))]
    _i32(arena, s["rows"], 8)[:] = 7         # stale metadata past the step's rows
    for seq, pos in [([2, 0, 3], [300, 17, 45]), ([1, 3], [40, 3])]:
        N = len(seq)
        seq, pos = np.array(seq, np.int32), np.array(pos, np.int32)
        _i32(arena, s["seq"], N)[:], _i32(arena, s["pos"], N)[:] = seq, pos
        _i32(arena, s["rows"], N)[:] = tables[seq, pos // BR] * BR + pos % BR
        for name, cols in (("h", D), ("q", H * HD)):
            rand_rows(arena, s[name], 8, cols, rng)
        ref = arena.copy()
        for op, args in writes + att:
            NumpyKernels(ref, kv_dtype).run(op, args, N, 0)
        before = arena.copy()
        for seg in segs:
            seg.run(N, 0)
        close(f32(arena, s["att"], N, H * HD), f32(ref, s["att"], N, H * HD), rtol=1e-3)
        assert np.all(np.isfinite(f32(arena, s["att"], 4, H * HD)))
        step = _i32(arena, s["rows"], N)
        for c in ("kc", "vc"):
            got, want, old = (m[s[c]: s[c] + KV_ROWS * KVH * HD * kv_np().itemsize].view(kv_np)
                              .reshape(KV_ROWS, -1).astype(np.float32) for m in (arena, ref, before))
            close(got[step], want[step], rtol=1e-3)
            others = np.setdiff1d(np.arange(KV_ROWS), step)
            assert np.array_equal(got[others], old[others])
    assert sorted(segs[1].variants) == [256, 320]


# -- the whole model in the engine --------------------------------------------------------------
def decode_on_npu(runner, rows: list, tables: dict, bucket: int) -> np.ndarray:
    """A decode batch through the npu plan's runner, in a static graph of `bucket` rows."""
    runner._batch_bucket = lambda *_: bucket
    return runner.step(rows, tables, all_rows=True).copy()


def kv_regions(engine) -> list:
    """Copies of every layer's K and V regions, [kv_rows, bytes of a row] each."""
    lay, buf = engine.layout, engine.arena.buf
    size = lay.kv_rows * lay.kv_cols * lay.kv_bytes
    return [buf[off: off + size].reshape(lay.kv_rows, -1).copy() for off in lay.kv.values()]


def test_npu_decode_batch_follows_the_oracle(engine_npu, oracle, oracle_greedy):
    """Three prompts prefilled on the GPU in chunks of 5 rows (f16 K/V through block tables out
    of order), then decoded on the NPU's static batch graphs, teacher-forced with the oracle's
    greedy tokens: in 4 rows all three (a padding row) or the first two only (two padding rows,
    the third sequence waiting: its cache untouched), then the third alone in 1 row, the first
    two swapped in 2; a last step of all three on the GPU, over the K/V the NPU wrote. Every
    row's top-1 is the oracle's and its logits within 2e-3 of the oracle's; a padded step
    writes only its rows' KV rows."""
    from socllm.actors.runner import Runner
    from socllm.policies.buckets import const_weights
    # the one-row batch (the third sequence alone) runs with the weights compiled in, the others
    # read them as inputs (policies/buckets.py): both forms are held to the oracle here
    assert const_weights("batch", 1) and not const_weights("batch", 2)
    runner, npu = Runner(engine_npu, "gpu", "f32"), Runner(engine_npu, "npu", "f32", npu_chunk=32)
    lay = runner.lay
    prompts = [oracle_greedy[p] for p in PROMPTS[:3]]
    free = [int(b) for b in np.random.default_rng(0).permutation(lay.kv_blocks)]
    tables, got, at = {}, [[] for _ in prompts], [len(ids) for ids, _ in prompts]
    for s, (ids, want) in enumerate(prompts):
        tables[s] = [free.pop() for _ in range(-(-(len(ids) + len(want)) // lay.block_rows))]
        for lo in range(0, len(ids), 5):
            runner.step([(t, lo + i, s) for i, t in enumerate(ids[lo: lo + 5])], {s: tables[s]},
                        all_rows=False)
    plan = [((0, 1, 2), 4)] * 5 + [((0, 1), 4)] * 4 + [((0, 1, 2), 4)] * 3 + [((2,), 1)] * 2 + \
        [((1, 0), 2)] * 2
    for seqs, bucket in plan:
        rows = [(prompts[s][1][at[s] - len(prompts[s][0])], at[s], s) for s in seqs]
        before = kv_regions(engine_npu)
        logits = decode_on_npu(npu, rows, tables, bucket)
        if len(seqs) < bucket:  # in every layer's K and V, only the step's rows' KV rows changed
            step = set(runner.meta[0]["rows"][:len(seqs)].tolist())
            for old, new in zip(before, kv_regions(engine_npu)):
                assert set(np.flatnonzero((old != new).any(axis=1)).tolist()) <= step
        for k, s in enumerate(seqs):
            got[s].append(logits[k])
            at[s] += 1
    rows = [(want[at[s] - len(ids)], at[s], s) for s, (ids, want) in enumerate(prompts)]
    for s, row in enumerate(runner.step(rows, tables, all_rows=True)):   # the GPU reads them
        got[s].append(row.copy())
        at[s] += 1
    for s, (ids, want) in enumerate(prompts):
        ref = oracle.logits_for(ids + want)[len(ids): at[s]]
        top = [int(g.argmax()) for g in got[s]]
        assert top == list(ref.argmax(axis=1)), (PROMPTS[s], top)
        err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got[s], ref))
        assert err <= 2e-3, (PROMPTS[s], err)


def test_a_draft_tree_verified_in_the_npus_batch_graph_gives_the_gpus_logits(engine_npu,
                                                                            oracle_greedy):
    """Ghidorah's tree verification in the NPU's static graphs (npu/ops.py _tree_keys): a
    sequence's last token and a draft tree of 3 nodes (the first head's likeliest token, its
    second with a child), in a graph of 4 rows (a decode step's rows are at most max_seqs). Each
    tree row sees the prefix and its ancestors (its entry's mask); the off-chain nodes write
    their K/V past the chain. Every row's logits are those of the same step on the GPU's kernels
    (paged.cl tree_row), and the hidden state the draft heads read is written too."""
    from socllm.actors.runner import Runner
    from socllm.policies.drafting import Tree
    gpu, npu = Runner(engine_npu, "gpu", "f32"), Runner(engine_npu, "npu", "f32", npu_chunk=32)
    assert npu.trees and npu.hidden_rows() is not None
    ids, want = oracle_greedy[PROMPTS[1]]
    tables = {0: [0, 1]}
    gpu.step([(t, i, 0) for i, t in enumerate(ids)], tables, all_rows=False)
    last = len(ids)                                    # the root row: want[0] at this position
    tree = Tree([want[1], want[3], want[2]], [-1, -1, 1], [0, 1, 0])
    pos, kv, ent = tree.entries(last)
    rows = [(want[0], last, 0)] + [(t, int(p), 0) for t, p in zip(tree.tokens, pos)]
    at = np.array([last, *kv.tolist()], np.int32)
    entries = np.concatenate([np.zeros((1, 4), np.int32), ent])
    assert tree.chain == 1 and entries[2:, 2].all() and kv[1] > last + 1   # off the chain
    want_logits = gpu.step(rows, tables, all_rows=True, tree=(at, entries)).copy()
    hidden_gpu = gpu.hidden_rows()[:4].copy()
    npu.hidden_rows()[:4] = 0                  # the NPU's step must write them again
    got = npu.step(rows, tables, all_rows=True, tree=(at, entries)).copy()
    assert npu.steps[("npu", True, 0, 4)] == 1 and got.shape == want_logits.shape == (4, got.shape[1])
    err = float(np.abs(got - want_logits).max() / np.abs(want_logits).max())
    assert err <= 2e-3 and list(got.argmax(1)) == list(want_logits.argmax(1)), err
    assert len(set(want_logits.argmax(1).tolist())) > 2          # the rows' logits differ
    assert np.abs(npu.hidden_rows()[:4] - hidden_gpu).max() <= 2e-3 * np.abs(hidden_gpu).max()
