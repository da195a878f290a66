"""`socllm calibrate MODEL`: an MoE GGUF's routing on calibration text through the numpy oracle
(models/calibrate.py), cached per model; a per-layer table of imbalance, hot experts, saliency and
Overlap@K on held-out text, and with --plan the capacity tiers, groups and residency that
policies/moe.py derives from it."""
from __future__ import annotations

import json


def add_parser(sub):
    from socllm.policies.moe import GROUP_SIZES, OVERFLOW, ROW_MULTIPLE
    c = sub.add_parser("calibrate", help="an MoE model's expert load on calibration text "
                       "(NPUMoE's offline calibration), cached per model")
    c.add_argument("model", metavar="MODEL", help="a mixture-of-experts GGUF")
    c.add_argument("--tokens", type=int, default=1024,
                   help="calibration tokens; as many after them are held out (default %(default)s)")
    c.add_argument("--chunk", type=int, default=128,
                   help="T: tokens a prefill chunk, the unit expert loads are counted in "
                        "(default %(default)s)")
    c.add_argument("--text", default=None, metavar="FILE",
                   help="the calibration text (default: scripts/data/pride_and_prejudice_ch1-2.txt)")
    c.add_argument("--skip", type=int, default=0,
                   help="leave out the text's first SKIP tokens (those a router was fitted on)")
    c.add_argument("--refresh", action="store_true", help="calibrate again, ignoring the cache")
    c.add_argument("--plan", action="store_true",
                   help="also the tiers, groups and residency policies/moe.py derives, with their "
                        "padding and pruned shares on the held-out text")
    c.add_argument("--profile", default=None, metavar="F.json",
                   help="--plan: a device profile (launch_ms and ms_per_row per processor, npu_mb, "
                        "graph_mb, max_graphs); default: policies/moe.EXAMPLE_PROFILE")
    c.add_argument("--overflow", choices=OVERFLOW, default="prune", help="--plan (default %(default)s)")
    c.add_argument("--group-size", type=int, choices=(1, *GROUP_SIZES), default=8,
                   help="--plan: experts a graph (default %(default)s)")
    c.add_argument("--row", type=int, default=ROW_MULTIPLE,
                   help="--plan: capacities round up to this many rows (default %(default)s)")
    c.add_argument("--json", action="store_true")


def run(a) -> int:
    import os
    from socllm.models.calibrate import calibrate
    from socllm.policies.config import EngineConfig
    if not os.path.isfile(a.model):
        raise ValueError(f"model file not found: {a.model}")
    if a.row < 1:
        raise ValueError(f"--row must be positive, got {a.row}")
    r = calibrate(a.model, a.tokens, a.chunk, EngineConfig.from_env().cache_dir, a.text, a.skip,
                  a.refresh)
    p = _plan(a, r) if a.plan else None
    if a.json:
        out = {k: v for k, v in r.items() if k not in ("counts", "heldout_counts")}
        if p:
            out["plan"], out["effects"] = json.loads(p[0].to_json()), p[1]
        print(json.dumps(out, indent=1))
        return 0
    print(table(r))
    if p:
        print(plan_table(*p))
    return 0


def _plan(a, r):
    from socllm.policies.moe import EXAMPLE_PROFILE, effects, plan
    profile = EXAMPLE_PROFILE
    if a.profile:
        try:
            profile = {**EXAMPLE_PROFILE, **json.load(open(a.profile))}
        except (OSError, ValueError) as e:
            raise ValueError(f"--profile {a.profile}: {e}") from None
    p = plan(r, profile, a.overflow, a.group_size, a.row)
    return p, effects(p, r["heldout_counts"])


def table(r: dict) -> str:
    ks = list(r["overlap_median"])
    c, h = r["calibration"], r["heldout"]
    lines = [f"{r['model']} (sha256 {r['gguf_sha256'][:12]}): {r['n_layers']} layers, "
             f"{r['n_experts']} experts, top-{r['top_k']}; chunks of {r['chunk']} tokens",
             f"calibration tokens {c['first_token']}..{c['first_token'] + c['tokens'] - 1} "
             f"({c['chunks']} chunks), held out {h['first_token']}..{h['first_token'] + h['tokens'] - 1} "
             f"({h['chunks']} chunks) of {r['text']['file']}",
             f"{'layer':>5} {'rho':>5} {'rho95':>5}  {'hot experts (share)':<34} {'p95 max':>7} "
             f"{'sal p50':>7} {'p95':>6}" + "".join(f" {'ov@' + k:>6}" for k in ks)]
    for x in r["layers"]:
        pop = x["popularity"]
        hot = sorted(range(len(pop)), key=lambda e: -pop[e])[:4]
        s = x["saliency"]
        lines.append(f"{x['layer']:5d} {x['rho']:5.2f} {x['rho_p95']:5.2f}  "
                     f"{' '.join(f'{e}:{pop[e]:.2f}' for e in hot):<34} {max(x['p95']):7.1f} "
                     f"{s['p50']:7.3f} {s['p95']:6.3f}" + "".join(f" {x['overlap'][k]:6.2f}" for k in ks))
    lines.append(f"{'median':>5} {'':>5} {'':>5}  {'':<34} {'':>7} {'':>7} {'':>6}"
                 + "".join(f" {r['overlap_median'][k]:6.2f}" for k in ks))
    lines.append(f"{'mean':>5} {'':>5} {'':>5}  {'':<34} {'':>7} {'':>7} {'':>6}"
                 + "".join(f" {r['overlap_mean'][k]:6.2f}" for k in ks))
    cache = r["cache"]
    lines.append(f"cache: {cache['path']} ({'reused' if cache['hit'] else 'written'})")
    return "\n".join(lines)


def plan_table(p, eff: dict) -> str:
    lines = [f"plan: overflow {p.overflow}, groups of {p.group_size}, rows a multiple of "
             f"{p.row_multiple}, an expert {p.expert_mb} MB",
             f"{'layer':>5} {'tiers':<22} {'groups (capacity: experts) npu* / fallback':<60}"]
    for lp in p.layers:
        gs = " ".join(f"{g.capacity}:{','.join(map(str, g.experts))}{'*' if g.processor == 'npu' else ''}"
                      for g in lp.groups)
        lines.append(f"{lp.layer:5d} {str(lp.tiers):<22} {gs}")
    lines.append(f"held out: padding {eff['padding']:.1%} of static rows, pruned {eff['pruned']:.1%}, "
                 f"spilled {eff['spilled']:.1%}, on the fallback {eff['fallback']:.1%} of routed "
                 f"pairs; {eff['npu_calls_per_chunk']} NPU calls a chunk")
    return "\n".join(lines)
