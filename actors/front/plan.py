"""`socllm plan`: what the solver chooses for one step, op by op, from a device's profile: this
machine's (scripts/profile_ops.py, through the prediction mode of policies/sim/predict.py) or a
simulated SoC's (policies/sim/soc.py)."""
from __future__ import annotations

import json
import os


def add_parser(sub):
    from socllm.policies.sim.soc import soc_names
    p = sub.add_parser("plan", help="the solver's choice for a step, op by op, with predicted times")
    p.add_argument("--prompt-len", type=int, default=None, help="the step's tokens (required "
                   "but with --spec)")
    p.add_argument("--phase", choices=("prefill", "decode"), default="prefill")
    p.add_argument("--soc", choices=soc_names(), default=None,
                   help="a simulated SoC instead of this machine (its profile from the papers)")
    p.add_argument("--model", dest="plan_model", default=None,
                   help="with --soc: a published model (default llama-8b); else a GGUF file "
                        "(default: the default model)")
    p.add_argument("--profile", default=None, help="this machine's op profile (default: "
                   "~/.cache/socllm/op-profile.json, from python -m socllm.scripts.profile_ops; "
                   "measured there first, ~10 s, when it is absent)")
    p.add_argument("--spec", action="store_true",
                   help="speculative decoding's width instead (Ghidorah's ARCA): this machine's "
                        "decode step time by rows, measured now, and the drafts per step that "
                        "maximise tokens/s at a few acceptance rates")
    p.add_argument("--precision", default=None, help="with --spec: the decode steps' (default: "
                   "the service's default)")
    p.add_argument("--json", action="store_true")


def _profile_now(path: str) -> float:
    """Measure this machine's op profile into `path` (scripts/profile_ops.py, its default grid),
    its progress on stderr (stdout stays the plan's); returns the seconds it took."""
    import contextlib
    import sys
    import time

    from socllm.scripts.profile_ops import main as profile_ops
    print(f"socllm: no op profile at {path}: measuring this machine's now (every op of a layer "
          "on the GPU and the NPU over 8 row counts; ~10 s, once)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        profile_ops(["--out", path])
    took = time.perf_counter() - t0
    print(f"socllm: profiled in {took:.1f} s", file=sys.stderr, flush=True)
    return took


def spec(a) -> int:
    """`socllm plan --spec`: the step cost of 1 .. 16 rows of one sequence on this machine's
    serving plan (the GPU's kernels), and what policies/drafting.choose makes of it."""
    import sys

    from socllm.policies.config import DEFAULT_PRECISION, SERVE_PRECISIONS
    from socllm.policies.drafting import MAX_DRAFT, choose, expected
    from socllm.actors.pool import Pool
    precision = a.precision or DEFAULT_PRECISION
    if precision not in SERVE_PRECISIONS:         # before the progress line: one line, exit 2
        raise ValueError(f"unknown precision {precision!r} (choose from {', '.join(SERVE_PRECISIONS)})")
    rows = MAX_DRAFT + 1
    print(f"socllm: timing decode steps of 1 .. {rows} rows ({precision}), ~20 s", file=sys.stderr,
          flush=True)
    from socllm.models.gguf_file import model_path, open_gguf
    from socllm.models.llama import read_config
    # 256 positions, or all a smaller model has (a fixed 256 refused those: context must be in ...)
    context = min(256, read_config(open_gguf(model_path(a.plan_model))).context_length)
    with Pool(processors_=("gpu",), model=a.plan_model, max_seqs=rows, context=context) as eng:
        run = eng.runner("gpu", precision)
        run.warm(rows, chunks=())
        prof = run.profile_batches(rows, reps=5)
        device = next((d.get("device") for d in eng.info() if d["processor"] == "gpu"), "gpu")
    cost = [0.0] + [prof[n] for n in range(1, rows + 1)]
    rates = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
    best = {}
    for r in rates:
        k = choose(cost, [r], [MAX_DRAFT], rows)[0]
        best[r] = {"drafts": k, "tokens_per_step": round(expected(r, k), 3),
                   "speedup": round(expected(r, k) / cost[1 + k] * cost[1], 3)}
    # step_ms unrounded: choose's margin test on a rounded curve could pick another count
    out = {"device": device, "precision": precision,
           "step_ms": {n: 1e3 * cost[n] for n in range(1, rows + 1)},
           "best_by_acceptance": best, "trees": _trees(cost, rates, _heads_count(a.plan_model))}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"decode step of one sequence by rows (last token + drafts), {device}, {precision}:")
    print("rows " + " ".join(f"{n:6d}" for n in range(1, rows + 1)))
    print("ms   " + " ".join(f"{1e3 * cost[n]:6.2f}" for n in range(1, rows + 1)))
    print("x1   " + " ".join(f"{cost[n] / cost[1]:6.2f}" for n in range(1, rows + 1)))
    print("acceptance rate -> drafts a step, expected tokens a step, speed-up over plain decoding:")
    for r, b in best.items():
        print(f"  {r:.2f} -> {b['drafts']:2d} drafts, {b['tokens_per_step']:.2f} tokens, {b['speedup']:.2f}x")
    t = out["trees"]
    print(f"draft trees of {t['heads']} heads' two candidates (the second accepted at "
          f"{t['second_rate']:.2f}): the first's rate -> nodes a step, expected tokens, speed-up:")
    for r, b in t["best_by_acceptance"].items():
        print(f"  {r:.2f} -> {b['nodes']:2d} nodes, {b['tokens_per_step']:.2f} tokens, {b['speedup']:.2f}x")
    return 0


