"""`socllm simulate`: socllm's planner, solver and step programs on a simulated SoC, for a model
known by its published shape (models/published.py). Every figure it prints is simulated, beside
the papers' published ones where they exist."""
from __future__ import annotations

import json


def add_parser(sub):
    from socllm.models.published import PUBLISHED
    from socllm.policies.sim.soc import WEIGHTS, soc_names
    s = sub.add_parser("simulate", help="socllm's plans on a simulated phone SoC (HeteroLLM's strategies)")
    s.add_argument("--soc", choices=soc_names(()), default=None,
                   help="default: snapdragon-8gen3 (HeteroLLM's phone); jetson-xavier-nx with --spec")
    s.add_argument("--model", dest="sim_model", choices=sorted(PUBLISHED), default="llama-8b",
                   help="a model by its published configuration (no weights needed)")
    s.add_argument("--prompt-len", type=int, default=None, help="default 256 (--moe: 1,024)")
    s.add_argument("--weights", choices=sorted(WEIGHTS), default=None,
                   help="the weights' storage (default: the SoC's paper's: w4a16 for HeteroLLM's "
                        "phone, w8a16 for Agent.xpu's Core Ultra; q4_1 is socllm's)")
    s.add_argument("--no-fast-sync", action="store_true",
                   help="synchronize through the driver (HeteroLLM §5.4's baseline)")
    s.add_argument("--workload", choices=("agents",), default=None,
                   help="agents: replay an Agent.xpu-style trace (Poisson reactive and proactive "
                        "arrivals) with socllm's policies, fcfs on the GPU against agent")
    s.add_argument("--reactive-rate", type=float, default=3.0, help="requests per minute (--workload)")
    s.add_argument("--proactive-rate", type=float, default=6.0, help="requests per minute (--workload)")
    s.add_argument("--minutes", type=float, default=15.0, help="the trace's length (--workload)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--proactive-words", type=int, default=None,
                   help="median words of a proactive prompt (--workload; default: "
                        "policies/workload.LENGTHS, as scripts/agents.py replays)")
    s.add_argument("--spec", action="store_true",
                   help="speculative decoding (Ghidorah, arXiv 2505.23219): Vicuna-7B's decoding "
                        "speed against the verification width, normalized to sequential decoding, "
                        "for sequential, Medusa (GPU), Medusa+EM (Megatron split) and Ghidorah "
                        "(HCMP + ARCA), on a simulated CPU+GPU SoC")
    s.add_argument("--dataset", default="mt-bench",
                   choices=("mt-bench", "gsm8k", "mbpp", "human-eval", "all"),
                   help="--spec: whose acceptance lengths (Ghidorah Table I); all: one table each")
    s.add_argument("--widths", default="1,2,4,8,16,32,64",
                   help="--spec: verification widths, comma-separated (Table I's powers of two)")
    s.add_argument("--context", type=int, default=256,
                   help="--spec: the KV cache's length (Ghidorah §IV-C: about 256)")
    s.add_argument("--draft-heads", type=int, default=0,
                   help="--spec: Medusa heads whose weights a step also reads (0: the backbone "
                        "only, as Figure 9's Medusa ~ its acceptance length implies)")
    s.add_argument("--moe", action="store_true",
                   help="mixture of experts (NPUMoE): prefill latency of MoE shapes under its "
                        "ablation (base, tiers, tiers+grouping, all) on the simulated SoC's NPU")
    s.add_argument("--moe-model", choices=("phi-3.5-moe", "qwen3-30b-a3b"), default=None,
                   help="--moe: one shape (default: both)")
    s.add_argument("--chunk", type=int, default=256, help="--moe: tokens a prefill chunk")
    s.add_argument("--json", action="store_true")
    s.add_argument("--plot", default=None, metavar="F.png",
                   help="prefill time of each strategy (needs matplotlib: the [bench] extra)")


