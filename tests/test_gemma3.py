"""The real Gemma 3 270M (Q4_K_M, from the `gemma` extra's packages) against llama.cpp, through
fixtures scripts/llamacpp_fixtures.py wrote (tests/data/llamacpp_gemma3.json), and against
socllm's oracle on the GPU and the NPU. Skipped when the model is not installed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from socllm.models.gguf_file import ModelError, model_path, open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.tokenizer import Tokenizer
from socllm.scripts.llamacpp_fixtures import GEMMA_POSITIONS, texts

FIX = json.loads((Path(__file__).parent / "data" / "llamacpp_gemma3.json").read_text())


@pytest.fixture(scope="module")
def gemma():
    try:
        path = model_path("gemma3-270m")
    except ModelError as e:
        pytest.skip(str(e))
    reader = open_gguf(path)
    return path, reader, load_config(reader)


@pytest.fixture(scope="module")
def oracle(gemma):
    _, reader, cfg = gemma
    return Oracle(cfg, load_weights(reader, cfg))


def test_the_config_is_gemma3s(gemma):
    cfg = gemma[2]
    assert (cfg.n_layers, cfg.dim, cfg.q_dim, cfg.kv_dim, cfg.vocab) == (18, 640, 1024, 256, 262144)
    assert cfg.act == "gelu" and cfg.post_norms and cfg.qk_norm and cfg.neox_rope
    assert cfg.window == 512 and cfg.swa_layers == tuple(i for i in range(18) if i % 6 != 5)
    assert (cfg.rope_theta, cfg.rope_theta_swa) == (1e6, 1e4)
    assert cfg.embed_scale == pytest.approx(640 ** 0.5)


def test_sentencepiece_ids_equal_llamacpps(gemma):
    """Gemma's SentencePiece-style BPE (scores, byte fallback, user-defined newline runs) on the
    public-domain text and the hard strings: the ids llama.cpp gives, and the text back."""
    tok = Tokenizer(gemma[1])
    for name, text in texts().items():
        assert tok.encode(text) == FIX["ids"][name], name
        assert tok.decode(FIX["ids"][name]) == text, name
    assert tok.add_bos and tok.bos_id == FIX["prompt"][0]


def test_the_oracle_agrees_with_llamacpp_at_95_percent_of_positions(oracle):
    """Teacher-forced over BOS and the text's first 63 tokens: llama.cpp rounds activations to 8
    bits for these weights, so the top-1 may differ where the two best logits are close."""
    logits = oracle.logits_for(FIX["prompt"])
    assert len(FIX["prompt"]) == GEMMA_POSITIONS
    agree = int((logits.argmax(1) == np.array(FIX["top1"])).sum())
    assert agree >= 0.95 * GEMMA_POSITIONS, agree


# plan -> greedy tokens checked: the first 6 are distinct, then the reference repeats a cycle of 5
# (..., 496, 880, 529, 3670, 563, 496, ...)
GREEDY = {"gpu": 12, "npu": 12}


def test_the_gpu_and_the_npu_give_the_oracles_greedy_tokens(gemma, oracle, ray_session):
    from socllm.actors.pool import Pool
    prompt = FIX["prompt"][:12]
    want = oracle.greedy(prompt, max(GREEDY.values()))
    eng = Pool(model=gemma[0], context=64, threads=2, processors_=tuple(GREEDY))  # no CPU actor
    try:
        for plan, n in GREEDY.items():
            got = eng.generate_ids(prompt, plan=plan, precision="f32", max_tokens=n, ignore_eos=True)
            assert got["tokens"] == want[:n], plan
            assert got["placement"] == {"prefill": plan, "decode": plan}, got["placement"]
        assert len(set(want[:6])) == 6
    finally:
        eng.close()


def test_the_builtin_chat_template_renders_as_llamacpps(gemma):
    """The file holds no chat template: socllm renders Gemma's as llama.cpp's built-in one does
    (a system message opens the first user turn; assistant turns are the model's)."""
    from socllm.models.chat import ChatTemplate, render_chat
    template = ChatTemplate.from_reader(gemma[1])
    for case in FIX["chat"]:
        assert render_chat(template, case["messages"], add_generation_prompt=case["add"]) == case["text"]


def test_end_of_turn_is_a_stop_token(gemma):
    """<end_of_turn> ends Gemma's turns; it is in llama.cpp's end-of-generation set, so socllm
    stops there too (and never shows it: the engine drops stop tokens from the text)."""
    tok = Tokenizer(gemma[1])
    assert tok.stop_ids() == sorted({tok.eos_id, *tok.encode("<end_of_turn>")}) == [1, 106]
