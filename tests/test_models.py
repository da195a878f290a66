"""models/: the GGUF file, config, weights, tokenizer, chat template and the fp32 oracle."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFWriter

from tiny_gguf import write, write_tiny

from socllm.models.chat import chat_prompt, render_chat
from socllm.models.gguf_file import ModelError, open_gguf, verify_default_model
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle

PROMPT = "The capital of France is"


# --- the default model ---------------------------------------------------------------------

def test_default_model_config(model_config):
    c = model_config
    assert (c.arch, c.n_layers, c.dim, c.ffn_dim) == ("llama", 30, 576, 1536)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.vocab) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.eps == pytest.approx(1e-5)
    assert c.context_length == 8192
    assert c.tied_embeddings and not c.qkv_bias and not c.neox_rope


def test_weights_stay_quantized_in_planar_layout(model_weights):
    embd = model_weights["token_embd.weight"]                    # Q8_0
    assert embd["qs"].shape == (49152, 576) and embd["qs"].dtype == np.int8
    assert embd["d"].shape == (49152, 18) and embd["d"].dtype == np.float16
    down = model_weights["blk.0.ffn_down.weight"]                # Q4_1 [out 576, in 1536]
    assert down["qs"].shape == (576, 768) and down["qs"].dtype == np.uint8
    assert down["d"].shape == down["m"].shape == (576, 48)
    norm = model_weights["blk.29.ffn_norm.weight"]
    assert norm.shape == (576,) and norm.dtype == np.float32
    assert "output.weight" not in model_weights                  # tied to token_embd


# --- tokenizer -----------------------------------------------------------------------------

def test_tokenizer_gives_hugging_face_ids(tokenizer):
    assert tokenizer.encode(PROMPT) == [504, 3575, 282, 4649, 314]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == (1, 2, False)


def test_digits_are_split_one_by_one(tokenizer):
    assert len(tokenizer.encode("2024")) == 4


def test_control_tokens_encode_to_one_id(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


@pytest.mark.parametrize("text", [PROMPT, "2024-01-31: 3.14159", "héllo wörld 日本語 😀🎉",
                                  "  leading spaces\n\n\ttabs", "<|im_start|>x<|im_end|>"])
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_stream_decoder_emits_only_whole_characters(tokenizer):
    text = "Bonjour 😀 à 日本語!"
    stream = tokenizer.stream()
    pieces = [stream.feed(i) for i in tokenizer.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # the emoji spans tokens: its first bytes emit nothing


# --- chat template -------------------------------------------------------------------------

def test_chat_template_adds_default_system_prompt(gguf_reader):
    prompt = chat_prompt(gguf_reader, "Hi!")
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_keeps_a_given_system_prompt(gguf_reader):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(gguf_reader, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_a_continued_final_message_ends_right_after_its_text(gguf_reader):
    """continue_final (Hugging Face's and vLLM's continue_final_message): the prompt ends inside
    the assistant's turn, its trailing space kept where the template keeps it, and where a
    template trims it (Gemma's) after the trimmed text; no text to continue is refused."""
    from socllm.models.chat import BUILTIN
    said = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "It is "}]
    full = render_chat(gguf_reader, said, add_generation_prompt=False)
    assert render_chat(gguf_reader, said, continue_final=True) == full[:full.rindex("It is ") + 6]
    assert render_chat(BUILTIN["gemma3"], said, continue_final=True) == (
        "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\nIt is")
    short = [said[0], {"role": "assistant", "content": "<"}]     # not found in the template's markers
    assert render_chat(gguf_reader, short, continue_final=True).endswith("<|im_start|>assistant\n<")
    with pytest.raises(ValueError, match="no text"):
        render_chat(gguf_reader, said[:1] + [{"role": "assistant", "content": "  "}], continue_final=True)


def test_chat_template_runs_sandboxed():
    with pytest.raises(ModelError):
        render_chat("{{ messages.__class__.__mro__ }}", [])


# --- the oracle ----------------------------------------------------------------------------

def test_oracle_says_paris(oracle, tokenizer):
    out = oracle.greedy(tokenizer.encode(PROMPT), 3)
    assert tokenizer.decode(out).startswith(" Paris")


