"""`socllm bench`: socllm's plans against llama.cpp and OpenVINO GenAI, side by side, on the same
GGUF, the same prompt ids and the same thread budget, alternating so that machine noise falls on
all alike. Reports min/median/max over repetitions, TTFT, tokens/s, memory, and whether each
engine's first greedy tokens equal the numpy oracle's.

    socllm bench [--model F.gguf] [--prompts 32,128,512,1024] [--decode 128] [--reps 3]
                 [--plans gpu,hetero/q8] [--peers llama.cpp,openvino-genai] [--json FILE] [--plot FILE.png]

A plan is a serving plan (policies/placement.py SERVE_PLANS: cpu, gpu, npu, hetero, tensor, seqcut,
hybrid), run one request at a time through Pool.generate_ids on the service's paged programs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

from socllm.actors.metrics import pss_mb

from .peers import PEERS, PeerMissing, PeerProcess

CHECK_TOKENS = 8


def prompt_ids(tokenizer, n: int, variant: int = 0) -> list:
    """n ids of a fixed text (socllm's own source files, concatenated; the same for every
    engine), starting `variant` * 997 tokens in. Each (length, repetition) gets its own variant:
    OpenVINO GenAI caches prompt prefixes across calls (measured: the same 512-token prompt again
    "prefills" at ~36,000 tok/s), so prompts that are prefixes of each other would flatter it."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(here, "*.py"))))
    ids = tokenizer.encode(text)
    start = variant * 997
    while len(ids) < start + n:
        ids += ids
    return ids[start:start + n]


class Socllm:
    """A serving plan, optionally with a precision: "gpu" (the default precision), "gpu/q8"."""

    def __init__(self, engine, spec: str):
        from socllm.policies.config import DEFAULT_PRECISION
        self.plan, _, self.precision = spec.partition("/")
        self.engine = engine
        self.name = f"socllm:{self.plan}/{self.precision or DEFAULT_PRECISION}"

    def run(self, ids, n_decode):
        out = self.engine.generate_ids(ids, plan=self.plan, precision=self.precision or None,
                                       max_tokens=n_decode, ignore_eos=True)
        return {**out["timings"], "tokens": out["tokens"], "placement": out.get("placement")}


def kv_dtype_for(plans: list) -> str:
    """The KV cache's elements the service keeps at the plans' precisions (actors/service.py
    KV_DTYPE: f16 at q16 and q8), f32 where one plan runs at f32 (the oracle's path)."""
    from socllm.actors.service import KV_DTYPE
    from socllm.policies.config import DEFAULT_PRECISION
    kinds = {KV_DTYPE[p.partition("/")[2] or DEFAULT_PRECISION] for p in plans}
    return "f32" if "f32" in kinds else kinds.pop()


