"""Decode operator fusion: the pass (graph/fuse.py) and its kernels (actors/gpu/cl/decode.cl).

The fused decode step must compute what the op-by-op step computes: f32 within 1e-5 (sums only
reassociated), q16 within 1e-3 of the logits' scale, q8 within 5e-2; KV rows written in place the same way.
"""
from __future__ import annotations

import os

os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", "2")  # before pyopencl starts PoCL

from collections import Counter

import numpy as np
import pytest

from socllm.graph.fuse import Fused, fuse_decode
from socllm.graph.program import StepProgram

from testlib import program as _program

LAYERS = 2


def test_a_decode_layer_is_five_launches(model_config):
    _, prog = _program(model_config, "gpu", "decode", LAYERS)
    units = fuse_decode(prog, "gpu")
    ops = Counter(u.op for u in units)
    # the norms, preps and attention merges run in the last work-group of the launch before
    per_layer = {"qkv_rope": 1, "attention_merge": 1, "linear_act_norm": 2, "gate_up_silu_prep": 1}
    assert ops == Counter({**{k: v * LAYERS for k, v in per_layer.items()},
                           "embed": 1, "norm_prep": 1, "rope_table": 1, "lm_head_act": 1})
    replaced = sorted(s for u in units for s in (u.seqs if isinstance(u, Fused) else (u.seq,)))
    assert replaced == sorted(t.seq for t in prog.tasks["gpu"])      # every task exactly once
    final = [u for u in units if u.op == "linear_act_norm"][-1]
    # lm_head_act reads it in order; the hidden state is stored too (draft heads read it)
    assert final.args["natural"] and final.args["store"]


def test_an_moe_decode_layer_fuses_its_experts_gate_up_and_down(model_config):
    """An MoE layer's one-row decode: the k experts' gate and up and the gated product are one
    launch (moe_gate_up), their down projections' weighted sum and the residual add another
    (moe_down); the router and the route stay ops of their own. The route takes no saliency in a
    decode step (only a prefill chunk's grouped experts read it), so the o projection and its
    residual add are one launch, with the layer's norm as its epilogue (stored: the router and
    the experts read it): 7 launches a layer, not 9."""
    import dataclasses
    cfg = dataclasses.replace(model_config, n_experts=8, n_experts_used=2, ffn_dim=64)
    _, prog = _program(cfg, "gpu", "decode", LAYERS)
    units = fuse_decode(prog, "gpu")
    ops = Counter(u.op for u in units)
    assert ops["moe_gate_up"] == LAYERS and ops["moe_down"] == LAYERS and ops["moe_route"] == LAYERS
    assert "silu_mul" not in ops and "moe_linear" not in ops and "add" not in ops and "rmsnorm" not in ops
    assert ops["linear_act_norm"] == LAYERS
    assert all(u.args["store"] and u.args["res"] is not None for u in units if u.op == "linear_act_norm")
    assert all("sal" not in u.args for u in units if u.op == "moe_route")
    assert all("sal" in t.args for t in prog.tasks["gpu"] if t.op == "moe_route")   # not changed
    replaced = sorted(s for u in units for s in (u.seqs if isinstance(u, Fused) else (u.seq,)))
    assert replaced == sorted(t.seq for t in prog.tasks["gpu"])      # every task exactly once


@pytest.mark.parametrize("plan,phase,cut", [("hetero", "prefill", None),
                                           ("tensor", "decode", {"ffn_up": 768}),
                                           ("tensor", "prefill", {"attn_output": 192})])
def test_fusion_never_crosses_a_wait_or_a_signal(model_config, plan, phase, cut):
    """Programs whose processors wait for and signal each other: only a unit's first task may
    wait and only its last may signal. The check must have something to check: a processor with
    waits and signals whose tasks do fuse (a fuser that never fused would pass vacuously)."""
    _, prog = _program(model_config, plan, phase, LAYERS, cut=cut)
    exercised = 0
    for proc, tasks in prog.tasks.items():
        by_seq = {t.seq: t for t in tasks}
        fused = [u for u in fuse_decode(prog, proc) if isinstance(u, Fused) and u.seqs]
        for u in fused:
            inner = [by_seq[s] for s in u.seqs]
            assert all(not t.waits for t in inner[1:]) and all(not t.signals for t in inner[:-1])
            assert u.signals == inner[-1].signals
        if any(len(u.seqs) > 1 for u in fused) and any(t.waits for t in tasks) \
                and any(t.signals for t in tasks):
            exercised += 1
    assert exercised, f"{plan} {phase}: no processor both synchronises and fuses: nothing checked"


