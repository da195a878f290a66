"""KV-length buckets (Transformer-Lite §2.1): the NPU's attention reads the first kv_len rows of
the cache, kv_len padded to a multiple of KV_STEP, one compiled graph per bucket met; results stay
the oracle's across bucket boundaries."""
from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from socllm.actors.cpu.kernels import NumpyKernels
from socllm.actors.npu.segment import OVSegment
from socllm.policies.buckets import KV_STEP, kv_bucket, npu_prefill_act

from ov_layout import CAP, CONFIG, D, HD, KVH, Layout, close, decoder_layer, f32, rand_rows, slots


@pytest.mark.parametrize("rows,want", [(0, 0), (1, 256), (256, 256), (257, 512), (300, 512),
                                       (2048, 2048), (3000, 3072), (3072, 3072)])
def test_kv_bucket_pads_rows_up_to_a_multiple_of_the_step(rows, want):
    assert KV_STEP == 256
    assert kv_bucket(rows, cap=3072) == want


def test_kv_bucket_never_passes_the_capacity():
    assert kv_bucket(600, cap=640) == 640
    with pytest.raises(ValueError):
        kv_bucket(641, cap=640)


@pytest.mark.parametrize("precision,caps,want", [
    ("q16", {"FP32", "BF16", "INT8"}, "bf16"), ("q8", {"FP32", "BF16"}, "bf16"),
    ("q16", {"FP32", "INT8", "BIN"}, "f32"), ("q8", {"FP32"}, "f32"),
    ("q8", {"FP32", "INT8"}, "i8"), ("q8", {"FP32", "BF16", "INT8"}, "i8"),
    ("f32", {"FP32", "BF16", "INT8"}, "f32"), ("bf16", {"FP32"}, "f32")])
def test_the_npus_prefill_is_bf16_only_where_the_device_computes_it(precision, caps, want):
    """q16 / q8 prefill graphs hint bf16 only on a device whose capabilities include BF16; on
    one without (an AVX-512 CPU without avx512_bf16), f32, which it computes anyway and 4x faster.
    q8's take int8 activations (dynamic quantization) where the device computes INT8."""
    assert npu_prefill_act(precision, caps) == want


def _attention_alone(L: Layout, s: dict):
    """An attention in its own segment, as the npu plan splits it: K/V of the step already in the
    cache (written by the segment before), so it reads the cache up to pos0 + B."""
    s["kc"], s["vc"] = L.slot(CAP, KVH * HD), L.slot(CAP, KVH * HD)
    return [("attention", dict(q=("a", s["q"]), k=("kv", s["kc"]), v=("kv", s["vc"]),
                               out=("a", s["att"]), heads=9, kv_heads=KVH, head_dim=HD))]


@pytest.mark.parametrize("form", ["fused", "alone"])
def test_steps_crossing_a_kv_bucket_match_numpy_with_one_graph_per_bucket(form):
    """Steps at pos0 = 0, 230, 250 (bucket 32) and a decode step at 290: the fused layer reads
    pos0 past rows (buckets 0, 256, 256, 512), the lone attention pos0 + B (256, 512, 512, 512)."""
    L = Layout()
    s = slots(L)
    tasks = decoder_layer(L, s) if form == "fused" else _attention_alone(L, s)
    arena, rng = L.arena(), np.random.default_rng(8)
    rand_rows(arena, s["x"], 512, D, rng)
    rand_rows(arena, s["q"], 512, 9 * HD, rng)
    for c in ("kc", "vc"):
        rand_rows(arena, s[c], CAP, KVH * HD, rng)
    shared = {}
    prefill = OVSegment(ov.Core(), tasks, arena, 32, {s["x"], s["att"]}, CAP, config=CONFIG,
                        shared=shared)
    decode = OVSegment(ov.Core(), tasks, arena, 1, {s["x"], s["att"]}, CAP, config=CONFIG,
                       shared=shared)
    out = s["x"] if form == "fused" else s["att"]
    cols = D if form == "fused" else 9 * HD
    for seg, N, pos0 in [(prefill, 20, 0), (prefill, 20, 230), (prefill, 20, 250), (decode, 1, 290)]:
        ref = arena.copy()
        for op, args in tasks:
            NumpyKernels(ref).run(op, args, N, pos0)
        seg.run(N, pos0)
        close(f32(arena, out, N, cols), f32(ref, out, N, cols))
        if form == "fused":
            close(f32(arena, s["kc"], CAP, KVH * HD)[pos0: pos0 + N], f32(ref, s["kc"], CAP, KVH * HD)[pos0: pos0 + N])
    # the pos0 = 0 bucket is compiled ahead (at install), the others on first use
    want = {"fused": ([0, 256], [0, 512]), "alone": ([256, 512], [256, 512])}[form]
    assert (sorted(prefill.variants), sorted(decode.variants)) == want
    assert len(shared) == 4


@pytest.mark.parametrize("n_prompt,plan", [(300, "npu"), (254, "npu"), (300, "hetero")])
def test_npu_tokens_equal_the_oracle_across_kv_buckets(engine, oracle, n_prompt, plan):
    """A prompt prefilled in one chunk (generate_ids: 300 tokens in the 512 bucket), and again in
    chunks of 32 rows on the NPU's 32-row graphs (the runner: pos0 0 .. 288, so the chunks from
    row 256 on read KV bucket 512); 254 tokens decode across row 256."""
    rng = np.random.default_rng(n_prompt)
    ids = [int(x) for x in rng.integers(100, 40000, n_prompt)]
    want = oracle.greedy(ids, 5)
    got = engine.generate_ids(ids, plan=plan, precision="f32", max_tokens=5)["tokens"]
    assert got == want[:len(got)] and (len(got) == len(want) or got[-1] in engine.stop_ids)
    run = engine.runner(plan, "f32", 32)
    before = run.ran["npu chunk 32"]
    got, _, _ = run.generate(ids, 5, lambda logits: int(np.argmax(logits)), engine.stop_ids, 32)
    assert got == want[:len(got)] and (len(got) == len(want) or got[-1] in engine.stop_ids)
    assert run.ran["npu chunk 32"] - before == -(-n_prompt // 32)     # every chunk on the NPU