def run(a) -> int:
    from socllm.models.published import PUBLISHED, shape_weights
    from socllm.policies.buckets import MAX_CHUNK
    from socllm.policies.sim.soc import load_soc
    from socllm.policies.sim.soc_plans import (DECODE, PREFILL, against_published, cut_rows, decode,
                                           planner_for, prefill)
    if a.plot:
        _matplotlib()                    # said before the run, not after its output
    a.prompt_len_given = a.prompt_len is not None
    a.prompt_len = 256 if a.prompt_len is None else a.prompt_len
    if a.spec:
        return _spec(a)
    if a.moe:
        return _moe(a)
    if not 0 < a.prompt_len < 4096:
        raise ValueError(f"--prompt-len must be in [1, 4095], got {a.prompt_len}")
    soc = load_soc(a.soc or "snapdragon-8gen3")
    if not {"gpu", "npu"} <= set(soc.processors):
        raise ValueError(f"{soc.name} has no NPU for HeteroLLM's strategies: simulate it with --spec")
    a.weights = a.weights or soc.weights
    if a.workload:
        return _workload(a, soc)
    fast = not a.no_fast_sync
    planners = {m: planner_for(cfg, shape_weights(cfg), soc, context=4096) for m, cfg in PUBLISHED.items()}
    pl = planners[a.sim_model]
    out = {"soc": soc.name, "title": soc.title, "simulated": True, "source": soc.source,
           "model": a.sim_model, "weights": a.weights, "fast_sync": fast, "prompt_len": a.prompt_len,
           "prefill": [prefill(soc, pl, s, a.prompt_len, fast, a.weights) for s in PREFILL
                       if a.prompt_len <= MAX_CHUNK or s not in ("npu-padding", "online-prepare", "seq-cut", "hybrid")],
           "decode": [decode(soc, pl, s, a.prompt_len, fast, a.weights) for s in DECODE],
           "cuts": {ph: {p: list(v) for p, v in cut_rows(pl, ph).items()} for ph in ("prefill", "decode")},
           "published": against_published(soc, planners, soc.weights) if fast else []}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        _print(out)
    if a.plot:
        _plot(out, a.plot)
    return 0


def _moe(a) -> int:
    """NPUMoE's ablation (policies/sim/moe.py) for --prompt-len tokens (1,024 unless given) in
    chunks of --chunk: every figure simulated, beside the paper's published ratios."""
    from socllm.policies.sim.moe import SHAPES, ablation, table
    from socllm.policies.sim.soc import load_soc
    prompt = a.prompt_len if a.prompt_len_given else 1024
    if not 0 < prompt <= 65536 or not 0 < a.chunk <= prompt:
        raise ValueError(f"--moe takes 0 < --chunk <= --prompt-len <= 65536, got {a.chunk} and {prompt}")
    soc = load_soc(a.soc or "snapdragon-8gen3")
    shapes = [SHAPES[a.moe_model]] if a.moe_model else list(SHAPES.values())
    out = [ablation(soc, m, prompt, a.chunk, fast_sync=not a.no_fast_sync, weights=a.weights,
                    seed=a.seed) for m in shapes]
    print(json.dumps(out, indent=1) if a.json else "\n".join(table(r) for r in out))
    return 0