def test_an_intermediate_read_elsewhere_is_not_dropped(model_config):
    """If another processor read layer 0's q projection, q + rope must not fuse into qkv_rope."""
    _, prog = _program(model_config, "gpu", "decode", LAYERS)
    tasks = prog.tasks["gpu"]
    q = next(t for t in tasks if t.op == "linear" and t.layer == 0)
    spy = type(q)("add", {"a": q.args["out"], "b": q.args["out"], "out": ("a", 1), "D": 1},
                  seq=q.seq + 1, layer=0)
    for t in tasks:                         # make room in the global order right after q
        t.seq += 1 if t.seq > q.seq else 0
    prog = StepProgram(prog.phase, prog.bucket, {"gpu": tasks, "cpu": [spy]}, prog.final)
    ops = Counter(u.op for u in fuse_decode(prog, "gpu"))
    assert ops["qkv_rope"] == LAYERS - 1 and ops["linear_act"] == 3          # layer 0's q, k, v


# -- the fused step against the op-by-op step, on the real model's first layers ---------------
def _pool(cfg, model_weights, program, **layout):
    """The model's first LAYERS layers in a pool (64 rows, context 128) and one of its programs."""
    from socllm.actors.gpu.backend import GPUBackend
    from socllm.policies.planner import PlannerCore
    from socllm.memory.arena import Arena
    from socllm.memory.layout import plan_layout, write_weights
    weights = {k: v for k, v in model_weights.items()
               if not k.startswith("blk.") or int(k.split(".")[1]) < LAYERS}
    planner = PlannerCore(cfg, LAYERS)
    slot_bytes = [planner.slots.nbytes(i, 64) for i in range(len(planner.slots.sizes))]
    lay = plan_layout(weights, LAYERS, cfg.n_kv_heads * cfg.head_dim, slot_bytes, 64, 128,
                      cfg.vocab, max(cfg.dim, cfg.ffn_dim), **layout)
    arena = Arena.create(lay.size, lay.readonly_bytes)
    try:
        write_weights(arena.buf, lay, weights)
        planner.set_layout(lay.to_dict())
        prog = StepProgram.from_bytes(program(planner)[1])
        yield arena, lay, prog, GPUBackend(arena.buf, lay, 2)
    finally:
        arena.unlink()


@pytest.fixture(scope="module")
def pool(model_config, model_weights):
    yield from _pool(model_config, model_weights, lambda p: p.program("gpu", "decode", 1))


@pytest.fixture(scope="module", params=["cpu-shaped", "gpu-shaped"])
def shaped(request):
    """-> a pool's GPU backend: the build for this machine (a CPU's work shapes), or the one with
    a GPU's (kernels_cl.GPU_SHAPED: a GEMV row pair over a group, epilogues over the last group,
    attention a group per head), both on PoCL"""
    from socllm.actors.gpu.backend import GPUBackend
    from socllm.actors.gpu.device import GPU_SHAPED
    made = {}

    def backend(pool):
        arena, lay, _, gpu = pool
        if request.param == "cpu-shaped":
            return gpu
        if made.get(id(pool), (None,))[0] is not pool:      # (an id may be reused once freed)
            made[id(pool)] = (pool, GPUBackend(arena.buf, lay, 2, build_options=GPU_SHAPED))
        return made[id(pool)][1]
    return backend


def _step(gpu, prog, precision, pos0, fuse):
    gpu.fuse = fuse
    gpu.begin_step(precision, pos0)
    units = gpu.build_units(prog, precision)
    if fuse:                     # else fused and op-by-op would be one path compared with itself
        assert len(units) < len(prog.tasks[gpu.name]), "nothing was fused"
    for u in units:
        u.run(1, pos0)
    gpu.finish()


@pytest.mark.parametrize("precision,rtol,pos0", [("f32", 1e-5, 37), ("f32", 1e-5, 150),
                                                ("q16", 1e-3, 37), ("q8", 2e-2, 37)])
