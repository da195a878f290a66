"""OVSegment (the NPU actor's static-shape OpenVINO graphs) against the numpy specification,
op by op and as whole decoder layers, at f32: every written value within 1e-4 of the oracle."""
from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from socllm.actors.cpu.kernels import NumpyKernels
from socllm.actors.npu.segment import OVSegment, _block_runs
from socllm.graph.program import cut_rows

from ov_layout import (CAP, CONFIG, D, EPS, F, H, HD, KVH, V, Layout, close, decoder_layer,
                       f32, model, rand_rows, run_both, single_op, slots)


@pytest.mark.parametrize("op", ["embed", "rmsnorm", "linear", "rope", "attention", "silu_mul",
                                "add", "lm_head", "gelu_mul", "embed_scaled", "attention_window"])
@pytest.mark.parametrize("bucket,N,pos0", [(1, 1, 37), (32, 20, 37)])
def test_each_op_matches_numpy(op, bucket, N, pos0):
    """Attention here reads this step's K/V rows from the caches, as if another processor wrote them."""
    L = Layout()
    s = slots(L)
    s["kc"], s["vc"] = L.slot(CAP, KVH * HD), L.slot(CAP, KVH * HD)
    task = single_op(op, L, s)
    arena, rng = L.arena(), np.random.default_rng(1)
    arena[s["ids"]: s["ids"] + 512 * 4].view(np.int32)[:] = rng.integers(0, V, 512)
    for name, cols in [("x", D), ("h", D), ("q", H * HD), ("g", F), ("u", F)]:
        rand_rows(arena, s[name], 512, cols, rng)
    for c in ("kc", "vc"):
        rand_rows(arena, s[c], pos0 + N, KVH * HD, rng)
    out = task[1]["out"][1]
    got, ref, _ = run_both([task], arena, bucket, N, pos0, {out})
    rows = 1 if op == "lm_head" else N
    cols = {"embed": D, "rmsnorm": D, "linear": D, "rope": H * HD, "attention": H * HD,
            "silu_mul": F, "add": D, "lm_head": V, "gelu_mul": F, "embed_scaled": D,
            "attention_window": H * HD}[op]
    close(f32(got, out, rows, cols), f32(ref, out, rows, cols))


# -- whole layers --------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket,N,pos0", [(1, 1, 0), (1, 1, 37), (32, 20, 0), (32, 20, 37),
                                           (512, 300, 37), (512, 300, 0)])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "window-geglu"])
def test_decoder_layer_matches_numpy(bucket, N, pos0, gemma):
    """Slots h, q, g are written more than once in the segment; only live-out x goes back to the
    arena; K/V rows land in place at pos0 with the rows before pos0 untouched. Gemma 3's layer:
    a sliding window of 13 keys (in the step's own keys, the cache's and the causal blocks of a
    first 300-row chunk) and GeGLU."""
    L = Layout()
    s = slots(L)
    tasks = decoder_layer(L, s, **({"window": 13, "act": "gelu"} if gemma else {}))
    arena, rng = L.arena(), np.random.default_rng(2)
    rand_rows(arena, s["x"], 512, D, rng)
    for c in ("kc", "vc"):
        rand_rows(arena, s[c], pos0, KVH * HD, rng)      # earlier tokens
    before = arena.copy()
    got, ref, _ = run_both(tasks, arena, bucket, N, pos0, {s["x"]})
    close(f32(got, s["x"], N, D), f32(ref, s["x"], N, D))
    for c in ("kc", "vc"):
        cache, want, old = (f32(m, s[c], CAP, KVH * HD) for m in (got, ref, before))
        close(cache[pos0: pos0 + N], want[pos0: pos0 + N])
        assert np.array_equal(cache[:pos0], old[:pos0])
    for name in ("h", "q", "k", "att", "g", "u"):   # intermediates stay in the graph
        assert np.array_equal(got[s[name]: s[name] + 512 * 4], before[s[name]: s[name] + 512 * 4])