def stats(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def socllm_runners(engine, plans: list, by_kv: dict) -> list:
    """A runner per plan, on the engine of by_kv whose KV cache the service keeps at the plan's
    precision (engine where by_kv has none)."""
    return [Socllm(by_kv.get(kv_dtype_for([p]), engine), p) for p in plans]


def run_bench(engine, prompts, n_decode, reps, plans, peers, oracle=None, log=print,
              by_kv: dict | None = None) -> dict:
    """engine: a running socllm Pool; by_kv: KV elements -> the Pool over such a cache, for the
    plans whose precision keeps another one than engine's (kv_dtype_for). Returns the report
    dict (see README)."""
    by_kv = {engine.kv_dtype: engine, **(by_kv or {})}
    runners = socllm_runners(engine, plans, by_kv)
    missing, mem = {}, {}
    mem["socllm"] = pss_mb(engine.pids())
    mem.update({f"socllm over {kv} KV": pss_mb(e.pids()) for kv, e in by_kv.items() if e is not engine})
    procs = []
    for name in peers:       # each in a process of its own (scripts/peers.py PeerProcess)
        try:
            procs.append(PeerProcess(name, engine.model_path, engine.threads))
        except PeerMissing as e:
            missing[name] = str(e)
            log(f"peer {name}: MISSING ({e})")
    try:
        return _run(engine, runners + procs, prompts, n_decode, reps, oracle, mem, missing, log)
    finally:
        for p in procs:
            p.close()


def _run(engine, runners, prompts, n_decode, reps, oracle, mem, missing, log) -> dict:
    variants = iter(range(1, 1 + len(prompts) * (reps + 1)))
    ids = {(n, rep): prompt_ids(engine.tokenizer, n, next(variants))    # rep -1: the warm-up
           for rep in range(-1, reps) for n in prompts}
    want = {n: oracle.greedy(ids[n, 0], min(CHECK_TOKENS, n_decode)) for n in prompts} if oracle else {}
    for r in runners:                                     # warm-up: compile, install, caches
        for n in prompts:
            r.run(ids[n, -1], 2)
    raw = {r.name: {n: [] for n in prompts} for r in runners}
    for rep in range(reps):
        for n in prompts:
            for r in runners:
                res = r.run(ids[n, rep], n_decode)
                raw[r.name][n].append(res)
                log(f"rep {rep + 1}/{reps} prompt {n:5d} {r.name:16s} ttft {res['ttft_s']*1e3:8.1f} ms "
                    f"prefill {res['prefill_tok_s']:8.1f} tok/s decode {res['decode_tok_s']:7.1f} tok/s")
    results = {}
    for name, per in raw.items():
        results[name] = {}
        for n, runs in per.items():
            first = runs[0]["tokens"][:len(want.get(n, []))]        # repetition 0's prompt
            agree = next((i for i, (a, b) in enumerate(zip(first, want.get(n, []))) if a != b), len(first))
            results[name][str(n)] = {
                **{k: stats([r[k] for r in runs]) for k in ("ttft_s", "prefill_tok_s", "decode_tok_s")},
                "oracle_match": (first == want[n]) if n in want else None,
                "oracle_prefix": agree if n in want else None,   # leading tokens equal to the oracle's
                "first_tokens": runs[0]["tokens"][:CHECK_TOKENS],
                "placement": runs[0].get("placement"),
                # each repetition's, in order: engines alternate within one, so ratios pair up
                "per_rep": {k: [round(r[k], 4) for r in runs]
                            for k in ("ttft_s", "prefill_tok_s", "decode_tok_s")}}
    mem["socllm"] = max(mem["socllm"], pss_mb(engine.pids()))
    mem.update({r.name: pss_mb([r.pid]) for r in runners if hasattr(r, "pid")})
    info = {d["processor"]: d.get("device", d.get("api")) for d in engine.info()}
    return {"model": os.path.basename(engine.model_path),
            "device": _device(info), "threads": engine.threads, "decode_tokens": n_decode,
            "kv_dtype": {r.name: r.engine.kv_dtype for r in runners if isinstance(r, Socllm)},
            "reps": reps, "prompts": list(prompts), "results": results, "missing_peers": missing,
            "memory_pss_mb": mem,
            "versions": {r.name: getattr(r, "version", None) for r in runners if not r.name.startswith("socllm")}}


def _device(info) -> str:
    import platform
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores; socllm gpu actor: {info.get('gpu')} (OpenCL), "
            f"npu actor: OpenVINO {info.get('npu')}")