def test_fused_decode_step_computes_the_op_by_op_step(pool, shaped, precision, rtol, pos0):
    """pos0 37: three of the eight attention splits are empty; 150: all hold keys."""
    arena, lay, prog, _ = pool
    gpu = shaped(pool)
    rng = np.random.default_rng(1)
    cols = lay.kv_cols
    buf = arena.buf
    kv = [buf[off: off + lay.kv_rows * cols * 4].view(np.float32).reshape(lay.kv_rows, cols)
          for off in lay.kv.values()]
    for c in kv:
        c[:pos0] = rng.standard_normal((pos0, cols)).astype(np.float32)
    logits = buf[lay.io["logits"]: lay.io["logits"] + lay.vocab * 4].view(np.float32)
    buf[lay.io["ids"]: lay.io["ids"] + 4].view(np.int32)[0] = 3575
    _step(gpu, prog, "f32", pos0, fuse=False)
    want, want_kv = logits.copy(), [c[:pos0 + 2].copy() for c in kv]
    _step(gpu, prog, precision, pos0, fuse=True)
    scale = np.abs(want).max()
    np.testing.assert_allclose(logits, want, rtol=0, atol=rtol * scale)
    for c, w in zip(kv, want_kv):
        np.testing.assert_array_equal(c[:pos0], w[:pos0])              # history untouched
        np.testing.assert_allclose(c[pos0], w[pos0], rtol=0, atol=rtol * np.abs(w[pos0]).max())
        np.testing.assert_array_equal(c[pos0 + 1], w[pos0 + 1])         # nothing past row pos0


@pytest.mark.parametrize("discrete", ["0", "1"], ids=["unified", "discrete"])
def test_bound_fused_units_follow_the_position_word_from_step_to_step(pool, shaped, monkeypatch, discrete):
    """Units built once run two steps (pos0 37, then 38): the fused kernels read pos0 from the
    position word begin_step writes (copied up on a discrete device), not from their pre-bound
    arguments; both steps' logits and KV rows equal the op-by-op steps'."""
    from socllm.actors.gpu.backend import GPUBackend
    from socllm.actors.gpu.device import GPU_SHAPED
    monkeypatch.setenv("SOCLLM_CL_DISCRETE", discrete)
    arena, lay, prog, _ = pool
    opts = GPU_SHAPED if shaped(pool) is not pool[3] else ""
    rng = np.random.default_rng(3)
    buf, cols = arena.buf, lay.kv_cols
    kv = [buf[off: off + lay.kv_rows * cols * 4].view(np.float32).reshape(lay.kv_rows, cols)
          for off in lay.kv.values()]
    history = [rng.standard_normal((37, cols)).astype(np.float32) for _ in kv]
    logits = buf[lay.io["logits"]: lay.io["logits"] + lay.vocab * 4].view(np.float32)
    ids = buf[lay.io["ids"]: lay.io["ids"] + 4].view(np.int32)
    got = {}
    for fuse in (False, True):
        gpu = GPUBackend(arena.buf, lay, 2, build_options=opts)
        gpu.fuse = fuse
        for c, h in zip(kv, history):
            c[:37], c[37:40] = h, 0.0
        units = gpu.build_units(prog, "f32")
        if gpu.copies:          # the history up once: each step then copies only its inputs
            gpu.kernels.to_device(gpu.host, 0, len(gpu.host))
        for pos0, tok in ((37, 3575), (38, 28)):
            ids[0] = tok
            gpu.begin_step("f32", pos0)
            for u in units:
                u.run(1, pos0)
            gpu.finish()
            if gpu.copies:
                gpu.kernels.to_host(gpu.host, 0, len(gpu.host))
            got[fuse, pos0] = logits.copy(), [c[pos0].copy() for c in kv]
    for pos0 in (37, 38):
        (want, want_kv), (have, have_kv) = got[False, pos0], got[True, pos0]
        np.testing.assert_allclose(have, want, rtol=0, atol=1e-5 * np.abs(want).max())
        for w, h in zip(want_kv, have_kv):
            np.testing.assert_allclose(h, w, rtol=0, atol=1e-5 * np.abs(w).max())


@pytest.fixture(scope="module", params=["f32", "f16"])
def paged_pool(model_config, model_weights, request):
    """The same with a paged KV cache (16 blocks of 16 rows, 2 sequences' tables) of f32 or f16
    elements: a decode batch."""
    yield from _pool(model_config, model_weights, lambda p: p.paged_program("gpu", True),
                     max_seqs=2, kv_blocks=16, kv_dtype=request.param)