def test_prefill_then_decode_reuses_compiled_segments():
    """A 2-layer model: prefill 20 tokens in bucket 32, then 3 decode steps in bucket 1, each
    segment compiled once and run at the next pos0; logits and caches follow the oracle."""
    L = Layout()
    s = slots(L)
    tasks, caches = model(L, s, layers=2)
    arena, rng = L.arena(), np.random.default_rng(3)
    ref = arena.copy()
    core = ov.Core()
    prefill = OVSegment(core, tasks, arena, 32, {s["logits"]}, CAP, config=CONFIG)
    decode = OVSegment(core, tasks, arena, 1, {s["logits"]}, CAP, config=CONFIG)
    pos0 = 0
    for seg, N in [(prefill, 20), (decode, 1), (decode, 1), (decode, 1)]:
        ids = rng.integers(0, V, N).astype(np.int32)
        for m in (arena, ref):
            m[s["ids"]: s["ids"] + 4 * N].view(np.int32)[:] = ids
        for op, args in tasks:
            NumpyKernels(ref).run(op, args, N, pos0)
        seg.run(N, pos0)
        close(f32(arena, s["logits"], 1, V), f32(ref, s["logits"], 1, V))
        pos0 += N
    for kc, vc in caches:
        for c in (kc, vc):
            close(f32(arena, c, pos0, KVH * HD), f32(ref, c, pos0, KVH * HD))


# -- in-place writes and padding -----------------------------------------------------------------
@pytest.mark.parametrize("bucket,N", [(1, 1), (32, 20)])
def test_row_cut_half_writes_only_its_columns(bucket, N):
    """A row-cut half (graph/program.cut_rows) on the NPU: its [B, 512] result lands in columns
    1024..1536 of the [N, 1536] slot, rows 1536 floats apart; the other half's columns stay."""
    L = Layout()
    s = slots(L)
    whole = dict(x=("a", s["x"]), w=L.w4(F, D), out=("a", s["u"]), K=D, M=F)
    half = cut_rows(whole, 1024, F)
    arena = L.arena()
    rand_rows(arena, s["x"], 512, D, np.random.default_rng(6))
    f32(arena, s["u"], 512, F)[:] = 7.0                      # the GPU's columns, already written
    ref = arena.copy()
    NumpyKernels(ref).run("linear", whole, N, 0)
    got, _, _ = run_both([("linear", half)], arena, bucket, N, 0, {half["out"][1]})
    close(f32(got, s["u"], N, F)[:, 1024:], f32(ref, s["u"], N, F)[:, 1024:])
    assert (f32(got, s["u"], 512, F)[:, :1024] == 7.0).all()
    assert (f32(got, s["u"], 512, F)[bucket:] == 7.0).all()


def test_only_live_out_is_written_back():
    L = Layout()
    s = slots(L)
    tasks = [("add", dict(a=("a", s["x"]), b=("a", s["x"]), out=("a", s["h"]), D=D)),
             ("add", dict(a=("a", s["h"]), b=("a", s["x"]), out=("a", s["u"]), D=D))]
    arena = L.arena()
    rand_rows(arena, s["x"], 512, D, np.random.default_rng(4))
    got, ref, _ = run_both(tasks, arena, 32, 20, 0, {s["u"]})
    close(f32(got, s["u"], 20, D), f32(ref, s["u"], 20, D))
    assert not f32(got, s["h"], 512, D).any()


def test_reader_of_a_slot_sees_its_old_value_when_a_parallel_task_overwrites_it():
    """rmsnorm reads x while an independent add overwrites x: OpenVINO may order them either way,
    so the segment must not let the in-place result clobber the input first."""
    L = Layout()
    s = slots(L)
    tasks = [("rmsnorm", dict(x=("a", s["x"]), w=L.wf(D), out=("a", s["u"]), D=D, eps=EPS)),
             ("add", dict(a=("a", s["h"]), b=("a", s["h"]), out=("a", s["x"]), D=D))]
    arena, rng = L.arena(), np.random.default_rng(5)
    rand_rows(arena, s["x"], 512, D, rng)
    rand_rows(arena, s["h"], 512, D, rng)
    got, ref, _ = run_both(tasks, arena, 32, 20, 0, {s["x"], s["u"]})
    for name in ("x", "u"):
        close(f32(got, s[name], 20, D), f32(ref, s[name], 20, D))


