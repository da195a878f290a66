"""Perplexity on a fixed public-domain text: of the numpy oracle per 4-bit weight format, or of
socllm's engines per precision against llama.cpp's (--runs), with greedy agreement (--greedy).

    .venv/bin/python -m socllm.scripts.perplexity [--window 512] [--json]

Variants of the same model (every Q4_1 matrix; the Q8_0 embedding / lm_head and f32 norms as is):
  q4_1          the GGUF's Q4_1 weights
  q4_1-requant  the control: Q4_1 values quantized again to Q4_1 (llama.cpp's min-max rounding);
                a 4-bit format re-fitted to values already on its grid should change ~nothing
  e0m4          the Q4_1 values requantized to E0M4 FP4 (Transformer-Lite §2.3, models/e0m4.py).
                The GGUF has no original float weights, so this is Q4_1 error plus E0M4 error:
                an upper bound on what E0M4 from the float model would cost, not its measure.
  e0m4-q4codes  E0M4's decode (and kernel) over the Q4_1 codes themselves: the bias is not
                snapped to the code grid (zero is not exact), so nothing is requantized.
The text (scripts/data/) is cut into non-overlapping windows, each run from an empty KV cache;
every token after a window's first is scored: PPL = exp(mean NLL).

Engines (--runs, a comma list; the same windows and token ids for each):
  oracle            the numpy fp32 oracle on the GGUF's weights (the variants above: --variants)
  llama.cpp         llama_cpp.Llama (logits_all, n_ctx = window, n_threads 2) on the same GGUF, fed
                    socllm's token ids: every window evaluated from an empty KV cache
  local:P           socllm.actors.pool.Pool (cpu + gpu actors), one window at a time:
                    teacher-forced through the GPU's one-row paged decode steps at precision P
                    (Pool.logits_after: what a precision changes; prefill computes in f32),
                    f32 KV cache
  http:URL          a running service's OpenAI endpoint (`socllm serve`, at its own precision):
                    every window in one batched /v1/completions request, as token ids, with echo
                    and logprobs (the prompt's tokens' logprobs, as evaluation harnesses score a
                    text); no top-1 (the reply names tokens by their text, not their ids)
  served:P          the service's paged steps (actors/runner.py Runner, KV dtype of P as the
                    service picks it): --rows windows teacher-forced together, one row each per
                    decode batch, so the batched kernels run (a short last group repeats a window)
    .venv/bin/python -m socllm.scripts.perplexity --runs oracle,llama.cpp,local:q8,served:q8 \
        --greedy --out scripts/results/quality-2core-zen5
--greedy adds greedy agreement with llama.cpp: PROMPTS (chat and plain; --greedy-set 48: 36 more)
x --greedy-tokens greedy tokens per engine (served: the Service actor itself, every prompt
submitted at once; EOS ignored, texts compared up to the first stop token); --no-ppl skips the
perplexities. --speed q8,q16: decode tok/s per precision instead (decode_speed).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from socllm.models.e0m4 import dequantize_e0m4, from_q4_1
from socllm.models.gguf_file import default_model_path, open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.quant import QK, dequant_q4_1
from socllm.models.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch1-2.txt"


def requantize_q4_1(t: dict) -> dict:
    """Planar Q4_1 -> its values -> Q4_1 again, as llama.cpp's quantize_row_q4_1_ref rounds:
    d = (max - min) / 15 and m = min per block (stored f16), q = trunc((w - min) / d + 0.5)."""
    w = dequant_q4_1(t["qs"], t["d"], t["m"])
    M, K = w.shape
    g = w.reshape(M, K // QK, QK)                                  # [M, K/32, 32]
    lo, hi = g.min(axis=2), g.max(axis=2)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.minimum(((g - lo[:, :, None]) * inv[:, :, None] + np.float32(0.5)).astype(np.uint8), 15)
    qs = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(M, K // 2)
    return {"qs": qs, "d": d.astype(np.float16), "m": lo.astype(np.float16)}


VARIANTS = {  # planar Q4_1 -> a planar Q4_1 dict or the f32 values an E0M4 kernel computes [M, K]
    "q4_1": lambda t: t,
    "q4_1-requant": requantize_q4_1,
    "e0m4": lambda t: dequantize_e0m4(*from_q4_1(t)),
    "e0m4-q4codes": lambda t: dequantize_e0m4(*from_q4_1(t, snap_bias=False)),
}


def variant_weights(weights: dict, kind: str) -> tuple[dict, float]:
    """The model with every Q4_1 matrix converted; -> (weights, mean |w - w_q4_1| over them)."""
    out, err, n = dict(weights), 0.0, 0
    for name, t in weights.items():
        if isinstance(t, dict) and "m" in t:                       # a Q4_1 matrix
            out[name] = VARIANTS[kind](t)
            if kind != "q4_1":
                new = out[name] if isinstance(out[name], np.ndarray) else \
                    dequant_q4_1(out[name]["qs"], out[name]["d"], out[name]["m"])
                err += float(np.abs(new - dequant_q4_1(t["qs"], t["d"], t["m"])).sum())
                n += new.size
    return out, err / max(n, 1)


def windows(ids: list[int], window: int) -> list[list[int]]:
    """The text cut into non-overlapping windows (a last one of fewer than 2 tokens dropped)."""
    return [w for s in range(0, len(ids) - 1, window) for w in [ids[s: s + window]] if len(w) >= 2]


def nll_of(w: list[int], logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, vocab] of a window (row t predicts w[t+1]) -> (NLL of w[1:] f64, argmax [T-1])."""
    z = np.asarray(logits[: len(w) - 1], np.float64)
    mx = z.max(axis=1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(z - mx).sum(axis=1))
    return lse - z[np.arange(len(w) - 1), w[1:]], z.argmax(axis=1)


