"""What NPUMoE's pruning costs in perplexity (issue 29's target: <= +1.1 % against exact routing).

The NPU's grouped expert graphs (actors/npu/experts.py) give each resident expert a static
capacity per prefill chunk (policies/moe.py: tiers from `socllm calibrate`); with overflow "prune"
a chunk's pairs beyond an expert's capacity are dropped, the least salient first (NPUMoE §4.1),
and cold experts run on the CPU in full. This runs the numpy oracle with exactly that dispatch in
every MoE layer (Oracle.moe_assemble -> policies/moe.py dispatch / combine, which the NPU's
grouped graphs run; tests/test_moe_engine.py checks the engine against it) over windows of one
chunk each, and reports perplexity with exact routing and with the plan's pruning, and the
share of routed pairs dropped.

    python -m socllm.scripts.moe_ppl --model F.gguf [--chunk 1024] [--group 8] [--json OUT]

Text: scripts/data/pride_and_prejudice_ch3-6.txt after the tokens `socllm moefy` fitted the
router on (the GGUF's socllm.moe.calibration_tokens; --skip overrides); the capacities come from
the calibration of ch. 1-2 (the default `socllm calibrate` text): out of sample.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from socllm.actors.npu.experts import device_profile
from socllm.models.calibrate import calibrate
from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.tokenizer import Tokenizer
from socllm.policies import moe
from socllm.policies.config import EngineConfig

TEXT = Path(__file__).parent / "data" / "pride_and_prejudice_ch3-6.txt"


def pruning(plan: moe.MoEPlan, overflow: str, tally: dict):
    """Oracle.moe_assemble under the plan: each layer's pairs dispatched as the NPU's grouped
    graphs dispatch them (resident experts at their capacity, cold ones on the fallback)."""
    layout = {lp.layer: (np.asarray(lp.cap), *lp.layout()[:2]) for lp in plan.layers}

    def assemble(i, y, w, sel, sal):
        cap, base, static = layout[i]
        d = moe.dispatch(sel, sal, cap, overflow, base=base, static=static)
        buf = np.zeros((d.rows, y.shape[2]), y.dtype)
        buf[d.row] = y[d.token, d.slot]
        tally["pairs"] += sel.size
        tally["dropped"] += len(d.dropped_token)
        return moe.combine(buf, y[d.fallback_token, d.fallback_slot], np.asarray(w), d)
    return assemble


def nll(logits: np.ndarray, ids: list) -> np.ndarray:
    """-log p of ids[1:] under logits [T, V] of positions 0 .. T-2."""
    z = logits[:-1].astype(np.float64)
    z = z - z.max(1, keepdims=True)
    lse = np.log(np.exp(z).sum(1))
    return lse - z[np.arange(len(ids) - 1), ids[1:]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe_ppl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--chunk", type=int, default=1024, help="tokens a prefill chunk (and a window)")
    p.add_argument("--group", type=int, default=8, help="experts a grouped graph")
    p.add_argument("--skip", type=int, default=None)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args(argv)
    reader = open_gguf(a.model)
    cfg = load_config(reader)
    oracle = Oracle(cfg, load_weights(reader, cfg))
    cache = EngineConfig.from_env().cache_dir
    calib = calibrate(a.model, tokens=a.chunk, chunk=a.chunk, cache_dir=cache)
    profile = device_profile(cache, cfg.dim, cfg.ffn_dim)
    field = reader.fields.get("socllm.moe.calibration_tokens")
    skip = a.skip if a.skip is not None else int(field.parts[-1][0]) if field else 0
    ids = Tokenizer(reader).encode(TEXT.read_text())[skip:]
    wins = [ids[s: s + a.chunk] for s in range(0, len(ids) - a.chunk + 1, a.chunk)][:a.windows]
    if not wins:
        raise SystemExit(f"moe_ppl: the text has {len(ids)} tokens after --skip {skip}: no window of {a.chunk}")
    plans = {"prune": moe.plan(calib, profile, "prune", a.group),
             "prune, every group resident": moe.plan(calib, profile, "prune", a.group, residency=False)}
    out = {"model": Path(a.model).name, "chunk": a.chunk, "group": a.group, "skip": skip,
           "windows": len(wins), "tokens": sum(len(w) - 1 for w in wins),
           "calibration": Path(calib["cache"]["path"] or "").name, "results": {}}
    for name in ("exact", *plans):
        tally = {"pairs": 0, "dropped": 0}
        oracle.moe_assemble = None if name == "exact" else pruning(plans[name], "prune", tally)
        t0 = time.perf_counter()
        scores = np.concatenate([nll(oracle.logits_for(w), w) for w in wins])
        res = {"ppl": float(np.exp(scores.mean())), "seconds": round(time.perf_counter() - t0, 1)}
        if name != "exact":
            res.update(tally, dropped_share=tally["dropped"] / max(1, tally["pairs"]))
            res["vs_exact"] = res["ppl"] / out["results"]["exact"]["ppl"] - 1
            res["resident_experts"] = int(sum(lp.layout()[1].sum() for lp in plans[name].layers))
        out["results"][name] = res
        print(f"{name:28s} PPL {res['ppl']:8.3f}" + (f"  {res['vs_exact']:+.2%} vs exact, "
              f"{res['dropped']} of {res['pairs']} pairs dropped ({res['dropped_share']:.3%})" if name != "exact" else ""), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