def _heads_count(model) -> int:
    """The draft heads trained for this model (models/heads/), else the default model's 3."""
    import numpy as np

    from socllm.models.gguf_file import model_path
    from socllm.models.heads import heads_path
    try:
        return int(json.loads(bytes(np.load(heads_path(model_path(model)))["meta"]).decode())["heads"])
    except (OSError, KeyError, ValueError):
        return 3


def _trees(cost: list, rates: tuple, heads: int) -> dict:
    """At each rank-0 acceptance rate, the tree policies/drafting.py would verify on this cost
    curve: its nodes best first (tree_candidates) while choose_rows says they pay."""
    import numpy as np

    from socllm.policies.drafting import MAX_DRAFT, SIDE_PRIOR, choose_rows, tree_candidates
    best = {}
    for r in rates:
        chances = tree_candidates(np.zeros((heads, 2), np.int64), [r, SIDE_PRIOR], heads, MAX_DRAFT)[3]
        [k] = choose_rows(cost, [chances], len(cost) - 1)
        tokens = 1 + sum(chances[:k])
        best[r] = {"nodes": k, "tokens_per_step": round(tokens, 3),
                   "speedup": round(tokens / cost[1 + k] * cost[1], 3)}
    return {"heads": heads, "second_rate": SIDE_PRIOR, "best_by_acceptance": best}