def score_windows(logits_of, ids: list[int], window: int) -> tuple[np.ndarray, np.ndarray]:
    """logits_of(window ids) -> [T, vocab]; -> (NLL of every scored token [S], argmax there [S])."""
    parts = [nll_of(w, logits_of(w)) for w in windows(ids, window)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def http_score(url: str, ids: list[int], window: int) -> tuple[np.ndarray, None]:
    """The windows' NLL from a service's /v1/completions: one request, a prompt per window (token
    ids), echo with logprobs 0; each window's prompt logprobs after its first token."""
    import requests
    ws = windows(ids, window)
    r = requests.post(url.rstrip("/") + "/v1/completions", timeout=3600, json={
        "prompt": ws, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0})
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return -np.concatenate([np.array(c["logprobs"]["token_logprobs"][1:len(w)], np.float64)
                            for c, w in zip(choices, ws)]), None


def score(oracle: Oracle, ids: list[int], window: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (NLL of every scored token [S] f64, the oracle's argmax there [S])."""
    return score_windows(oracle.logits_for, ids, window)


# -- other engines ---------------------------------------------------------------------------------
def llama_model(path: str, n_ctx: int, threads: int = 2):
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=threads,
                 n_threads_batch=threads, verbose=False)


def llama_logits(llm, w: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(w)
    return np.array(llm.scores[: len(w)], np.float32)


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def start_ray(threads: int = 2):
    """A private local Ray instance (never a cluster found on this machine)."""
    import ray
    from socllm.actors.front.cluster import OBJECT_STORE_BYTES
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=threads, object_store_memory=OBJECT_STORE_BYTES,
                 include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 _system_config={"worker_niceness": 0, "enable_worker_prestart": False,
                                 "prestart_worker_first_driver": False})


def local_engine(reader, context: int, threads: int = 2):
    from socllm.actors.pool import Pool
    start_ray(threads)
    return Pool(reader=reader, context=context, processors_=("cpu", "gpu"), threads=threads)


def local_logits(eng, precision: str):
    """Teacher-forced logits of a window through the local engine's decode steps (plan gpu: what
    every serving plan but npu and tensor decodes on)."""
    return lambda w: eng.logits_after(w, plan="gpu", precision=precision)


def served_engine(reader, precision: str, context: int, rows: int, threads: int = 2):
    """An engine laid out as the service lays its own out (paged KV of the precision's dtype)."""
    from socllm.actors.pool import Pool
    from socllm.actors.service import KV_DTYPE
    from socllm.memory.blocks import BLOCK_ROWS
    start_ray(threads)
    cfg = load_config(reader)
    per_row = cfg.n_layers * 2 * cfg.kv_dim * (2 if KV_DTYPE[precision] == "f16" else 4)
    blocks = rows * -(-context // BLOCK_ROWS) + 2
    return Pool(reader=reader, context=context, processors_=("cpu", "gpu"), threads=threads,
                max_seqs=rows, kv_mb=blocks * BLOCK_ROWS * per_row / 2**20 + 1,
                kv_dtype=KV_DTYPE[precision])


def served_score(eng, precision: str, ids: list[int], window: int, rows: int):
    """The windows `rows` at a time through the service's runner: every decode batch holds one
    row of each window of the group (teacher-forced, each at its own position and block table);
    a short last group repeats its windows so that the batch keeps `rows` rows.
    -> (NLL [S], argmax [S]) in window order."""
    from socllm.actors.runner import Runner
    runner = Runner(eng, "gpu", precision)
    br, ws = runner.lay.block_rows, windows(ids, window)
    nb = -(-window // br)
    parts = []
    for g in range(0, len(ws), rows):
        group = ws[g: g + rows]
        batch = [group[i % len(group)] for i in range(rows)]
        tables = {s: list(range(s * nb, (s + 1) * nb)) for s in range(rows)}
        got = [[] for _ in batch]
        for pos in range(max(len(w) for w in batch) - 1):
            live = [s for s, w in enumerate(batch) if pos < len(w) - 1]
            logits = runner.step([(batch[s][pos], pos, s) for s in live],
                                 {s: tables[s] for s in live}, all_rows=True)
            for i, s in enumerate(live):
                got[s].append(logits[i].copy())
        parts += [nll_of(w, np.stack(got[i])) for i, w in enumerate(group)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# -- greedy agreement ------------------------------------------------------------------------------
PROMPTS = [  # (text, chat)
    ("Hi", True),
    ("What is the capital of France?", True),
    ("Write a haiku about the sea.", True),
    ("Explain photosynthesis in one sentence.", True),
    ("Give me three tips for learning Python.", True),
    ("What is 12 times 7?", True),
    ("The capital of France is", False),
    ("Once upon a time, in a small village by the river,", False),
    ("The theory of relativity states that", False),
    ("def fibonacci(n):\n", False),
    ("The best way to cook rice is", False),
    ("In 1969, the first humans", False),
]


# --greedy-set 48: 36 more, for a count less at the mercy of a few near-ties
MORE_PROMPTS = [(p, True) for p in (
    "Hello, who are you?", "What is the boiling point of water?", "Name three primary colors.",
    "How do I reverse a list in Python?", "Tell me a joke about cats.", "What is the largest planet?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?", "Translate 'good morning' into Spanish.",
    "What are the benefits of exercise?", "Write a short poem about autumn.", "How many days are in a leap year?",
    "What does a CPU do?", "Suggest a name for a pet dog.", "What is the square root of 144?",
    "Describe a rainbow to a child.", "What should I eat for breakfast?", "Explain what gravity is.")] + \
    [(p, False) for p in (
    "The quick brown fox", "Water is made of", "My favorite book is", "The first step in baking bread is",
    "import numpy as np\n", "The Great Wall of China", "Dear Sir or Madam,\n", "Photosynthesis is the process",
    "The meaning of life is", "In the year 2050,", "Here is a list of fruits: apple,", "The sun rises in the",
    "SELECT name FROM", "The mitochondria is", "Once there was a dragon who", "To be or not to be,",
    "The stock market", "for i in range(10):\n")]
GREEDY_SETS = {12: PROMPTS, 48: PROMPTS + MORE_PROMPTS}


def prompt_ids(reader, tok: Tokenizer, prompts=PROMPTS) -> list[list[int]]:
    """The prompts as the engine encodes them (Pool.encode_prompt)."""
    from socllm.models.chat import ChatTemplate, chat_prompt
    tmpl = ChatTemplate.from_reader(reader)
    return [tok.encode(chat_prompt(tmpl, p) if chat else p, bos=tok.add_bos) for p, chat in prompts]


def served_greedy(precision: str, prompts: list[list[int]], n: int, context: int, threads: int = 2,
                  max_seqs: int = 4) -> list[list[int]]:
    """The Service actor itself (its default engine and loop; prefill on the GPU's chunks, no NPU
    compile): every prompt submitted at once, decoded in batches of up to max_seqs."""
    import ray
    from socllm.actors.service import Service
    from socllm.policies.config import ServeConfig
    from socllm.policies.threads import actor_env
    start_ray(threads)
    svc = Service.options(runtime_env={"env_vars": actor_env(threads)}).remote(ServeConfig.from_env(
        context=context, max_seqs=max_seqs, kv_mb=64, threads=threads, precision=precision,
        plan="gpu", abandon_s=3600.0))
    try:
        ray.get(svc.ready.remote())
        rids = ray.get([svc.submit.remote(ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
                        for p in prompts])
        out = []
        for rid in rids:
            while ray.get(svc.poll.remote(rid, 0, 10.0, 0.0))["state"] not in \
                    ("finished", "cancelled", "failed"):
                pass
            r = ray.get(svc.request.remote(rid))
            if r["error"]:
                raise RuntimeError(r["error"])
            out.append(list(r["tokens"]))
        return out
    finally:
        ray.get(svc.shutdown.remote())
        ray.kill(svc)


def agreement(tok: Tokenizer, got: list[list[int]], ref: list[list[int]]) -> dict:
    """Per prompt: tokens equal to the reference's before the first difference, and the same in
    characters of the decoded text (both cut at the first stop token)."""
    stops = set(tok.stop_ids())

    def text(t):
        return tok.decode(t[: next((i for i, x in enumerate(t) if x in stops), len(t))])
    first_tok, first_chr = [], []
    for g, r in zip(got, ref):
        first_tok.append(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r))))
        a, b = text(g), text(r)
        first_chr.append(len(a) if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                   min(len(a), len(b))))
    same_text = [text(g) == text(r) for g, r in zip(got, ref)]
    n = len(got)
    return {"all_tokens_equal": sum(t == len(r) for t, r in zip(first_tok, ref)),
            "text_equal": sum(same_text), "left_within_10_chars": sum(c < 10 and not s for c, s in
                                                                     zip(first_chr, same_text)),
            "mean_first_divergence_tokens": sum(first_tok) / n, "first_divergence_tokens": first_tok,
            "first_divergence_chars": first_chr, "texts": [text(g) for g in got]}


def decode_speed(reader, precisions: list, batches: list, reps: int, steps: int = 32,
                 threads: int = 2) -> dict:
    """Decode tok/s per precision: served (the runner's paged decode steps of B rows, each row
    at position 256 onward of its own sequence; the service's kernels without its loop) and
    local (Pool.generate_ids, 64 greedy tokens after a 7-token prompt, its decode_tok_s).
    Precisions alternate inside each repetition, so drift on a shared machine hits them alike.
    -> {precision: {"served": {B: [tok/s per rep]}, "local": [tok/s per rep]}}"""
    from socllm.actors.runner import Runner
    from socllm.actors.service import KV_DTYPE
    out = {p: {"served": {b: [] for b in batches}, "local": []} for p in precisions}
    ctx = 256 + steps + 16
    by_kv: dict = {}
    for p in precisions:
        by_kv.setdefault(KV_DTYPE[p], []).append(p)
    for kv, precs in by_kv.items():
        eng = served_engine(reader, precs[0], ctx, max(batches), threads)
        try:
            runners = {p: Runner(eng, "gpu", p) for p in precs}
            nb = -(-ctx // runners[precs[0]].lay.block_rows)
            tables = {s: list(range(s * nb, (s + 1) * nb)) for s in range(max(batches))}
            for r in runners.values():
                r.warm(max(batches), chunks=())
            for _ in range(reps):
                for p in precs:
                    for b in batches:
                        t0 = time.perf_counter()
                        for i in range(steps):
                            runners[p].step([(100 + s, 256 + i, s) for s in range(b)],
                                            {s: tables[s] for s in range(b)}, all_rows=True)
                        out[p]["served"][b].append(round(b * steps / (time.perf_counter() - t0), 1))
        finally:
            eng.close()
    eng = local_engine(reader, 256, threads)
    try:
        ids = Tokenizer(reader).encode("The capital of France is")
        for p in precisions:                       # install and warm each precision's programs
            eng.generate_ids(ids, plan="gpu", precision=p, max_tokens=4, ignore_eos=True)
        for _ in range(reps):
            for p in precisions:
                r = eng.generate_ids(ids, plan="gpu", precision=p, max_tokens=64, ignore_eos=True)
                out[p]["local"].append(round(r["timings"]["decode_tok_s"], 1))
    finally:
        eng.close()
    return out


def run_engines(a, reader, cfg, ids) -> dict:
    """--runs: each engine's perplexity (and, --greedy, its greedy tokens against llama.cpp's)."""
    from socllm.models.gguf_file import default_model_path
    path = default_model_path()
    tok = Tokenizer(reader)
    pset = GREEDY_SETS[a.greedy_set]
    prompts = prompt_ids(reader, tok, pset) if a.greedy else []
    runs = a.runs.split(",")
    res = {"text": TEXT.name, "tokens": len(ids), "window": a.window, "windows": len(windows(ids, a.window)),
           "model": Path(path).name, "served_rows": a.rows, "runs": {}}
    greedy: dict = {}
    oracle = None
    engines: dict = {}

    def keep(name, scored, t0):
        """scored() -> (NLL, argmax) of the text; not called with --no-ppl"""
        if a.no_ppl:
            res["runs"][name] = {"ppl": None, "seconds": 0.0, "top": None}
            return
        nll, top = scored()
        res["runs"][name] = {"ppl": float(np.exp(nll.mean())), "mean_nll": float(nll.mean()),
                             "scored": int(nll.size), "seconds": round(time.perf_counter() - t0, 1),
                             "top": top}
        print(f"{name:<14} PPL {res['runs'][name]['ppl']:.4f}  ({res['runs'][name]['seconds']} s)",
              flush=True)
    for name in runs:
        t0 = time.perf_counter()
        kind, _, prec = name.partition(":")
        if kind == "oracle":
            oracle = oracle or Oracle(cfg, load_weights(reader, cfg))
            keep(name, lambda: score(oracle, ids, a.window), t0)
            if prompts:
                greedy[name] = [oracle.greedy(p, a.greedy_tokens) for p in prompts]
        elif kind == "llama.cpp":
            import llama_cpp
            res["llama_cpp_version"] = llama_cpp.__version__
            llm = llama_model(path, a.window, a.threads)
            keep(name, lambda: score_windows(lambda w: llama_logits(llm, w), ids, a.window), t0)
            if prompts:
                greedy[name] = [llama_greedy(llm, p, a.greedy_tokens) for p in prompts]
            del llm
        elif kind == "local":
            if "local" not in engines:
                engines["local"] = local_engine(reader, max(a.window, 256), a.threads)
            eng = engines["local"]
            keep(name, lambda: score_windows(local_logits(eng, prec), ids, a.window), t0)
            if prompts:
                greedy[name] = [eng.generate_ids(p, plan="gpu", precision=prec,
                                                 max_tokens=a.greedy_tokens, ignore_eos=True)["tokens"]
                                for p in prompts]
        elif kind == "http":
            keep(name, lambda: http_score(prec, ids, a.window), t0)
        elif kind == "served":
            if a.no_ppl:
                keep(name, None, t0)
            else:
                eng = served_engine(reader, prec, a.window, a.rows, a.threads)
                try:
                    keep(name, lambda: served_score(eng, prec, ids, a.window, a.rows), t0)
                finally:
                    eng.close()
            if prompts:
                greedy[name] = served_greedy(prec, prompts, a.greedy_tokens, 256, a.threads)
        else:
            raise SystemExit(f"unknown engine {name!r}")
        if prompts:
            res["runs"][name]["greedy_seconds"] = round(time.perf_counter() - t0
                                                        - res["runs"][name]["seconds"], 1)
    for e in engines.values():
        e.close()
    base = res["runs"].get("oracle", {}).get("top")
    lc = res["runs"].get("llama.cpp", {}).get("top")
    for r in res["runs"].values():
        top = r.pop("top")
        r["top1_agree_oracle"] = None if base is None or top is None else float((top == base).mean())
        r["top1_agree_llama_cpp"] = None if lc is None or top is None else float((top == lc).mean())
    if res["runs"].get("llama.cpp", {}).get("ppl"):
        lp = res["runs"]["llama.cpp"]["ppl"]
        for r in res["runs"].values():
            r["ppl_vs_llama_cpp"] = r["ppl"] / lp - 1
    if greedy and "llama.cpp" in greedy:
        res["greedy"] = {"tokens": a.greedy_tokens, "prompts": [list(p) for p in pset],
                         "vs_llama_cpp": {n: agreement(tok, g, greedy["llama.cpp"])
                                          for n, g in greedy.items()},
                         "ids": greedy}
    return res


def table(res: dict) -> str:
    lines = [f"{res['text']}: {res['tokens']} tokens in {res['windows']} windows of {res['window']}, "
             f"{res['model']}; served: {res['served_rows']} windows a batch",
             f"{'engine':<14}{'PPL':>9}{'vs llama.cpp':>14}{'top-1 = oracle':>16}{'top-1 = llama.cpp':>19}"]
    for n, r in res["runs"].items():
        f = lambda v, p=".4f": "-" if v is None else format(v, p)
        lines.append(f"{n:<14}{f(r['ppl']):>9}{f(r.get('ppl_vs_llama_cpp'), '+.2%'):>14}"
                     f"{f(r['top1_agree_oracle']):>16}{f(r['top1_agree_llama_cpp']):>19}")
    g = res.get("greedy")
    if g:
        lines += ["", f"greedy, {len(g['prompts'])} prompts x {g['tokens']} tokens, against llama.cpp's:",
                  f"{'engine':<14}{'all equal':>10}{'text equal':>11}{'left <10 chr':>13}"
                  f"{'mean 1st diff':>14}  first differing token per prompt"]
        for n, r in g["vs_llama_cpp"].items():
            lines.append(f"{n:<14}{r['all_tokens_equal']:>10}{r['text_equal']:>11}"
                         f"{r['left_within_10_chars']:>13}{r['mean_first_divergence_tokens']:>14.1f}  "
                         f"{' '.join(map(str, r['first_divergence_tokens']))}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--runs", default=None,
                    help="engines to compare instead of weight variants, e.g. "
                         "oracle,llama.cpp,local:q8,served:q8 (see the module's docstring)")
    ap.add_argument("--rows", type=int, default=2, help="served: windows a decode batch holds")
    ap.add_argument("--greedy", action="store_true", help="with --runs: greedy agreement too")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--no-ppl", action="store_true", help="with --greedy: greedy agreement only")
    ap.add_argument("--greedy-set", type=int, choices=sorted(GREEDY_SETS), default=12,
                    help="--greedy: the 12 fixed prompts, or those and 36 more")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="with --runs / --speed: write OUT.json and OUT.txt")
    ap.add_argument("--speed", default=None, help="instead: decode tok/s of these precisions, "
                    "e.g. q8,q16 (tok/s of each repetition)")
    ap.add_argument("--batches", default="1,2,4,8", help="--speed: served batch sizes")
    ap.add_argument("--reps", type=int, default=3, help="--speed: repetitions")
    a = ap.parse_args(argv)
    reader = open_gguf(default_model_path())
    cfg = load_config(reader)
    ids = Tokenizer(reader).encode(TEXT.read_text())
    if a.speed:
        import platform
        import sys
        precs = a.speed.split(",")
        batches = [int(b) for b in a.batches.split(",")]
        res = {"what": "decode tok/s, 2 cores (PoCL), in process; served: runner steps of B rows; "
                       "local: Pool.generate_ids", "machine": platform.processor() or platform.machine(),
               "reps": a.reps, "speed": decode_speed(reader, precs, batches, a.reps, threads=a.threads),
               "command": "python -m socllm.scripts.perplexity " + " ".join(sys.argv[1:] if argv is None else argv)}
        lines = [res["command"], "", res["what"] + f"; tok/s of each of {a.reps} repetitions",
                 f"{'precision':<10}{'local 1 stream':>22}" +
                 "".join(f"{'served B=' + str(b):>22}" for b in batches)]
        for p, r in res["speed"].items():
            fmt = lambda v: "/".join(f"{x:.0f}" for x in v)
            lines.append(f"{p:<10}{fmt(r['local']):>22}" + "".join(f"{fmt(r['served'][b]):>22}" for b in batches))
        print("\n".join(lines))
        if a.out:
            Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
            Path(a.out + ".txt").write_text("\n".join(lines) + "\n")
        return
    if a.runs:
        import sys
        res = run_engines(a, reader, cfg, ids)
        res["command"] = "python -m socllm.scripts.perplexity " + " ".join(sys.argv[1:] if argv is None else argv)
        txt = table(res)
        print(json.dumps(res, indent=1) if a.json else txt)
        if a.out:
            Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
            Path(a.out + ".txt").write_text(res["command"] + "\n\n" + txt + "\n")
        return
    weights = load_weights(reader, cfg)
    res = {"text": TEXT.name, "tokens": len(ids), "window": a.window, "variants": {}}
    base_top = None
    for kind in a.variants.split(","):
        t0 = time.perf_counter()
        w, mae = variant_weights(weights, kind)
        nll, top = score(Oracle(cfg, w), ids, a.window)
        del w
        base_top = top if base_top is None else base_top
        res["variants"][kind] = {"ppl": float(np.exp(nll.mean())), "mean_nll": float(nll.mean()),
                                 "scored": int(nll.size), "weight_mae_vs_q4_1": mae,
                                 "top1_agree_first": float((top == base_top).mean()),
                                 "seconds": time.perf_counter() - t0}
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['text']}: {res['tokens']} tokens, {a.window}-token windows, numpy fp32 oracle")
    first = next(iter(res["variants"]))
    print(f"{'weights':<14}{'PPL':>9}{'mean NLL':>10}{'top-1 = ' + first:>18}{'|w - q4_1|':>13}")
    for kind, r in res["variants"].items():
        print(f"{kind:<14}{r['ppl']:>9.4f}{r['mean_nll']:>10.5f}{r['top1_agree_first']:>18.4f}"
              f"{r['weight_mae_vs_q4_1']:>13.3e}")


if __name__ == "__main__":
    main()