def test_padding_rows_stay_finite_whatever_the_arena_holds():
    """Rows N..B of a slot may hold any bytes (another processor used it): NaN activations and
    out-of-range ids must not leak into the real rows, the KV cache or the padding outputs."""
    L = Layout()
    s = slots(L)
    table = L.w8(V, D)
    embed = ("embed", dict(ids=("a", s["ids"]), table=table, out=("a", s["h"]), V=V, D=D))
    tasks = decoder_layer(L, s)
    arena = L.arena()
    N, pos0 = 5, 37
    ids = arena[s["ids"]: s["ids"] + 4 * 512].view(np.int32)
    ids[:N], ids[N:] = np.arange(N), 2 ** 30
    f32(arena, s["x"], 512, D)[:] = np.nan
    rand_rows(arena, s["x"], N, D, np.random.default_rng(7))
    got, ref, _ = run_both([embed], arena, 32, N, pos0, {s["h"]})
    close(f32(got, s["h"], N, D), f32(ref, s["h"], N, D))
    assert np.isfinite(f32(got, s["h"], 32, D)).all()
    got, ref, _ = run_both(tasks, arena, 32, N, pos0, {s["x"]})
    close(f32(got, s["x"], N, D), f32(ref, s["x"], N, D))
    assert np.isfinite(f32(got, s["x"], 32, D)).all()
    assert np.isfinite(f32(got, s["kc"], CAP, KVH * HD)[pos0: pos0 + 32]).all()


