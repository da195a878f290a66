"""The GPU kernels' discrete-device path, forced on PoCL (SOCLLM_CL_DISCRETE=1): the pool's bytes
are copied into a device buffer once, and a step moves only its token ids up and its logits down.
On an NVIDIA GPU the same path runs for real (scripts/nvidia_opencl.sh)."""
from __future__ import annotations

import numpy as np
import pytest

from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.synthetic import write_tiny

from testlib import prefill_then_decode


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("SOCLLM_CL_DISCRETE", "1")


def test_a_discrete_buffer_is_a_copy_until_ranges_move(forced):
    from socllm.actors.gpu.device import make_context, wrap_arena
    from socllm.actors.gpu.kernels import CLKernels
    ctx, queue, _ = make_context()
    arena = np.zeros(1 << 16, np.uint8)
    arena[:256].view(np.float32)[:] = 1.0
    arena[256:512].view(np.float32)[:] = 2.0
    k = CLKernels(ctx, queue, wrap_arena(ctx, arena))          # a and b go up with the copy
    assert k.copies
    arena[256:512].view(np.float32)[:] = 5.0                   # after the copy: not seen ...
    k.run("add", {"a": ("a", 0), "b": ("a", 256), "out": ("a", 512), "D": 64}, 1, 0)
    k.finish()
    assert not arena[512:768].any()                            # ... and the sum stays below
    k.to_host(arena, 512, 768)
    assert (arena[512:768].view(np.float32) == 3.0).all()
    k.to_device(arena, 256, 512)                               # now b goes up
    k.run("add", {"a": ("a", 0), "b": ("a", 256), "out": ("a", 512), "D": 64}, 1, 0)
    k.finish()
    k.to_host(arena, 512, 768)
    assert (arena[512:768].view(np.float32) == 6.0).all()


@pytest.mark.parametrize("fuse", ["1", "0"], ids=["fused", "op-by-op"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_gpu_plan_on_a_discrete_device_gives_the_oracles_tokens(tmp_path, forced, monkeypatch,
                                                                    arch, fuse):
    """Prefill and the decode (fused, reading pos0 from the position word copied up each step, or
    op by op, each launch pre-bound) with only ids, that word and logits crossing
    (scripts/gpu_decode.py): everything else a step reads is on the device already. Gemma's 4-key
    window is crossed by prefill and decode."""
    monkeypatch.setenv("SOCLLM_FUSE", fuse)
    from socllm.scripts.gpu_decode import generate, setup, step
    extra = dict(layers=3, heads=4) if arch == "gemma3" else dict(layers=2)
    path = write_tiny(tmp_path / "m.gguf", arch=arch, dim=64, ffn=128, head_dim=32, matrix="Q5_0",
                      **extra)
    reader = open_gguf(path)
    cfg = load_config(reader)
    oracle = Oracle(cfg, load_weights(reader, cfg))
    arena, lay, cfg, tok, weights, gpu, units = setup(path, 64, "f32")
    try:
        assert gpu.kernels.copies
        prompt = tok.encode("Hello, discrete world")
        want = oracle.greedy(prompt, 10)
        got, _, _ = generate(arena, lay, gpu, units, prompt, 10, "f32")
        # the tiny model's greedy text repeats a few tokens: the logits of each step, fed the
        # oracle's tokens, are compared too
        logits = [step(arena, lay, gpu, units["prefill"], prompt, 0, "f32").copy()]
        for i in range(9):
            logits.append(step(arena, lay, gpu, units["decode"], want[i:i + 1], len(prompt) + i, "f32").copy())
    finally:
        arena.unlink()
    assert got == want
    ref = oracle.logits_for(prompt + want)[len(prompt) - 1: len(prompt) + 9]
    np.testing.assert_allclose(np.array(logits), ref, rtol=0, atol=2e-4 * np.abs(ref).max())


def test_the_engine_on_a_discrete_gpu_serves_the_gpu_plan_alone(tmp_path, forced, ray_session):
    """The GPU actor on a discrete device: generate_ids (the gpu plan, and the default plan,
    which never moves a request's steps to the NPU: its actor is not started) and the service's
    paged steps (chunks over a block table, then a decode batch) copy only the control plane's
    writes up and the logits and the rows' hidden states down (draft heads read those: the
    last decode step's are the LM head's input of its logits)."""
    from socllm.actors.pool import Pool
    from socllm.actors.runner import Runner
    path = write_tiny(tmp_path / "m.gguf", dim=64, ffn=128, head_dim=32, matrix="Q5_0", layers=2)
    reader = open_gguf(path)
    cfg = load_config(reader)
    weights = load_weights(reader, cfg)
    oracle = Oracle(cfg, weights)
    prompts = [[5, 9, 33, 70, 100, 2, 3], [40, 41, 42]]
    eng = Pool(model=path, context=64, threads=2, max_seqs=2,
               kv_mb=1, kv_dtype="f32")
    try:
        assert eng.available == {"cpu", "gpu"} and "discrete" in eng.skipped["npu"]
        for plan in ("gpu", None):
            got = eng.generate_ids(prompts[0], plan=plan, precision="f32", max_tokens=8, ignore_eos=True)
            assert got["tokens"] == oracle.greedy(prompts[0], 8)
        with pytest.raises(ValueError, match="needs the npu"):
            eng.generate_ids(prompts[0], plan="tensor", precision="f32", max_tokens=2)
        forced_ids = [oracle.greedy(p, 4) for p in prompts]
        run = Runner(eng, "gpu", "f32")
        _, logits = prefill_then_decode(run, prompts, forced_ids, 3)
        hidden = run.hidden_rows()[:len(prompts)].copy()
    finally:
        eng.close()
    for s, ids in enumerate(prompts):
        ref = oracle.logits_for(ids + forced_ids[s])[len(ids) - 1: len(ids) + 3]
        np.testing.assert_allclose(np.array(logits[s]), ref, rtol=0, atol=1e-3 * np.abs(ref).max())
    from socllm.models.quant import dequant_q8_0
    table = weights["output.weight" if "output.weight" in weights else "token_embd.weight"]
    last = np.array([got[-1] for got in logits])
    np.testing.assert_allclose(hidden @ dequant_q8_0(table["qs"], table["d"]).T, last, rtol=0,
                               atol=1e-3 * np.abs(last).max())
