"""What llama.cpp computes on socllm's synthetic test models and tokenizers, written once as small
fixtures the default tests compare against (building llama-cpp-python takes minutes; CI reads the
committed files). Needs the `bench` extra.

    python -m socllm.scripts.llamacpp_fixtures [--out tests/data]

  llamacpp_models.npz   per case (family x weight format, models/synthetic.py, seeded): the
                        prompt, llama.cpp's teacher-forced logits at every prompt position (f32 KV
                        cache, so F32 models compute in f32 throughout) and its 16 greedy tokens
  llamacpp_tokens.json  llama.cpp's token ids of the repository's public-domain text and of hard
                        strings, for SmolLM2's vocabulary under each pre-tokenizer socllm reads
  llamacpp_gemma3.json  with the real Gemma 3 270M installed (the `gemma` extra): its token ids of
                        the same texts (SentencePiece-style), the top-1 of its teacher-forced
                        logits over the first 64 tokens of the text, and 16 greedy tokens
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from socllm.models.synthetic import write_tiny

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]      # "Hello, world"
GREEDY = 16
# (name, write_tiny arguments): every family (the mixtures of experts too), and Llama in every
# weight format
CASES = {
    "llama-F32": dict(arch="llama", matrix="F32", table="F32"),
    "qwen2-F32": dict(arch="qwen2", matrix="F32", table="F32"),
    "llama3-F32": dict(arch="llama", matrix="F32", table="F32", extra=("rope_freqs.weight",)),
    "qwen3-F32": dict(arch="qwen3", matrix="F32", table="F32"),
    # two sliding-window layers of 4 keys, then a global one; 4 query heads of 32 (q: 128 wide)
    "gemma3-F32": dict(arch="gemma3", matrix="F32", table="F32", layers=3, heads=4),
    # mixtures of experts: 8 experts of 128, 2 a token; Mixtral-style llama, Qwen3-MoE (4 query
    # heads of 32: q 128 wide, not dim; its feed_forward_length is not the experts' width), OLMoE
    "llama-moe-F32": dict(arch="llama", matrix="F32", table="F32", experts=8, top_k=2, ffn=128),
    "qwen3moe-F32": dict(arch="qwen3moe", matrix="F32", table="F32", top_k=2, ffn=128, heads=4),
    "olmoe-F32": dict(arch="olmoe", matrix="F32", table="F32", top_k=2, ffn=128),
    **{f"llama-{f}": dict(arch="llama", matrix=f) for f in
       ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")},
    "llama-Q4_K-Q6_K-table": dict(arch="llama", matrix="Q4_K", table="Q6_K"),
    "qwen2-Q8_0": dict(arch="qwen2", matrix="Q8_0"),
    "qwen3-Q4_K": dict(arch="qwen3", matrix="Q4_K"),
    "gemma3-Q5_0-Q8_0": dict(arch="gemma3", matrix="Q5_0", types={"blk.0.attn_v.weight": "Q8_0"},
                             layers=3, heads=4),
}
SIZE = dict(dim=256, ffn=512, head_dim=32, layers=2)
HARD = ["", " ", "  leading spaces", "trailing  ", "tabs\tand\nnewlines\n\n\n", "1234567890 3.14159 1e-10",
        "emoji 🦙🚀👍🏽 and 中文 and العربية and Ελληνικά", "<|im_start|>user\nhi<|im_end|>",
        "don't won't I'm we'll they've", "ALLCAPS MiXeD cAsE", "a" * 50, "🙂" * 5,
        "    def f(x):\n        return x**2\n", "https://example.com/path?q=1&r=2#frag"]
PRES = ("smollm", "llama-bpe", "qwen2")


def model_path(name: str, folder: str) -> str:
    return write_tiny(os.path.join(folder, f"{name}.gguf"), **{**SIZE, **CASES[name]})


def run_models(folder: str) -> dict:
    import llama_cpp
    out = {}
    for name in CASES:
        m = llama_cpp.Llama(model_path(name, folder), n_ctx=64, n_threads=2, logits_all=True,
                            verbose=False, type_k=0, type_v=0)     # GGML_TYPE_F32 K/V
        m.reset()
        m.eval(PROMPT)
        logits = np.array(m.scores[:len(PROMPT)], np.float32)
        greedy = []
        for _ in range(GREEDY):
            greedy.append(int(np.argmax(m.scores[m.n_tokens - 1])))
            m.eval(greedy[-1:])
        out[f"{name}/logits"], out[f"{name}/greedy"] = logits, np.array(greedy, np.int32)
        del m
    return out


def vocab_gguf(pre: str, folder: str) -> str:
    """SmolLM2's tokenizer under pre-tokenizer `pre`, in a GGUF without tensors (vocab only)."""
    from gguf import GGUFWriter
    from socllm.models.gguf_file import default_model_path, open_gguf
    src = open_gguf(default_model_path())
    path = os.path.join(folder, f"vocab-{pre}.gguf")
    w = GGUFWriter(path, "llama")
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(64)
    w.add_feed_forward_length(128), w.add_head_count(2), w.add_layer_norm_rms_eps(1e-5)
    f = src.fields
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre(pre)
    w.add_token_list(f["tokenizer.ggml.tokens"].contents())
    w.add_token_types(f["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(int(f["tokenizer.ggml.bos_token_id"].contents()))
    w.add_eos_token_id(int(f["tokenizer.ggml.eos_token_id"].contents()))
    w.add_add_bos_token(False)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def texts() -> dict:
    here = Path(__file__).parent / "data" / "pride_and_prejudice_ch1-2.txt"
    return {"public-domain text": here.read_text(), **{f"hard {i}": s for i, s in enumerate(HARD)}}


def run_tokens(folder: str) -> dict:
    import llama_cpp
    out = {}
    for pre in PRES:
        m = llama_cpp.Llama(vocab_gguf(pre, folder), vocab_only=True, verbose=False)
        out[pre] = {k: m.tokenize(t.encode(), add_bos=False, special=True) for k, t in texts().items()}
        del m
    return out


GEMMA_POSITIONS = 64


def gemma3_prompt(tokenize) -> list:
    """BOS and the text's first GEMMA_POSITIONS - 1 tokens: the teacher-forced positions."""
    return tokenize(texts()["public-domain text"])[:GEMMA_POSITIONS - 1]


def run_gemma3() -> dict | None:
    import llama_cpp
    from socllm.models.gguf_file import ModelError, model_path
    try:
        path = model_path("gemma3-270m")
    except ModelError:
        return None
    m = llama_cpp.Llama(path, n_ctx=256, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    ids = {k: m.tokenize(t.encode(), add_bos=False, special=True) for k, t in texts().items()}
    prompt = [m.token_bos()] + gemma3_prompt(lambda t: m.tokenize(t.encode(), add_bos=False, special=True))
    m.reset()
    m.eval(prompt)
    top1 = [int(np.argmax(m.scores[i])) for i in range(len(prompt))]
    greedy = []
    for _ in range(GREEDY):
        greedy.append(int(np.argmax(m.scores[m.n_tokens - 1])))
        m.eval(greedy[-1:])
    return {"ids": ids, "prompt": prompt, "top1": top1, "greedy": greedy,
            "chat": [{"messages": msgs, "add": add, "text": _llamacpp_chat(b"gemma", msgs, add)}
                     for msgs in CHATS for add in (True, False)]}


CHATS = [[{"role": "user", "content": "Hello!"}],
         [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Name a colour."}],
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello, how can I help? "},
          {"role": "user", "content": "Tell me a joke.\n\n"}]]


def _llamacpp_chat(template: bytes, messages: list, add: bool) -> str:
    """llama.cpp's built-in chat template `template` applied to messages."""
    import ctypes
    import llama_cpp
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    arr = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template, arr, len(keep), add, buf, len(buf))
    return buf.raw[:n].decode()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "data")
    a = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llamacpp_fixtures: needs llama-cpp-python (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        models = run_models(tmp)
        np.savez_compressed(a.out / "llamacpp_models.npz", prompt=np.array(PROMPT, np.int32),
                            version=np.array(llama_cpp.__version__), **models)
        tokens = run_tokens(tmp)
    (a.out / "llamacpp_tokens.json").write_text(json.dumps(
        {"llama_cpp": llama_cpp.__version__, "ids": tokens}, separators=(",", ":")))
    gemma = run_gemma3()
    if gemma is not None:
        (a.out / "llamacpp_gemma3.json").write_text(json.dumps(
            {"llama_cpp": llama_cpp.__version__, **gemma}, separators=(",", ":")))
    print(f"wrote {a.out}/llamacpp_models.npz ({len(CASES)} models) and llamacpp_tokens.json"
          + (", llamacpp_gemma3.json" if gemma else " (no Gemma 3 270M installed: no llamacpp_gemma3.json)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
