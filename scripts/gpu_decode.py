"""socllm's GPU kernels on one OpenCL device, in this process (no Ray): a prompt's greedy tokens,
and prefill and decode tokens per second, on a unified device or a discrete GPU.

    python -m socllm.scripts.gpu_decode [--model FILE] [--prompt-len 128] [--decode 64]
                                        [--precision q16] [--reps 3] [--check 16] [--json F]
                                        [--prompt TEXT]

It lays the pool out as the engine does (profile_decode.pool) and runs the gpu plan's programs:
the prompt as one prefill step, then one decode step a token (the fused decode kernels, in the
device's work shapes; SOCLLM_FUSE=0: op by op). On a discrete GPU
(OpenCL device memory apart from the host's) the pool's bytes are copied into device memory once;
then each step copies only its token ids (and rows' metadata) up and its logits down (GPUBackend):
weights, activations and the KV cache stay on the device. --check N: the first N greedy tokens
against the numpy oracle's (use --precision f32 for equality), and each of those N steps' logits
against the oracle's fed the same tokens (the GPU's own greedy ones): the largest |difference| over
the largest |oracle logit|, and at how many steps the oracle's top token is the GPU's. --prompt:
that text (BOS added as the model asks) instead of the first --prompt-len tokens of a public-domain
text.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def setup(model: str | None, context: int, precision: str):
    """-> (arena, layout, cfg, tokenizer, weights, backend, {phase: units}) for the gpu plan."""
    from socllm.actors.gpu.backend import GPUBackend
    from socllm.graph.program import StepProgram
    from socllm.models.tokenizer import Tokenizer
    from socllm.policies.buckets import MAX_CHUNK
    from socllm.policies.config import EngineConfig
    from .profile_decode import pool
    arena, lay, planner, reader, cfg, weights = pool(model, context)
    config = EngineConfig.from_env()           # SOCLLM_FUSE=0: op by op
    gpu = GPUBackend(arena.buf, lay, config.budget, config=config)
    units = {}
    for phase, bucket in (("prefill", MAX_CHUNK), ("decode", 1)):
        prog = StepProgram.from_bytes(planner.program("gpu", phase, bucket)[1])
        units[phase] = gpu.build_units(prog, precision if phase == "decode" else "f32")
    return arena, lay, cfg, Tokenizer(reader), weights, gpu, units


def step(arena, lay, gpu, units, ids: list, pos0: int, precision: str) -> np.ndarray:
    """One step over len(ids) rows at pos0 (a discrete GPU: the backend copies the ids up in
    begin_step and the logits down in finish), -> the last row's logits."""
    buf = arena.buf
    lo = lay.io["ids"]
    buf[lo: lo + 4 * len(ids)].view(np.int32)[:] = ids
    gpu.begin_step(precision, pos0)
    for u in units:
        u.run(len(ids), pos0)
    gpu.finish()
    out = lay.io["logits"]
    return buf[out: out + 4 * lay.vocab].view(np.float32)


def generate(arena, lay, gpu, units, prompt: list, n: int, precision: str):
    """-> (greedy tokens, prefill seconds, decode seconds per token list)"""
    t0 = time.perf_counter()
    logits = step(arena, lay, gpu, units["prefill"], prompt, 0, precision)
    prefill_s = time.perf_counter() - t0
    out, times = [int(np.argmax(logits))], []
    for i in range(n - 1):
        t0 = time.perf_counter()
        logits = step(arena, lay, gpu, units["decode"], out[-1:], len(prompt) + i, precision)
        times.append(time.perf_counter() - t0)
        out.append(int(np.argmax(logits)))
    return out, prefill_s, times


