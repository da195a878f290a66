"""The GPU kernels' discrete-device path, forced on PoCL (SOCLLM_CL_DISCRETE=1): the pool's bytes
are copied into a device buffer once, and a step moves only its token ids up and its logits down.
On an NVIDIA GPU the same path runs for real (scripts/nvidia_opencl.sh)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pyopencl")

from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.synthetic import write_tiny


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("SOCLLM_CL_DISCRETE", "1")


def test_a_discrete_buffer_is_a_copy_until_ranges_move(forced):
    from socllm.actors.kernels_cl import CLKernels, make_context, wrap_arena
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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_gpu_plan_on_a_discrete_device_gives_the_oracles_tokens(tmp_path, forced, arch):
    """Prefill and the fused decode with only ids and logits crossing (scripts/gpu_decode.py):
    everything else a step reads is on the device already."""
    from socllm.scripts.gpu_decode import generate, setup
    extra = dict(layers=3, heads=4) if arch == "gemma3" else dict(layers=2)
    path = write_tiny(tmp_path / "m.gguf", arch=arch, dim=64, ffn=128, head_dim=32, matrix="Q5_0",
                      **extra)
    arena, lay, cfg, tok, weights, gpu, units = setup(path, 64, "f32")
    try:
        assert gpu.kernels.copies
        prompt = tok.encode("Hello, discrete world")
        got, _, _ = generate(arena, lay, gpu, units, prompt, 10, "f32")
    finally:
        arena.unlink()
    reader = open_gguf(path)
    cfg = load_config(reader)
    assert got == Oracle(cfg, load_weights(reader, cfg)).greedy(prompt, 10)