def kv_caches(buf, lay) -> list:
    """Every layer's K and V cache as [kv_rows, kv_cols] arrays of the pool's KV type."""
    t = {"f32": np.float32, "f16": np.float16}[lay.kv_dtype]
    n = lay.kv_rows * lay.kv_cols
    return [buf[off: off + n * lay.kv_bytes].view(t).reshape(lay.kv_rows, -1) for off in lay.kv.values()]


@pytest.mark.parametrize("precision,rtol", [("f32", 1e-5), ("q16", 1e-3)])
def test_fused_paged_decode_row_computes_the_batched_step(paged_pool, shaped, precision, rtol):
    """A decode batch of one row runs the fused kernels over the block table (qkv_rope writes
    the row's K/V at its KV row, split-K attention reads keys through the table); the same row
    through the batched op-by-op launches gives the same logits and the same KV row (f16 KV:
    within its rounding, 2^-11)."""
    arena, lay, prog, _ = paged_pool
    gpu = shaped(paged_pool)
    rtol = max(rtol, 2e-3) if lay.kv_dtype == "f16" else rtol
    rng = np.random.default_rng(2)
    buf, cols, br, pos = arena.buf, lay.kv_cols, lay.block_rows, 37
    blocks = [9, 2, 14]                                   # not in order; pos 37 is in block 14
    io = lambda name, n, dt=np.int32: buf[lay.io[name]: lay.io[name] + n * 4].view(dt)
    kv = kv_caches(buf, lay)
    phys = np.array([blocks[l // br] * br + l % br for l in range(pos)])
    for c in kv:
        c[:] = np.nan                                     # rows of no sequence: never read
        c[phys] = rng.standard_normal((pos, cols))
    io("btab", 2 * lay.max_blocks).reshape(2, -1)[1, :3] = blocks
    io("seq", 1)[0], io("pos", 1)[0], io("ids", 1)[0] = 1, pos, 3575
    row = blocks[pos // br] * br + pos % br
    io("rows", 1)[0] = row
    logits = io("logits", lay.vocab, np.float32)
    _step(gpu, prog, "f32", pos, fuse=False)
    want, want_row = logits.copy(), [c[row].copy() for c in kv]
    for c in kv:
        c[row] = np.nan
    _step(gpu, prog, precision, pos, fuse=True)
    np.testing.assert_allclose(logits, want, rtol=0, atol=rtol * np.abs(want).max())
    for c, w in zip(kv, want_row):
        np.testing.assert_allclose(c[row].astype(np.float32), w.astype(np.float32), rtol=0,
                                   atol=rtol * np.abs(w.astype(np.float32)).max())
        assert np.isnan(c[row + 1]).all() and np.isfinite(c[phys]).all()


@pytest.mark.parametrize("precision,rtol", [("q16", 1e-3), ("q8", 2e-2)])
def test_integer_decode_batch_of_two_rows_computes_the_f32_batch(paged_pool, precision, rtol):
    """Two rows of two sequences at their own positions: the q16 batch (linears in integers,
    each input prepared once and reused by the linears that read it) and the q8 batch (int8
    weight tiles, cl/batch.cl) against the f32 batch."""
    arena, lay, prog, gpu = paged_pool
    rng = np.random.default_rng(3)
    buf, br = arena.buf, lay.block_rows
    io = lambda name, n, dt=np.int32: buf[lay.io[name]: lay.io[name] + n * 4].view(dt)
    tables, pos = [[3, 7], [11, 0, 5]], [20, 40]
    for c in kv_caches(buf, lay):
        c[:] = rng.standard_normal(c.shape)
    bt = io("btab", 2 * lay.max_blocks).reshape(2, -1)
    for s, t in enumerate(tables):
        bt[s, :len(t)] = t
    io("seq", 2)[:], io("pos", 2)[:], io("ids", 2)[:] = [0, 1], pos, [3575, 504]
    io("rows", 2)[:] = [tables[s][p // br] * br + p % br for s, p in enumerate(pos)]
    logits = io("logits", 2 * lay.vocab, np.float32).reshape(2, -1)
    gpu.fuse = True
    for prec in ("f32", precision):
        for u in gpu.build_units(prog, prec):
            u.run(2, 0)
        gpu.finish()
        if prec == "f32":
            want = logits.copy()
    np.testing.assert_allclose(logits, want, rtol=0, atol=rtol * np.abs(want).max())
    assert not np.allclose(want[0], want[1])                    # two different rows