def run(a) -> int:
    if a.spec:
        return spec(a)
    if a.prompt_len is None:
        raise ValueError("--prompt-len is required (but with --spec)")
    from socllm.graph.program import StepProgram
    from socllm.policies.buckets import MAX_CHUNK
    from socllm.policies.sim.plan_report import plan_step
    from socllm.policies.sim.soc_plans import planner_for
    if not 0 < a.prompt_len <= (MAX_CHUNK if a.phase == "prefill" else 4095):
        raise ValueError(f"--prompt-len must be in [1, {MAX_CHUNK}] for one prefill step "
                         f"(4095 for decode), got {a.prompt_len}")
    if a.soc:
        from socllm.models.published import PUBLISHED, shape_weights
        from socllm.policies.sim.soc import WEIGHTS, load_soc, task_time
        name = a.plan_model or "llama-8b"
        if name not in PUBLISHED:
            raise ValueError(f"--model with --soc is one of {', '.join(sorted(PUBLISHED))}")
        cfg, soc = PUBLISHED[name], load_soc(a.soc)
        weights = shape_weights(cfg)

        def cost(p, op, args, n, pos0):
            proc = soc.processors[p]
            c, b = task_time(proc, op, args, n, pos0, WEIGHTS["w4a16"])
            return max(c, b / proc.bandwidth) + proc.kernel_s
        device, sync_s, source = f"SIMULATED {soc.title}", soc.sync_s, soc.source
        # memory-bound decode shares the SoC's bandwidth; compute-bound prefill hardly contends
        # (Agent.xpu §3.1, Figure 3)
        gpu, npu = soc.processors["gpu"], soc.processors["npu"]
        contention = max(1.0, (gpu.bandwidth + npu.bandwidth) / soc.bandwidth_total) \
            if a.phase == "decode" else 1.0
    else:
        from socllm.models.gguf_file import model_path, open_gguf
        from socllm.models.llama import load_config, load_weights
        import os

        from socllm.policies.sim.predict import PROFILE_PATH, load_predictor
        path, measured_s = a.profile or PROFILE_PATH, None
        if a.profile is None and not os.path.exists(path):     # a first run: measure it now
            measured_s = _profile_now(path)
        pred = load_predictor(path)
        reader = open_gguf(model_path(a.plan_model))
        cfg = load_config(reader)
        weights, name = load_weights(reader, cfg), reader.path if hasattr(reader, "path") else "model"
        cost, sync_s, contention = pred.seconds, pred.sync_s, pred.contention
        device = f"this machine: gpu {pred.device.get('gpu', '?')}, npu {pred.device.get('npu', '?')}"
        source = (f"this machine's op profile {path}, "
                  + (f"measured now in {measured_s:.1f} s, " if measured_s is not None else "")
                  + "prediction mode")
    planner = planner_for(cfg, weights, context=max(2048, a.prompt_len + 1))
    bucket = a.prompt_len if a.phase == "prefill" else 1
    tasks = StepProgram.from_bytes(planner.program("gpu", a.phase, bucket)[1]).tasks["gpu"]
    profile = None if a.soc else {"path": path, "measured_now_s": measured_s}
    try:
        step = plan_step(cost, tasks, a.phase, a.prompt_len, sync_s, contention)
    except KeyError as e:             # an op the profile (the default model's ops) never timed
        raise ValueError(f"{e.args[0]}: {path} times the default model's ops only, and this "
                         f"model needs others") from None
    out = {"device": device, "simulated": bool(a.soc), "source": source, "profile": profile,
           **step,
           "auto_plans": {} if a.soc else _auto_plans(),
           "moe": _moe(tasks, a.prompt_len, a.plan_model) if cfg.n_experts and not a.soc else None}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['device']} ({out['source']})")
    print(f"contention of two processors at once {out['contention']:.2f}x, a synchronization "
          f"{out['sync_s'] * 1e6:.0f} us")
    print(f"{a.phase} of {a.prompt_len} tokens: the solver keeps {out['strategy']!r}, predicted "
          f"{out['predicted_total_s'] * 1e3:.2f} ms; " + ", ".join(
              f"{k} {v * 1e3:.2f}" for k, v in out["alternatives_total_s"].items()))
    print(f"{'op':10s} {'layer':>5s} {'strategy':9s} {'parts':32s} {'predicted us':>12s}  alternatives (us)")
    for e in out["ops"]:
        if e["layer"] > 0:
            continue
        parts = " ".join(p["processor"] + (f"{p['rows']}" if "rows" in p else f"{p['seq']}" if "seq" in p else "")
                         for p in e["parts"])
        alts = " ".join(f"{k} {v * 1e6:.0f}" for k, v in e["alternatives"].items())
        print(f"{e['op']:10s} {e['layer']:5d} {e['strategy']:9s} {parts:32s} {e['predicted_s'] * 1e6:12.1f}  {alts}")
    print("(layers 1.. as layer 0; --json lists every op)")
    if out["moe"]:
        m = out["moe"]
        print(f"MoE prefill chunks of {a.prompt_len} on the NPU: {m['graphs']} expert graphs, overflow "
              f"{m['overflow']}, from the {m['source']}")
        for lp in m["layers"][:3]:
            groups = "; ".join(f"{g['processor']} C={g['capacity']} experts {g['experts']}"
                               for g in lp["groups"])
            print(f"  layer {lp['layer']}: tiers {lp['tiers']}, rho {lp['rho']:.2f}: {groups}")
        print(f"  ({m['npu_groups']} groups resident on the NPU, {m['cpu_groups']} on the CPU over "
              f"{len(m['layers'])} layers; --json lists every layer)")
    for key, v in out["auto_plans"].items():
        model, machine, _, precision, chunk, context, seqs = key.split("|")[:7]
        timed = ", ".join(f"{k} {ms:.0f} ms" for k, ms in v["chunk_ms"].items())
        print(f"serve --plan auto chose {v['plan']} for {os.path.basename(model.split(':')[0])} on "
              f"{machine.replace(' []', '')} at {precision}, --context {context} --max-seqs {seqs} "
              f"(a whole chunk of {chunk} rows: {timed})")
    return 0


def _moe(tasks: list, chunk: int, model: str | None) -> dict:
    """The NPU's MoE layout for prefill chunks of `chunk` rows (actors/npu/experts.py moe_plan:
    NPUMoE's tiers, groups and residency from the model's cached calibration)."""
    import dataclasses

    from socllm.policies.config import EngineConfig
    from socllm.actors.npu.experts import moe_plan
    config = EngineConfig.from_env()
    p, source = moe_plan(dataclasses.replace(config, model=model), tasks, chunk)
    groups = [g for lp in p.layers for g in lp.groups]
    return {"graphs": config.moe_graphs, "overflow": p.overflow, "source": source,
            "npu_groups": sum(g.processor == "npu" for g in groups),
            "cpu_groups": sum(g.processor != "npu" for g in groups),
            "layers": [dataclasses.asdict(lp) for lp in p.layers]}


def _auto_plans() -> dict:
    """What `socllm serve --plan auto` timed and chose at earlier starts on this machine, with
    today's kernels (policies/plan_cache.py): model and processors -> plan and chunk times. (The
    table keeps other timings too: step profiles, hcmp's bands.)"""
    from socllm.policies.config import EngineConfig
    from socllm.policies.plan_cache import kernels, plan_cache
    now = kernels()
    return {k: v for k, v in plan_cache(EngineConfig.from_env().cache_dir).items()
            if "chunk_ms" in v and k.count("|") >= 7 and k.endswith(now)}