def test_q4_1_block_with_zero_scale_is_its_minimum():
    L = Layout()
    s = slots(L)
    w = L.w4(D, F)
    task = ("linear", dict(x=("a", s["g"]), w=w, out=("a", s["h"]), K=F, M=D))
    arena = L.arena()
    d = arena[w[2]: w[2] + D * F // 32 * 2].view(np.float16).reshape(D, F // 32)
    d[::7, ::5] = 0                                                         # w = m in those blocks
    rand_rows(arena, s["g"], 512, F, np.random.default_rng(6))
    got, ref, _ = run_both([task], arena, 32, 20, 0, {s["h"]})
    close(f32(got, s["h"], 20, D), f32(ref, s["h"], 20, D), rtol=1e-3)


def test_cache_dir_hits_for_the_same_segment_whatever_its_weights(tmp_path):
    L = Layout()
    s = slots(L)
    tasks = decoder_layer(L, s)
    arena, core = L.arena(), ov.Core()
    compile_ = lambda: OVSegment(core, tasks, arena, 1, {s["x"]}, CAP, config=CONFIG,
                                 cache_dir=str(tmp_path)).compiled.get_property("LOADED_FROM_CACHE")
    assert [compile_(), compile_()] == [False, True]
    qs = tasks[1][1]["w"][1]
    arena[qs] ^= 0xFF                   # other weights, same graph: weights are inputs, not in it
    assert compile_() is True


def test_layers_with_the_same_structure_share_one_compiled_graph():
    L = Layout()
    s = slots(L)
    layer_a, layer_b = decoder_layer(L, s), decoder_layer(L, s)   # same slots, own weights and KV
    arena, core, shared = L.arena(), ov.Core(), {}
    rand_rows(arena, s["x"], 32, D, np.random.default_rng(3))
    a = OVSegment(core, layer_a, arena, 32, {s["x"]}, CAP, config=CONFIG, shared=shared)
    b = OVSegment(core, layer_b, arena, 32, {s["x"]}, CAP, config=CONFIG, shared=shared)
    assert len(shared) == 1 and b.shared and b.compiled is a.compiled
    got, ref, _ = run_both(layer_b, arena, 32, 20, 5, {s["x"]}, shared=shared)
    close(f32(got, s["x"], 20, D), f32(ref, s["x"], 20, D))


@pytest.mark.parametrize("N", [1, 20, 300])
def test_last_row_tail_serves_every_bucket_with_one_graph(N):
    """Final norm + lm-head compiled for one row, run on row N-1 of a step of any size."""
    L = Layout()
    s = slots(L)
    table = L.w8(V, D)
    tail = [("rmsnorm", dict(x=("a", s["x"]), w=L.wf(D), out=("a", s["h"]), D=D, eps=EPS)),
            ("lm_head", dict(x=("a", s["h"]), table=table, out=("a", s["logits"]), D=D, V=V))]
    arena = L.arena()
    rand_rows(arena, s["x"], 512, D, np.random.default_rng(N))
    ref = arena.copy()
    for op, args in tail:
        NumpyKernels(ref).run(op, args, N, 0)
    shared = {}
    seg = OVSegment(ov.Core(), tail, arena, 512, {s["logits"]}, CAP, config=CONFIG, shared=shared,
                    last_row=True)
    seg.run(N, 0)
    assert seg.bucket == 1 and len(shared) == 1
    close(f32(arena, s["logits"], 1, V), f32(ref, s["logits"], 1, V))


@pytest.mark.parametrize("bucket,N,pos0", [(1, 1, 9), (512, 300, 0), (256, 256, 0)])
def test_constant_weight_graph_matches_numpy(bucket, N, pos0):
    """The compressed-FullyConnected path (weights compiled in): a decode step, and a prompt's
    first chunk as the NPU runs it (npu.py, policies/buckets.whole_graph) — pos0 = 0, causal
    attention in blocks of npu/ops.py CAUSAL_BLOCK query rows (4 and 2 blocks here), padding rows
    past N included."""
    L = Layout()
    s = slots(L)
    tasks = decoder_layer(L, s)
    arena = L.arena()
    rand_rows(arena, s["x"], 512, D, np.random.default_rng(11))
    ref = arena.copy()
    for op, args in tasks:
        NumpyKernels(ref).run(op, args, N, pos0)
    seg = OVSegment(ov.Core(), tasks, arena, bucket, {s["x"]}, CAP, config=CONFIG, const_weights=True)
    seg.run(N, pos0)
    close(f32(arena, s["x"], N, D), f32(ref, s["x"], N, D))
    for c in ("kc", "vc"):
        close(f32(arena, s[c], CAP, KVH * HD)[pos0: pos0 + N], f32(ref, s[c], CAP, KVH * HD)[pos0: pos0 + N])
    # the plugin kept Q4_1 compressed (zp = -m/d non-integer f32): u4 FullyConnected, not f32
    fc = [n.get_rt_info()["runtimePrecision"].astype(str) for n in seg.compiled.get_runtime_model().get_ordered_ops()
          if n.get_rt_info()["layerType"].astype(str) == "FullyConnected"]
    assert fc == ["u4"] * 7


@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("const_weights", [False, True])
def test_block_format_weights_match_numpy(fmt, const_weights):
    """A linear, an embedding and an lm-head over weights of the other block formats, as graph
    inputs over the pool (prefill) and as Constants (decode)."""
    L = Layout()
    s = slots(L)
    Vs, Dk = 512, 256
    table, w = L.wq(fmt, Vs, Dk), L.wq(fmt, 96, Dk)
    s["e"], s["o"], s["l"] = L.slot(512, Dk), L.slot(512, 96), L.slot(1, Vs)
    tasks = [("embed", dict(ids=("a", s["ids"]), table=table, out=("a", s["e"]), V=Vs, D=Dk)),
             ("linear", dict(x=("a", s["e"]), w=w, out=("a", s["o"]), K=Dk, M=96)),
             ("lm_head", dict(x=("a", s["e"]), table=table, out=("a", s["l"]), D=Dk, V=Vs))]
    arena, rng = L.arena(), np.random.default_rng(4)
    arena[s["ids"]: s["ids"] + 512 * 4].view(np.int32)[:] = rng.integers(0, Vs, 512)
    ref = arena.copy()
    for op, args in tasks:
        NumpyKernels(ref).run(op, args, 20, 0)
    OVSegment(ov.Core(), tasks, arena, 32, {s["o"], s["l"]}, CAP, config=CONFIG,
              const_weights=const_weights).run(20, 0)
    close(f32(arena, s["o"], 20, 96), f32(ref, s["o"], 20, 96))
    close(f32(arena, s["l"], 1, Vs), f32(ref, s["l"], 1, Vs))


def test_a_chunks_kv_rows_go_in_runs_of_consecutive_blocks():
    """A paged NPU chunk's staged K/V rows are copied one run of consecutive blocks at a time;
    rows that do not start a block, stop inside one or leave the region are refused."""
    rows = np.r_[np.arange(32, 64), np.arange(96, 112), np.arange(16, 21)].astype(np.int32)
    assert _block_runs(rows, 16, 128) == [[0, 32, 32], [32, 96, 16], [48, 16, 5]]
    with pytest.raises(ValueError, match="start a block"):
        _block_runs(np.arange(3, 19, dtype=np.int32), 16, 128)
    with pytest.raises(ValueError, match="start a block"):
        _block_runs(np.r_[np.arange(16), np.arange(40, 56)].astype(np.int32), 16, 128)
    with pytest.raises(ValueError, match="outside the region"):
        _block_runs(np.arange(128, 144, dtype=np.int32), 16, 128)