def table(report) -> str:
    lines = [f"model: {report.get('model')}",
             f"device: {report['device']}; threads {report['threads']}; decode {report['decode_tokens']} "
             f"tokens; median of {report['reps']} [min-max]",
             f"{'engine':18s} {'prompt':>6s} {'ttft ms':>9s} {'prefill tok/s':>24s} {'decode tok/s':>22s}  oracle"]
    for name, per in report["results"].items():
        for n, r in per.items():
            p, d = r["prefill_tok_s"], r["decode_tok_s"]
            ok = {True: "same", False: f"differs after {r['oracle_prefix']}", None: "-"}[r["oracle_match"]]
            lines.append(f"{name:18s} {n:>6s} {r['ttft_s']['median']*1e3:9.1f} "
                         f"{p['median']:8.1f} [{p['min']:6.1f}-{p['max']:6.1f}] "
                         f"{d['median']:7.1f} [{d['min']:5.1f}-{d['max']:5.1f}]  {ok}")
    for name, why in report["missing_peers"].items():
        lines.append(f"{name:18s} MISSING: {why}")
    return "\n".join(lines)


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(report["results"])
    prompts = [str(p) for p in report["prompts"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(names))
    for ax, key, title in [(axes[0], "prefill_tok_s", "prefill tokens/s"), (axes[1], "decode_tok_s", "decode tokens/s")]:
        for i, name in enumerate(names):
            med = [report["results"][name][p][key]["median"] for p in prompts]
            lo = [m - report["results"][name][p][key]["min"] for m, p in zip(med, prompts)]
            hi = [report["results"][name][p][key]["max"] - m for m, p in zip(med, prompts)]
            ax.bar([j + i * width for j in range(len(prompts))], med, width, yerr=[lo, hi], label=name)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(prompts))], prompts)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(report["device"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="socllm bench")
    ap.add_argument("--model", help="a GGUF (default: the default model)")
    ap.add_argument("--prompts", default="32,128,512,1024",
                    help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    ap.add_argument("--decode", type=int, default=128,
                    help="tokens decoded after each prompt (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions, engines interleaved in each; min/median/max reported "
                         "(default: %(default)s)")
    ap.add_argument("--plans", default="gpu,gpu/f32,gpu/q8",
                    help="plan[/precision],... of cpu, gpu, npu, hetero, tensor, seqcut, hybrid and "
                         "f32, q16, q8 (no precision: the default, q16)")
    ap.add_argument("--peers", default="llama.cpp,openvino-genai",
                    help="peers run on the same prompts, comma-separated, or '' for none "
                         "(default: %(default)s; a missing one is reported with its install hint)")
    ap.add_argument("--json", dest="json_path", help="write the report as JSON to this file")
    ap.add_argument("--plot", help="write a PNG plot of the report to this file (matplotlib)")
    ap.add_argument("--no-oracle", action="store_true",
                    help="skip the check of each engine's first greedy tokens against the oracle")
    ap.add_argument("--sync", action="store_true", help="the synchronization microbenchmark instead")
    ap.add_argument("--profile", metavar="PRECISION", nargs="?", const="q16",
                    help="where a GPU decode step's time goes (scripts/profile_decode.py) instead")
    ap.add_argument("--speculate", metavar="MODES", nargs="?", const="off,auto",
                    help="speculative decoding instead: one stream on input-grounded and open "
                         "chat prompts, socllm with these --speculate modes against llama.cpp "
                         "plain and with its prompt-lookup drafting (scripts/spec_bench.py; its "
                         "options after --: socllm bench --speculate -- --reps 1)")
    a, rest = ap.parse_known_args(argv)
    if a.speculate:
        from .spec_bench import main as spec
        return spec(["--modes", a.speculate, *[x for x in rest if x != "--"]])
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.profile:
        from .profile_decode import main as profile
        profile(["--precision", a.profile])
        return 0
    if a.sync:
        from .sync_bench import main as sync
        report = sync()
        print(json.dumps(report, indent=1))
        if a.json_path:
            with open(a.json_path, "w") as f:
                json.dump(report, f, indent=1)
        return 0
    prompts = [int(x) for x in a.prompts.split(",")]
    peers = [p for p in a.peers.split(",") if p and p != "none"]
    unknown = [p for p in peers if p not in PEERS]
    if unknown or a.reps < 1 or a.decode < 2 or min(prompts) < 1:
        print(f"socllm bench: error: bad arguments (unknown peers {unknown}?)", file=sys.stderr)
        return 2
    from socllm.policies.config import SERVE_PRECISIONS
    from socllm.policies.placement import SERVE_PLANS
    bad = [p for p in a.plans.split(",") if p.partition("/")[0] not in SERVE_PLANS
           or p.partition("/")[2] not in ("", *SERVE_PRECISIONS)]
    if bad:
        print(f"socllm bench: error: unknown plan/precision {', '.join(bad)} (plans: "
              f"{', '.join(SERVE_PLANS)}; precisions: {', '.join(SERVE_PRECISIONS)})", file=sys.stderr)
        return 2
    from socllm.actors.pool import Pool
    # each plan over the KV cache the service keeps at its precision: an engine per kind
    kinds = list(dict.fromkeys(kv_dtype_for([p]) for p in a.plans.split(",")))
    engines = []
    try:
        for kv in kinds:
            engines.append(Pool(model=a.model, context=max(2048, max(prompts) + a.decode + 8),
                                kv_dtype=kv))
        eng = engines[0]
        oracle = None
        if not a.no_oracle:
            from socllm.models.gguf_file import open_gguf
            from socllm.models.llama import load_config, load_weights
            from socllm.models.oracle import Oracle
            reader = open_gguf(eng.model_path)
            cfg = load_config(reader)
            oracle = Oracle(cfg, load_weights(reader, cfg))
        report = run_bench(eng, prompts, a.decode, a.reps, a.plans.split(","), peers, oracle,
                           log=lambda s: print(s, file=sys.stderr, flush=True),
                           by_kv={e.kv_dtype: e for e in engines})
    finally:
        for e in reversed(engines):        # the first started the private Ray: it stops last
            e.close()
    print(table(report))
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot:
        plot(report, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