def _print(out):
    print(f"SIMULATED: {out['title']} ({out['source']}), {out['model']} (published shape), "
          f"{out['weights']} weights, {'fast' if out['fast_sync'] else 'driver'} synchronization")
    print(f"prefill of {out['prompt_len']} tokens:")
    best = min(r["seconds"] for r in out["prefill"])
    for r in out["prefill"]:
        print(f"  {r['strategy']:15s} {r['seconds'] * 1e3:8.1f} ms  {r['tok_s']:8.1f} tok/s  "
              f"{r['steps']} step(s){'  (best)' if r['seconds'] == best else ''}"
              f"{'  = ' + r['chose'] if 'chose' in r else ''}")
    print(f"decode after {out['prompt_len']} tokens:")
    for r in out["decode"]:
        print(f"  {r['strategy']:15s} {r['tok_s']:8.2f} tok/s  {r['bandwidth_gbs']:5.1f} GB/s")
    cuts = out["cuts"]["decode"]
    print("  hetero-tensor's decode cuts (rows on the npu / rows): " +
          ", ".join(f"{p} {r}/{m}" for p, (r, m) in cuts.items()))
    if out["published"]:
        print(f"published ({out['source'].split(',')[0]}) beside simulated (the paper's weights):")
        print(f"  {'what':36s} {'model':14s} {'strategy':14s} {'len':>5s} {'published':>10s} "
              f"{'simulated':>10s} {'ratio':>6s}")
        for r in out["published"]:
            print(f"  {r['what']:36s} {r['model']:14s} {r['strategy']:14s} {r['prompt_len']:5d} "
                  f"{r['published']:10.2f} {r['simulated']:10.2f} {r['ratio']:6.2f}  {r['source']}")


