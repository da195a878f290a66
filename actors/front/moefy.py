"""`socllm moefy`: the dense default model rewritten as a Mixtral-style MoE GGUF that llama.cpp
loads (models/moefy.py, moe_gguf.py), calibrated on in-repo text, nothing downloaded; --ppl then
scores it against the dense model on held-out text, in socllm's oracle and in llama.cpp."""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time


def _k_list(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K or K,K,..., got {text!r}") from None
    return list(dict.fromkeys(ks))


def add_parser(sub):
    from socllm.models.moefy import SPLITS
    m = sub.add_parser("moefy", help="rewrite the dense model as a mixture-of-experts GGUF "
                       "(llama.cpp loads it): E experts per FFN, k of them a token")
    m.add_argument("-o", "--out", required=True, metavar="FILE.gguf",
                   help="the file; with several --top-k, a name holding {k}")
    m.add_argument("--experts", type=int, default=16, help="experts per layer; ffn / E must be a "
                   "multiple of 32 (default %(default)s)")
    m.add_argument("--top-k", type=_k_list, default=[12], metavar="K[,K...]",
                   help="experts a token uses, folded into the file's weights, so one file per k "
                        "(one calibration for all); below 3/4 of E SmolLM2 loses its text: "
                        "docs/moe.md (default 12)")
    m.add_argument("--split", choices=SPLITS, default="neurons",
                   help="neurons: balanced clustering of every neuron by co-activation (down "
                        "requantized); atoms: of aligned 32-neuron blocks (byte copies; exact at "
                        "k = E) (default %(default)s)")
    m.add_argument("--model", default=None, help="a dense llama GGUF with Q4_1 FFN matrices "
                   "(default: SmolLM2-135M-Instruct Q4_1)")
    m.add_argument("--tokens", type=int, default=4096,
                   help="calibration tokens of scripts/data/pride_and_prejudice_ch3-6.txt "
                        "(default %(default)s)")
    m.add_argument("--seed", type=int, default=0, help="k-means initialisation (default 0)")
    m.add_argument("--ppl", action="store_true",
                   help="then perplexity and top-1 agreement of the dense model and each file on "
                        "held-out text (chapters 1-2), socllm's oracle and llama.cpp")


def run(a) -> int:
    from socllm.models.gguf_file import default_model_path, open_gguf
    from socllm.models.llama import read_config
    from socllm.models.moe_gguf import write_moe
    from socllm.models.moefy import check_args, plan, stderr_bar
    src = a.model or default_model_path()
    if not os.path.isfile(src):
        raise ValueError(f"model file not found: {src}")
    if len(a.top_k) > 1 and "{k}" not in a.out:
        raise ValueError("-o must hold {k} in its name to take several --top-k values")
    if not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        raise ValueError(f"no such directory for -o: {os.path.dirname(a.out)}")
    ffn = read_config(open_gguf(src)).ffn_dim
    for k in a.top_k:
        check_args(ffn, a.experts, k, a.split)
    t0 = time.perf_counter()
    moe = plan(src, a.experts, a.split, a.tokens, a.seed, bar=stderr_bar)
    print(f"calibrated on {a.tokens} tokens and split in {time.perf_counter() - t0:.0f} s")
    files = []
    for k in a.top_k:
        out, t1 = a.out.replace("{k}", str(k)), time.perf_counter()
        write_moe(src, out, moe, k, bar=stderr_bar)
        with open(out, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        recall = sum(l.recall[k - 1] for l in moe["layers"]) / len(moe["layers"])
        took = time.perf_counter() - t1
        print(f"{out}: {a.experts} experts, {k} a token, {a.split} split, "
              f"{os.path.getsize(out) / 2**20:.1f} MB, written in {took:.0f} s; "
              f"router recall {recall:.3f}\nsha256 {digest}")
        files.append((f"E={a.experts} k={k}", out))
    if a.ppl:
        _ppl(src, files)
    return 0


def _ppl(dense: str, files: list, window: int = 512) -> None:
    """PPL and top-1 agreement with the dense model on scripts/perplexity.py's text (chapters
    1-2, never calibrated on), each window from an empty cache; llama.cpp too where installed."""
    import numpy as np
    from socllm.models.gguf_file import open_gguf
    from socllm.models.llama import load_config, load_weights
    from socllm.models.oracle import Oracle
    from socllm.models.tokenizer import Tokenizer
    from socllm.scripts.perplexity import TEXT, llama_logits, llama_model, score_windows, windows
    ids = Tokenizer(open_gguf(dense)).encode(TEXT.read_text())
    print(f"\nheld out: {TEXT.name}, {len(ids)} tokens in {len(windows(ids, window))} windows of "
          f"{window}; top-1 = dense: teacher-forced argmax equal to the dense model's, same engine")
    print(f"{'model':<12}{'oracle PPL':>14}{'top-1 = dense':>15}{'llama.cpp PPL':>15}"
          f"{'top-1 = dense':>15}")
    top = {}
    for name, path in [("dense", dense), *files]:
        print(f"moefy: scoring {name}", file=sys.stderr, flush=True)
        reader = open_gguf(path)
        cfg = load_config(reader)
        oracle = Oracle(cfg, load_weights(reader, cfg))
        nll, top[name, 0] = score_windows(oracle.logits_for, ids, window)
        del oracle
        same = np.mean(top[name, 0] == top["dense", 0])
        row = f"{name:<12}{np.exp(nll.mean()):>14.6g}{same:>15.4f}"
        try:
            llm = llama_model(path, window)
        except ImportError:
            print(f"{row}{'-':>15}{'-':>15}  (llama-cpp-python, the bench extra, is absent)")
            continue
        nll, top[name, 1] = score_windows(lambda w: llama_logits(llm, w), ids, window)
        del llm
        same = np.mean(top[name, 1] == top["dense", 1])
        print(f"{row}{np.exp(nll.mean()):>15.6g}{same:>15.4f}", flush=True)
