"""socllm against llama.cpp, a reference outside socllm, through fixtures that
scripts/llamacpp_fixtures.py wrote with llama-cpp-python: logits and greedy tokens of the
synthetic models of every family and weight format, and token ids of SmolLM2's vocabulary under
every pre-tokenizer socllm reads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models import oracle as oracle_mod
from socllm.models.oracle import Oracle
from socllm.models.tokenizer import Tokenizer
from socllm.scripts.llamacpp_fixtures import CASES, PRES, PROMPT, model_path, texts, vocab_gguf

DATA = Path(__file__).parent / "data"
FIX = np.load(DATA / "llamacpp_models.npz")
F32 = [n for n, c in CASES.items() if c["matrix"] == "F32"]


def _oracle(path):
    reader = open_gguf(path)
    cfg = load_config(reader)
    return Oracle(cfg, load_weights(reader, cfg))


# llama.cpp's CPU GELU reads a table: the input rounded to f16, the output an f16 (ggml-cpu vec.h,
# GGML_GELU_FP16), where socllm computes tanh-GELU in f32; on the synthetic Gemma 3 that moves
# the logits by ~4e-4 of their scale. With llama.cpp's table GELU the oracle agrees to 1e-4.
GELU_TOL = 1e-3


_EXACT_GELU = oracle_mod._gelu


def _table_gelu(x):
    y = _EXACT_GELU(x.astype(np.float16).astype(np.float32)).astype(np.float16)
    return np.where(x <= -10, 0, np.where(x >= 10, x, y.astype(np.float32))).astype(np.float32)


def _tol(name: str) -> float:
    return GELU_TOL if name.startswith("gemma3") else 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_the_oracle_computes_what_llamacpp_computes(tmp_path, name):
    """F32 weights: llama.cpp computes in f32 too, so logits agree to 1e-4 of their scale and 16
    greedy tokens are identical. Quantized weights: llama.cpp also rounds the activations to 8
    bits (Q8_0 / Q8_K) where socllm's oracle keeps f32, so only the top-1 and the logits' scale
    are compared."""
    want, greedy = FIX[f"{name}/logits"], list(FIX[f"{name}/greedy"])
    oracle = _oracle(model_path(name, str(tmp_path)))
    got = oracle.logits_for(PROMPT)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    if name in F32:
        assert err <= _tol(name), err
        assert oracle.greedy(PROMPT, len(greedy)) == greedy
    else:
        assert err <= 0.1, err
        assert (got.argmax(1) == want.argmax(1)).sum() >= len(PROMPT) - 1


def test_with_llamacpps_table_gelu_the_oracle_agrees_to_1e4(tmp_path, monkeypatch):
    """The Gemma 3 gap above is llama.cpp's f16 GELU table and nothing else."""
    monkeypatch.setattr(oracle_mod, "_gelu", _table_gelu)
    want = FIX["gemma3-F32/logits"]
    got = _oracle(model_path("gemma3-F32", str(tmp_path))).logits_for(PROMPT)
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4


@pytest.mark.parametrize("name,plan", [*((n, "cpu") for n in F32), ("qwen2-Q8_0", "gpu"),
                                       ("llama-Q4_K-Q6_K-table", "gpu"), ("gemma3-Q5_0-Q8_0", "gpu")])
def test_the_engine_computes_what_llamacpp_computes(tmp_path, ray_session, name, plan):
    """Through the actors: F32 models on the CPU actor (the processors that read F32 weights)
    give llama.cpp's 16 greedy tokens; quantized ones on the GPU its top-1 at every position."""
    from socllm.actors.engine import Engine
    want, greedy = FIX[f"{name}/logits"], list(FIX[f"{name}/greedy"])
    eng = Engine(model=model_path(name, str(tmp_path)), context=64, threads=2)
    try:
        out = eng.generate_ids(PROMPT, plan=plan, precision="f32", max_tokens=len(greedy), ignore_eos=True)
        got = eng.logits_after(PROMPT, plan, "f32")
    finally:
        eng.close()
    if name in F32:
        assert out["tokens"] == greedy
        assert float(np.abs(got - want).max() / np.abs(want).max()) <= _tol(name)
    else:
        assert (got.argmax(1) == want.argmax(1)).sum() >= len(PROMPT) - 1


@pytest.mark.parametrize("pre", PRES)
def test_token_ids_equal_llamacpps(tmp_path, pre):
    """SmolLM2's vocabulary and merges under each pre-tokenizer: the public-domain text and the
    hard strings (digits, emoji, mixed scripts, whitespace runs, special-token text)."""
    want = json.loads((DATA / "llamacpp_tokens.json").read_text())["ids"][pre]
    tok = Tokenizer(open_gguf(vocab_gguf(pre, str(tmp_path))))
    for key, text in texts().items():
        assert tok.encode(text) == want[key], key