def _matplotlib():
    """matplotlib, or a ValueError that says how to get it (it comes with the bench extra)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or the [bench] "
                         "extra)") from None
    return matplotlib


def _plot(out, path):
    matplotlib = _matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["strategy"] for r in out["prefill"]]
    ax.barh(names, [r["seconds"] * 1e3 for r in out["prefill"]])
    ax.set(xlabel="prefill latency (ms)",
           title=f"SIMULATED {out['title']}: {out['model']}, {out['prompt_len']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _workload(a, soc) -> int:
    import os

    from socllm.models.published import PUBLISHED, shape_weights
    from socllm.policies.sim.soc_plans import planner_for
    from socllm.policies.sim.soc_serving import serve, summary
    from socllm.policies.sim.workload import LENGTHS, trace
    if not (a.minutes > 0 and a.reactive_rate >= 0 and a.proactive_rate >= 0):
        raise ValueError("--minutes must be positive and the rates not negative")
    lengths = {cls: dict(v) for cls, v in LENGTHS.items()}
    if a.proactive_words is not None:
        if not 0 < a.proactive_words <= 1000:
            raise ValueError(f"--proactive-words must be 1 .. 1000, got {a.proactive_words}")
        _, sigma, lo, hi = lengths["proactive"]["words"]
        lengths["proactive"]["words"] = (a.proactive_words, sigma, min(lo, a.proactive_words),
                                         max(hi, 2 * a.proactive_words))
    cfg = PUBLISHED[a.sim_model]
    planner = planner_for(cfg, shape_weights(cfg), soc, context=4096)
    # scripts/agents.py's trace, from the same text; a prompt's tokens ~1.3 a word (no tokenizer:
    # the simulated models' are not here)
    import socllm.scripts
    text = os.path.join(os.path.dirname(os.path.abspath(socllm.scripts.__file__)), "data",
                        "pride_and_prejudice_ch1-2.txt")
    items = [(t, c, n_prompt, n_out) for t, c, _, n_out, n_prompt in
             trace(a.minutes, {"reactive": a.reactive_rate, "proactive": a.proactive_rate}, a.seed,
                   open(text).read().split(), lambda s: round(1.3 * len(s.split())), lengths)]
    runs = {how: summary(serve(soc, planner, items, how, weights=a.weights))
            for how in ("fcfs-gpu", "agent")}
    out = {"soc": soc.name, "title": soc.title, "simulated": True, "model": a.sim_model,
           "weights": a.weights,
           "workload": {"reactive_rate": a.reactive_rate, "proactive_rate": a.proactive_rate,
                        "minutes": a.minutes, "seed": a.seed, "requests": len(items),
                        "lengths": lengths}, "runs": runs}
    base, ours = runs["fcfs-gpu"].get("reactive"), runs["agent"].get("reactive")
    if base and ours:
        out["reactive_mean_reduction"] = 1 - ours["e2e_mean_s"] / base["e2e_mean_s"]
        out["reactive_p90_reduction"] = 1 - ours["e2e_p90_s"] / base["e2e_p90_s"]
        # Agent.xpu §6.2: mean reactive latency against OpenVINO's iGPU continuous batching
        pub = next((e for e in soc.published if e.get("reactive_rate") == a.reactive_rate
                    and e.get("proactive_rate") == a.proactive_rate and e["model"] == a.sim_model
                    and e["what"].startswith("reactive mean latency reduction")), None)
        out["published_reduction"] = pub and pub["value"]
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"SIMULATED: {soc.title}, {a.sim_model}, {len(items)} requests over {a.minutes:g} min "
          f"({a.reactive_rate:g} reactive + {a.proactive_rate:g} proactive per minute)")
    print(f"  {'serving':9s} {'class':9s} {'n':>4s} {'e2e mean s':>10s} {'P90 s':>8s} {'TTFT s':>7s} "
          f"{'pending s':>9s} {'s/token':>8s}")
    for how, res in runs.items():
        for cls, r in res.items():
            print(f"  {how:9s} {cls:9s} {r['requests']:4d} {r['e2e_mean_s']:10.2f} {r['e2e_p90_s']:8.2f} "
                  f"{r['ttft_mean_s']:7.2f} {r['pending_mean_s']:9.2f} {r['normalized_s_per_token']:8.3f}")
    if "reactive_mean_reduction" in out:
        pub = out["published_reduction"]
        print(f"reactive latency, agent against fcfs on the GPU: mean {-100 * out['reactive_mean_reduction']:.0f} %, "
              f"P90 {-100 * out['reactive_p90_reduction']:.0f} %" +
              (f"; Agent.xpu §6.2 published -{100 * pub:.1f} % (mean, against OpenVINO's iGPU, "
               f"on this SoC)" if pub else ""))
    return 0


def _spec(a) -> int:
    """`socllm simulate --spec`: Ghidorah's Figure 9 on a simulated CPU+GPU SoC."""
    from socllm.policies.sim.soc import WEIGHTS, load_soc
    from socllm.policies.sim.speculative import (ACCEPTANCE, VICUNA_7B, against_text,
                                                 published_figure, speculative_curve)
    try:
        widths = [int(w) for w in a.widths.split(",")]
    except ValueError:
        raise ValueError(f"--widths takes comma-separated integers, got {a.widths!r}") from None
    if not widths or any(w not in ACCEPTANCE["mt-bench"] for w in widths):
        raise ValueError(f"--widths are among Table I's {', '.join(map(str, ACCEPTANCE['mt-bench']))}")
    if not 0 <= a.context < 4096:
        raise ValueError(f"--context must be in [0, 4095], got {a.context}")
    if not 0 <= a.draft_heads <= 5:
        raise ValueError(f"--draft-heads must be in [0, 5] (Medusa's Vicuna-7B has 5), got {a.draft_heads}")
    soc = load_soc(a.soc or "jetson-xavier-nx")
    a.weights = a.weights or soc.weights
    wb = WEIGHTS[a.weights]["w4"]
    datasets = list(ACCEPTANCE) if a.dataset == "all" else [a.dataset]
    out = {"soc": soc.name, "title": soc.title, "simulated": True, "source": soc.source,
           "model": VICUNA_7B.name, "model_source": VICUNA_7B.source, "weights": a.weights,
           "weight_bytes": wb, "context": a.context, "draft_heads": a.draft_heads, "datasets": {}}
    for ds in datasets:
        curve = speculative_curve(soc, VICUNA_7B, widths, ACCEPTANCE[ds], a.context, wb, a.draft_heads)
        fig = published_figure(soc, ds)
        for r in curve["rows"]:
            r["paper_figure"] = {m: fig[(m, r["width"])] for m in ("medusa", "medusa+em", "ghidorah")
                                 if (m, r["width"]) in fig}
        curve["paper_text"] = against_text(soc, curve, ds)
        out["datasets"][ds] = curve
    if a.plot:
        _plot_spec(out, a.plot)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"SIMULATED: {out['title']} ({out['source']})")
    print(f"Vicuna-7B (published shape: {VICUNA_7B.source}), {a.weights} weights "
          f"({wb:g} B a weight), KV cache {a.context} tokens, "
          f"{a.draft_heads or 'no'} Medusa head weights read a step")
    for ds, c in out["datasets"].items():
        seq = c["sequential_s"]
        print(f"\n{ds} (acceptance: Ghidorah Table I): decoding speed normalized to sequential "
              f"(W=1 on the GPU alone: {seq * 1e3:.0f} ms a step, {1 / seq:.2f} tok/s)")
        print(f"  {'W':>3s} {'accept':>6s} | {'step ms: gpu':>12s} {'cpu':>6s} {'em':>6s} {'hcmp':>6s} | "
              f"{'cpu share: em':>13s} {'hcmp':>5s} | {'seq':>4s} {'medusa':>6s} {'+em':>5s} {'ghidorah':>8s} "
              f"{'cpu*':>5s} | paper Fig. 9 (~): medusa +em ghidorah")
        for r in c["rows"]:
            st, sh, n, p = r["step_s"], r["cpu_share"], r["normalized"], r["paper_figure"]
            paper = " ".join(f"{p[m]:.1f}" if m in p else "-" for m in ("medusa", "medusa+em", "ghidorah"))
            print(f"  {r['width']:3d} {r['acceptance']:6.2f} | {st['gpu'] * 1e3:12.0f} {st['cpu'] * 1e3:6.0f} "
                  f"{st['medusa+em'] * 1e3:6.0f} {st['ghidorah'] * 1e3:6.0f} | {sh['medusa+em']:13.2f} "
                  f"{sh['ghidorah']:5.2f} | {n['sequential']:4.2f} {n['medusa']:6.2f} {n['medusa+em']:5.2f} "
                  f"{n['ghidorah']:8.2f} {r['normalized_cpu_alone']:5.2f} | {paper}")
        print(f"  ARCA's width (Ghidorah's fastest): {c['best_width']}. cpu*: Medusa's tree on the CPU "
              "alone (not a method of the paper). paper Fig. 9: the bars as the paper text's image "
              "description reads them (approximate)")
        for t in c["paper_text"]:
            print(f"  paper text: {t['what']} ({t['method']}) {t['published']:g}, simulated "
                  f"{t['simulated']:.3g} (x{t['ratio']:.2f})"
                  f"{' [the profile is calibrated to this one]' if t['calibrated'] else ''} -- {t['source']}")
    return 0


def _plot_spec(out, path):
    """Figure 9's layout: per width, a bar a method (simulated), the paper's bars as dots."""
    matplotlib = _matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = ("sequential", "medusa", "medusa+em", "ghidorah")
    sets = list(out["datasets"].items())
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.4), squeeze=False)
    for ax, (ds, c) in zip(axes[0], sets):
        rows = c["rows"]
        for i, m in enumerate(methods):
            xs = [j + (i - 1.5) * 0.2 for j in range(len(rows))]
            ax.bar(xs, [r["normalized"][m] for r in rows], 0.2, label=m)
            pts = [(x, r["paper_figure"][m]) for x, r in zip(xs, rows) if m in r["paper_figure"]]
            if pts:
                ax.plot(*zip(*pts), "k.", label="paper (Fig. 9, ~)" if i == 3 else None)
        ax.set_xticks(range(len(rows)), [str(r["width"]) for r in rows])
        ax.set(xlabel="verification width", ylabel="normalized decoding speed", title=ds)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{out['title']}\nVicuna-7B, KV cache {out['context']}, Ghidorah Table I acceptance",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
