"""Weight formats (models/quant.py): every GGUF type socllm reads dequantizes exactly as gguf's
reference dequantizer does, and a model in each runs on the processors whose kernels read it,
with the oracle's greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize
from testlib import every_plan_gives_the_oracles_tokens_and_logits, prefill_then_decode
from tiny_gguf import blocks, random_blocks, write_tiny

from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.quant import FORMATS, codes, dequant_float, dequant_planar, float_matrix, planar, repack_q4_1

TYPES = list(FORMATS) + ["F16", "BF16"]


def _random_blocks(name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Any bytes at all, except f16 scales kept finite (of every magnitude, and zero)."""
    def scales(n):
        v = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)).astype(np.float16)
        v[::7] = 0
        return v
    return random_blocks(name, rows, cols, rng, scales)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantization_equals_gguf_on_random_blocks(name):
    rng = np.random.default_rng(7)
    for rows, cols in ((1, 256), (5, 512), (3, 1536)):
        raw = _random_blocks(name, rows, cols, rng)
        want = dequantize(raw, QT[name]).reshape(rows, cols)
        p = planar(name, raw, rows, cols)
        f = FORMATS[name]
        assert p["qs"].shape == (rows, cols // 2)
        assert ("qh" in p) == bool(f.hb) and (not f.hb or p["qh"].shape == (rows, cols // 32 * f.hb))
        got = dequant_planar(p)
        assert np.array_equal(got, want), f"{name}: max diff {np.abs(got - want).max()}"
        # any subset of rows dequantizes alone (embedding gathers, lm-head chunks)
        idx = np.array([rows - 1, 0])
        sub = {k: (v[idx] if isinstance(v, np.ndarray) else v) for k, v in p.items()}
        assert np.array_equal(dequant_planar(sub), want[idx])


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantization_equals_gguf_on_quantized_weights(name):
    """Blocks as a quantizer makes them (the K-quants: tiny_gguf's valid random blocks)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 512)).astype(np.float32) * 0.05
    raw = blocks(name, x, rng)
    p = planar(name, raw, 4, 512)
    assert np.array_equal(dequant_planar(p), dequantize(raw, QT[name]).reshape(4, 512))


def test_codes_keep_every_bit_and_q4_1_keeps_its_layout():
    rng = np.random.default_rng(1)
    raw = _random_blocks("Q6_K", 2, 256, rng)
    p = planar("Q6_K", raw, 2, 256)
    q = codes("Q6_K", p["qs"], p["qh"])
    assert q.max() == 63 and q.min() == 0                       # six bits, all of them
    assert FORMATS["Q5_0"].bits_per_weight() == 6.0 and FORMATS["Q8_0"].bits_per_weight() == 9.0
    raw = _random_blocks("Q4_1", 3, 64, rng)
    p, old = planar("Q4_1", raw, 3, 64), repack_q4_1(raw, 3, 64)
    assert all(np.array_equal(p[k], old[k]) for k in ("qs", "d", "m"))
    assert p["d"].dtype == np.float16 and FORMATS["Q4_1"].bits_per_weight() == 5.0


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_matrices_stay_as_they_are_in_the_file(name):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    raw = blocks(name, x, rng)
    w = float_matrix(name, raw, 3, 64)
    assert w["w"].itemsize == 2
    assert np.array_equal(dequant_float(name, w["w"]), dequantize(raw, QT[name]).reshape(3, 64))


# -- models in each format, through the engine ---------------------------------------------------
# A Q4_K_M-like mix: what llama.cpp's quantizer writes for SmolLM2 (576-wide rows fall back from
# the K-quants to Q5_0 / Q8_0) and for models whose rows are whole 256-weight blocks.
MIXED = {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q5_1", "blk.0.attn_v.weight": "Q6_K",
         "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q5_K",
         "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "F16",
         "blk.1.attn_q.weight": "BF16", "blk.1.attn_v.weight": "Q4_0", "output.weight": "Q6_K"}


def _engine_greedy(path, plans, n=8):
    """-> (processors started, those skipped, {plan: greedy tokens at f32}, the oracle's).

    These tiny random models repeat one to three tokens (an engine stuck on one would match
    their greedy text), so each plan's logits are also checked here: fed the prompt and the
    oracle's tokens, one decode step each, within LOGITS_TOL of the oracle's."""
    from socllm.actors.pool import Pool
    reader = open_gguf(path)
    cfg = load_config(reader)
    oracle = Oracle(cfg, load_weights(reader, cfg))
    eng = Pool(model=path, context=64, threads=2)
    try:
        ids = eng.encode_prompt("Hello, world! 123")
        want = oracle.greedy(ids, n)
        ref = oracle.logits_for(ids + want)
        got = {}
        for p in plans:
            got[p] = eng.generate_ids(ids, plan=p, precision="f32", max_tokens=n, ignore_eos=True)["tokens"]
            logits = eng.logits_after(ids + want, p, "f32")
            err = float(np.abs(logits - ref).max() / np.abs(ref).max())
            assert err <= LOGITS_TOL, f"{p}: logits {err:.2e} of their scale from the oracle's"
        return eng.available, eng.skipped, got, want
    finally:
        eng.close()


LOGITS_TOL = 2e-4                 # f32 sums in another order (tests/test_engine.py)


def test_a_model_with_float_and_block_matrices_gives_the_oracle_tokens_everywhere(tmp_path, ray_session):
    """F16 and BF16 matrices beside block formats: the GPU runs the float linears op by op (the
    fused decode takes block formats), the NPU reads them as graph inputs."""
    path = write_tiny(tmp_path / "mixed.gguf", dim=256, ffn=512, layers=2, matrix="Q4_K",
                      table="Q6_K", head_dim=32, types=MIXED)
    available, skipped, got, want = _engine_greedy(path, ["cpu", "gpu", "npu"])
    assert available == {"cpu", "gpu", "npu"} and not skipped
    assert got == {"cpu": want, "gpu": want, "npu": want}


def test_a_processor_that_cannot_read_a_models_weights_is_not_started(tmp_path, ray_session, monkeypatch):
    from socllm.policies import placement
    monkeypatch.setitem(placement.MATRIX_FORMATS, "npu", ("Q4_1",))
    path = write_tiny(tmp_path / "q5.gguf", matrix="Q5_0", dim=64, ffn=128, head_dim=32)
    available, skipped, got, want = _engine_greedy(path, ["gpu"])
    assert available == {"cpu", "gpu"} and skipped["npu"].startswith("the npu kernels do not read Q5_0")
    assert got == {"gpu": want}


def test_a_mixed_k_quant_model_runs_on_the_gpu_and_the_npu_with_the_oracle_tokens(tmp_path, ray_session):
    """Every block format in one model (Q4_K_M's mix and more), its tables in Q6_K: the GPU's
    fused decode joins only the linears that share a format; the NPU's graphs dequantize each."""
    blocks_only = {k: v for k, v in MIXED.items() if v not in ("F16", "BF16")}
    path = write_tiny(tmp_path / "kmix.gguf", dim=256, ffn=512, layers=2, matrix="Q4_K",
                      table="Q6_K", head_dim=32, types=blocks_only)
    available, skipped, got, want = _engine_greedy(path, ["gpu", "npu", "hetero"])
    assert available == {"cpu", "gpu", "npu"} and not skipped
    assert got == {"gpu": want, "npu": want, "hetero": want}


def test_a_q4_0_model_runs_on_every_processor(tmp_path, ray_session):
    path = write_tiny(tmp_path / "q40.gguf", matrix="Q4_0", layers=2, dim=64, ffn=128, head_dim=32)
    from socllm.actors.pool import Pool
    reader = open_gguf(path)
    cfg = load_config(reader)
    oracle = Oracle(cfg, load_weights(reader, cfg))
    eng = Pool(model=path, context=64, threads=2)
    try:
        assert eng.skipped == {}
        every_plan_gives_the_oracles_tokens_and_logits(eng, oracle, LOGITS_TOL)
    finally:
        eng.close()


# -- families beyond Llama's plain layout ---------------------------------------------------------
@pytest.mark.parametrize("arch,extra", [("qwen2", ()), ("llama", ("rope_freqs.weight",)), ("qwen3", ()),
                                        ("gemma3", ())],
                         ids=["qwen2-bias-neox", "llama3-rope-freqs", "qwen3-qk-norm", "gemma3"])
def test_other_families_give_the_oracle_tokens_on_every_processor(tmp_path, ray_session, arch, extra):
    """Gemma 3: 3 layers, two with a sliding window of 4 keys, which a 6-token prompt and 8 new
    tokens outgrow (prefill and decode both cross it), 4 query heads of 32 over a 64-wide model."""
    gemma = dict(layers=3, heads=4) if arch == "gemma3" else dict(layers=2)
    path = write_tiny(tmp_path / f"{arch}.gguf", arch=arch, extra=extra, dim=64, ffn=128,
                      head_dim=32, matrix="Q5_0", **gemma)
    available, skipped, got, want = _engine_greedy(path, ["cpu", "gpu", "npu"])
    assert available == {"cpu", "gpu", "npu"}
    assert got == {"cpu": want, "gpu": want, "npu": want}


@pytest.fixture(scope="module")
def runner_engines(tmp_path_factory, ray_session):
    """kind -> (engine, oracle): one engine per model, started when a test first asks for it and
    shared by both precisions' runners (each its own Runner, over a zeroed KV cache)."""
    from socllm.actors.pool import Pool
    blocks_only = {k: v for k, v in MIXED.items() if v not in ("F16", "BF16")}
    made = {}

    def get(kind):
        if kind not in made:
            d = tmp_path_factory.mktemp(kind)
            path = (write_tiny(d / "k.gguf", dim=256, ffn=512, layers=2, matrix="Q4_K", table="Q6_K",
                               head_dim=32, types=blocks_only) if kind == "kmix" else
                    write_tiny(d / "q.gguf", arch=kind, dim=64, ffn=128, head_dim=32,
                               layers=3 if kind == "gemma3" else 2, matrix="Q8_0"))
            reader = open_gguf(path)
            cfg = load_config(reader)
            made[kind] = (Pool(model=path, context=64, processors_=("cpu", "gpu"), max_seqs=4,
                               kv_mb=1, kv_dtype="f16", double_rows=8),
                          Oracle(cfg, load_weights(reader, cfg)))
        return made[kind]
    yield get
    for eng, _ in made.values():
        eng.close()


@pytest.mark.parametrize("kind", ["kmix", "qwen2", "gemma3"])
@pytest.mark.parametrize("precision,tol", [("f32", 5e-3), ("q8", 0.1)])   # f16 K/V: ~1e-3
def test_the_service_runner_batches_other_formats_and_families(runner_engines, kind, precision, tol):
    """The service's path: an f16 paged KV cache, prompts prefilled in chunks, then decoded as one
    batch (batched linears in integers at q8), teacher-forced; logits against the oracle."""
    from socllm.actors.runner import Runner
    eng, oracle = runner_engines(kind)
    lay = eng.layout
    for off in lay.kv.values():     # zeros, as a new engine's: no K/V of the other precision's run
        eng.arena.buf[off: off + lay.kv_rows * lay.kv_cols * lay.kv_bytes] = 0
    runner = Runner(eng, "gpu", precision)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 250, n)] for s, n in enumerate((9, 3, 14))]
    forced = [oracle.greedy(p, 10) for p in prompts]
    tables, got = prefill_then_decode(runner, prompts, forced, 7)
    # one sequence alone: the one-row decode (fused, pre-bound kernels), twice
    for i in range(7, 9):
        logits = runner.step([(forced[0][i], len(prompts[0]) + i, 0)], {0: tables[0]}, all_rows=True)
        got[0].append(logits[0].copy())
    for s, ids in enumerate(prompts):
        n = 10 if s == 0 else 8
        ref = oracle.logits_for(ids + forced[s])[len(ids) - 1: len(ids) - 1 + n]
        err = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got[s], ref))
        assert err <= tol, (kind, precision, s, err)