def greedy_logits(arena, lay, gpu, units, prompt: list, n: int, precision: str):
    """-> (n greedy tokens, their n steps' logits [n, vocab]): the step that chose token i gave row i."""
    logits = [step(arena, lay, gpu, units["prefill"], prompt, 0, precision).copy()]
    out = [int(np.argmax(logits[-1]))]
    for i in range(n - 1):
        logits.append(step(arena, lay, gpu, units["decode"], out[-1:], len(prompt) + i, precision).copy())
        out.append(int(np.argmax(logits[-1])))
    return out, np.array(logits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF, or gemma3-270m (default: the default model)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--precision", default="q16", choices=("f32", "q16", "q8"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", type=int, default=0, help="compare N greedy tokens with the oracle's")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--prompt", help="the prompt's text (default: a public-domain text's first --prompt-len tokens)")
    a = ap.parse_args(argv)
    from socllm.scripts.llamacpp_fixtures import texts
    arena, lay, cfg, tok, weights, gpu, units = setup(a.model, a.prompt_len + max(a.decode, a.check) + 8,
                                                      a.precision)
    try:
        text = a.prompt if a.prompt is not None else texts()["public-domain text"]
        prompt = tok.encode(text, bos=tok.add_bos)[:a.prompt_len]
        runs = [generate(arena, lay, gpu, units, prompt, a.decode, a.precision) for _ in range(a.reps + 1)][1:]
        d = gpu.describe()
        report = {"device": d["device"], "platform": d["platform"], "discrete": bool(gpu.kernels.copies),
                  "model": cfg.arch, "precision": a.precision, "prompt_len": len(prompt),
                  "decode": a.decode, "tokens": runs[0][0],
                  "prefill_tok_s": [len(prompt) / p for _, p, _ in runs],
                  "decode_tok_s": [len(t) / sum(t) for _, _, t in runs],
                  "decode_step_ms_median": statistics.median([x for _, _, t in runs for x in t]) * 1e3}
        if a.check:
            from socllm.models.oracle import Oracle
            oracle = Oracle(cfg, weights)
            want = oracle.greedy(prompt, a.check)
            got, logits = greedy_logits(arena, lay, gpu, units, prompt, a.check, a.precision)
            ref = oracle.logits_for(prompt + got[:-1])[len(prompt) - 1:]   # fed the GPU's tokens
            err = np.abs(logits - ref).max(axis=1) / np.abs(ref).max(axis=1)
            report["oracle_equal"] = got == want
            report["oracle_tokens_equal"] = sum(x == y for x, y in zip(got, want))
            report["oracle_first_difference"] = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
            report["oracle_top1_agree"] = int((ref.argmax(axis=1) == np.array(got)).sum())
            report["logit_rel_err_max"] = float(err.max())
            report["logit_rel_err_median"] = float(np.median(err))
            report["logit_rel_err_steps"] = [float(e) for e in err]
            report["check_tokens"] = got
            report["oracle_tokens"] = want
        print(json.dumps({k: v for k, v in report.items()
                          if k not in ("tokens", "oracle_tokens", "check_tokens", "logit_rel_err_steps")}, indent=1))
        print("text:", repr(tok.decode(runs[0][0])))
        if a.check:
            print("prompt:", repr(text[:200]), "check text:", repr(tok.decode(report["check_tokens"])),
                  "oracle text:", repr(tok.decode(report["oracle_tokens"])))
        med = statistics.median
        print(f"gpu_decode {cfg.arch} {a.precision} on {d['device']} ({'discrete' if report['discrete'] else 'unified'}): "
              f"prefill {med(report['prefill_tok_s']):.1f} tok/s, decode {med(report['decode_tok_s']):.1f} tok/s"
              + (f", oracle's {a.check} tokens: {'equal' if report['oracle_equal'] else 'DIFFERENT'}"
                 f" ({report['oracle_tokens_equal']}/{a.check}; top-1 on the same tokens {report['oracle_top1_agree']}/{a.check};"
                 f" logits max |err|/max|logit| {report['logit_rel_err_max']:.2e})" if a.check else ""))
        if a.json_path:
            with open(a.json_path, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        arena.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