def test_teacher_forced_logits_agree_with_incremental_decode(oracle, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    new = oracle.greedy(prompt, 4)
    logits = oracle.logits_for(prompt + new)                    # [9, vocab]
    assert logits.dtype == np.float32 and logits.shape == (9, 49152)
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == new
    kv = oracle.new_cache(16)  # prefill in two chunks == one pass, to fp32 rounding
    oracle.forward(prompt[:2], 0, kv)
    np.testing.assert_allclose(oracle.forward(prompt[2:], 2, kv), logits[len(prompt) - 1],
                               rtol=0, atol=1e-3)


def test_the_oracles_kept_continuations_are_its_greedy_ones(oracle, tokenizer):
    """The session's oracle keeps its greedy continuations on disk (conftest.py _KeptGreedy):
    what it keeps is what its greedy computes now, and a continuation asked for again is the
    kept one, not computed anew."""
    oracle.greedy(tokenizer.encode(PROMPT), 3)
    kept = sorted(oracle._kept.items(), key=lambda kv: len(kv[0]) + len(kv[1]))[:3]
    for ids, cont in kept:
        assert Oracle.greedy(oracle, list(ids), len(cont)) == cont
    file = json.loads(oracle._file.read_text())
    assert all(file[json.dumps(list(ids))] == cont for ids, cont in kept)

# --- files socllm must refuse, with one-line reasons ---------------------------------------

def _refused(path) -> str:
    with pytest.raises(ModelError) as e:
        load_config(open_gguf(str(path)))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_file_is_refused(tmp_path):
    assert "not found" in _refused(tmp_path / "nope.gguf")


def test_non_gguf_file_is_refused(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 100)
    assert "not a GGUF" in _refused(junk)
    with pytest.raises(ModelError, match="damaged"):
        verify_default_model(str(junk))


def test_a_models_digest_is_hashed_once_and_names_the_same_model_anywhere(tmp_path, monkeypatch,
                                                                         model_path):
    """file_digest keys the caches of compiled programs and timed plans: the same bytes at
    another path (a new venv, a fresh clone) have the same digest; each file is hashed once
    until it changes; entries of files gone are dropped."""
    import json
    import shutil

    from socllm.models import gguf_file
    monkeypatch.setattr(gguf_file, "HASH_CACHE", tmp_path / "digests.json")
    real, hashed = gguf_file._sha256, []
    monkeypatch.setattr(gguf_file, "_sha256", lambda p: hashed.append(p) or real(p))
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(model_path, copy)
    want = gguf_file.DEFAULT_MODEL_SHA256
    assert gguf_file.file_digest(model_path) == gguf_file.file_digest(str(copy)) == want
    assert gguf_file.file_digest(str(copy)) == want and len(hashed) == 2
    copy.write_bytes(b"another model")                       # changed: hashed anew
    assert gguf_file.file_digest(str(copy)) != want and len(hashed) == 3
    copy.unlink()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"x")
    gguf_file.file_digest(str(other))
    kept = json.loads((tmp_path / "digests.json").read_text())
    assert len(kept) == 2 and not any(str(copy) in k for k in kept)


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    write(w)
    assert "'gpt2'" in _refused(path)


def test_unsupported_tensor_type_is_refused(tmp_path):
    path = tmp_path / "q2k.gguf"
    write_tiny(path, "llama", dim=256, ffn=512, types={"blk.0.attn_q.weight": "Q2_K"})
    assert "blk.0.attn_q.weight" in _refused(path) and "Q2_K" in _refused(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_of_each_architecture_loads_and_runs(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_tiny(path, arch)
    reader = open_gguf(str(path))
    cfg = load_config(reader)
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.head_dim == 16
    oracle = Oracle(cfg, load_weights(reader, cfg))
    greedy = oracle.greedy([1, 2, 3], 3)
    logits = oracle.logits_for([1, 2, 3] + greedy[:2])       # teacher-forced: the same argmaxes
    assert np.isfinite(logits).all() and logits.argmax(1)[2:].tolist() == greedy




def test_qwen3moe_experts_are_their_own_width_and_the_moe_families_need_experts(tmp_path):
    """As llama.cpp reads them (src/models/qwen3moe.cpp): Qwen3-MoE's experts are
    expert_feed_forward_length wide (its feed_forward_length is the dense width), or, without
    that key, feed_forward_length / k; a qwen3moe or olmoe file without experts is refused."""
    from socllm.models.llama import read_config
    reader = open_gguf(write_tiny(tmp_path / "q.gguf", arch="qwen3moe", ffn=64, top_k=2))
    assert read_config(reader).ffn_dim == 64              # feed_forward_length: 192
    del reader.fields["qwen3moe.expert_feed_forward_length"]
    assert read_config(reader).ffn_dim == 96
    reader = open_gguf(write_tiny(tmp_path / "o.gguf", arch="olmoe"))
    del reader.fields["olmoe.expert_count"]
    with pytest.raises(ModelError, match="olmoe needs olmoe.expert_count"):
        read_config(reader)


def test_an_untied_output_weight_is_the_lm_head(model_config):
    """A GGUF with its own output.weight (most Llama 3 and Qwen files) must not be read through
    token_embd (the REVIEW's first bug): the graph's lm-head reads output.weight."""
    import dataclasses

    from socllm.graph.build import build_graph
    untied = dataclasses.replace(model_config, tied_embeddings=False)
    for cfg, table in ((model_config, "token_embd.weight"), (untied, "output.weight")):
        g = build_graph(cfg, n_layers=1)
        head = [op for op in g.ops if op.kind == "lm_head"]
        assert len(head) == 1 and head[0].inputs["table"] == table
        assert ("output.weight" in g.tensors) == (table == "output.weight")


def test_a_gemma3_with_rope_scaling_is_refused_with_one_line(tmp_path):
    """The 4B-27B scale their global layers' rope positions; socllm does not, so it says so."""
    from socllm.models.gguf_file import ModelError, open_gguf
    from socllm.models.llama import load_config
    from socllm.models.synthetic import write_tiny
    path = write_tiny(tmp_path / "g.gguf", arch="gemma3", layers=2,
                      meta={"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    with pytest.raises(ModelError, match="rope scaling \\(factor 8"):
        load_config(open_gguf(path))
    load_config(open_gguf(write_tiny(tmp_path / "ok.gguf", arch="gemma3", layers=2)))
