"""Speculative decoding's one-stream targets, measured: socllm with and without its prompt-lookup
drafting against llama.cpp (llama-cpp-python), plain and with its own prompt-lookup drafting, in
the same run, one engine at a time on this machine's cores.

    python -m socllm.scripts.spec_bench [--prompts FILE] [--kinds grounded,open] [--reps 3]
        [--max-tokens 256] [--precision q16] [--modes off,auto] [--draft-max 8] [--draft-ranks 2]
        [--llama-variants plain,lookup10,lookup2] [--limit N] [--prefix-cache] [--tag 2core]

The targets (the default model, greedy, one stream):
  input-grounded prompts (kind "grounded": summarise / extract / rewrite / quote over a 300-800
  token input)  socllm auto >= 2.0x socllm off, and >= 1.5x the faster llama.cpp variant;
  open chat prompts (kind "open")  socllm auto never below 0.95x socllm off;
  tokens  socllm's with drafting identical to its own without (the target is at --precision f32).

What runs. socllm: one socllm.LLM engine (service speculate "auto", plan gpu (--plan), policy fcfs,
max_seqs 16, `serve`'s: a lone request has 15 more rows for drafts, --draft-max of them; 2 threads), each request's `speculate`
field set to each of --modes. llama.cpp: Llama(n_threads=2, n_threads_batch=2, n_ctx=2048)
through create_chat_completion(stream=True, temperature=0); "lookupN" is the same with
draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N) (one Llama object for every lookup
variant: llama-cpp-python keeps every position's logits when it drafts, 400 MB here). Every
prompt is one user message through each engine's reading of the GGUF's chat template, max_tokens
--max-tokens, EOS ends it. For each of --reps repetitions, each prompt runs once on every variant,
the variants' order rotated from prompt to prompt and rep to rep; a warm-up run of every variant
comes first and is not kept. Only one engine works at a time: socllm's stays open and idle while
llama.cpp runs, in a process of its own (LlamaCppProcess: in one process both decoded slower). By default neither engine reuses an earlier request's prompt (socllm's prefix
cache off; llama-cpp-python's Llama reset before each request), so every run prefills its whole
prompt and end-to-end times compare; --prefix-cache leaves both on.

Timing, chosen to be the same measurement on both engines: decode tok/s = (sampled tokens - 1) /
(time the last token was sampled - time the first was), both stamped inside the engine's process
where the token is sampled, the stop token (EOS) included where the reply ends on one.
  socllm: the service's record of the request (Service.request(rid)["timings"]["decode_tok_s"]:
    its first_token and finish are stamped where the engine loop accepts a sampled token), not the
    Python client's stream: a streamed piece reaches the client through a Ray poll that hands out
    pieces at most every 20 ms (actors/service.py POLL_COALESCE_S), which would blur the rate and
    add a hop that llama.cpp in-process does not have.
  llama.cpp: llama-cpp-python's Llama.sample, wrapped to stamp each token as it is sampled
    (the generator behind the stream calls it once per emitted token, accepted drafts included);
    the stream itself holds text back (multi-byte characters, a possible stop string), so its
    chunks are neither one per token nor on time.
End-to-end seconds are the caller's: from the call (socllm: submit through the Python client)
to the stream's end. TTFT: socllm's service record; llama.cpp's first sample.
socllm's accepted/rejected draft tokens are the request's usage (completion_tokens_details); its
drafted tokens and verify steps the service's record of the request (Service.request's
"speculation").

Reported (and written to scripts/results/spec-<tag>.json): every run; per prompt the median over
reps of each variant; per kind the min/median/max over prompts of socllm-<mode> / socllm-off and
socllm-<mode> / best llama.cpp (per prompt the faster variant), of the end-to-end speedups, the
acceptance (accepted per verify step, accepted share of drafted tokens) and how many prompts gave
socllm identical tokens with and without drafting in every rep.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from socllm.policies.drafting import MODES

from .peers import LineChild, serve_lines

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "data" / "spec_prompts.json"
RESULTS = HERE / "results"
MAX_SEQS = 16             # socllm serve's default
KINDS = ("grounded", "open")
THREADS = 2
CONTEXT = 2048
OFF = "socllm-off"
TARGETS = {"grounded": {"vs_off": 2.0, "vs_llama": 1.5}, "open": {"vs_off_min": 0.95}}


# -- pure helpers (tests/test_spec_bench.py) -----------------------------------------------------
def load_prompts(path, kinds=KINDS, limit: int | None = None) -> list:
    """The prompt file's prompts of `kinds`, in its order, at most `limit` of each kind."""
    data = json.loads(Path(path).read_text())
    out, seen = [], {}
    for p in data["prompts"]:
        if p["kind"] not in KINDS:
            raise ValueError(f"prompt {p['id']}: kind must be one of {', '.join(KINDS)}")
        if not p["messages"] or not all(set(m) == {"role", "content"} for m in p["messages"]):
            raise ValueError(f"prompt {p['id']}: messages must be [{{role, content}}, ...]")
        if p["kind"] in kinds and (limit is None or seen.get(p["kind"], 0) < limit):
            seen[p["kind"]] = seen.get(p["kind"], 0) + 1
            out.append(p)
    if len({p["id"] for p in data["prompts"]}) != len(data["prompts"]):
        raise ValueError("prompt ids must be unique")
    return out


def llama_variants(spec: str) -> list:
    """"plain,lookup10,lookup2" -> [(name, num_pred_tokens or None: plain)]."""
    out = []
    for v in [v.strip() for v in spec.split(",") if v.strip()]:
        if v == "plain":
            out.append(("llama.cpp", None))
        elif v.startswith("lookup") and v[6:].isdigit() and int(v[6:]) >= 1:
            out.append((f"llama.cpp-{v}", int(v[6:])))
        else:
            raise ValueError(f"a llama.cpp variant is plain or lookupN (N >= 1), got {v!r}")
    return out


def socllm_modes(spec: str) -> list:
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise ValueError(f"--modes: distinct values of {', '.join(MODES)}; got {spec!r}")
    return modes


def rotated(items: list, k: int) -> list:
    """items started at position k (mod its length): each variant takes each place in turn."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]


def spread(xs) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def per_prompt(rows: list, prompts: list, variants: list) -> list:
    """Each prompt's medians over reps per variant, its ratios, acceptance and token equality.
    rows: the runs ({prompt, variant, rep, decode_tok_s, e2e_s, ttft_s, ...}; socllm's with
    `ids`, its drafted ones with drafted/accepted/verify_steps)."""
    llamas = [v for v in variants if v.startswith("llama.cpp")]
    specs = [v for v in variants if v.startswith("socllm-") and v != OFF]
    out = []
    for p in prompts:
        mine = [r for r in rows if r["prompt"] == p["id"]]
        by = {v: [r for r in mine if r["variant"] == v] for v in variants}
        med = {k: {v: _median(r[k] for r in by[v]) for v in variants if by[v]}
               for k in ("decode_tok_s", "e2e_s", "ttft_s", "sampled_tokens")}
        tok = med["decode_tok_s"]
        best = max((v for v in llamas if tok.get(v)), key=lambda v: tok[v], default=None)
        one = {"id": p["id"], "kind": p["kind"], "task": p.get("task"),
               "input_tokens": p.get("input_tokens"), **med, "best_llama": best,
               "ratios": {}, "e2e_speedups": {}, "acceptance": {}, "identical": {}}
        for s in specs:
            if s not in tok:
                continue
            one["ratios"][f"{s}/{OFF}"] = _ratio(tok[s], tok.get(OFF))
            if best:
                one["ratios"][f"{s}/best llama.cpp"] = _ratio(tok[s], tok[best])
            one["e2e_speedups"][f"{OFF}/{s}"] = _ratio(med["e2e_s"].get(OFF), med["e2e_s"][s])
            one["acceptance"][s] = acceptance(by[s])
            base = {r["rep"]: r for r in by.get(OFF, [])}
            pairs = [(r, base[r["rep"]]) for r in by[s] if r["rep"] in base]
            one["identical"][s] = (all(r["ids"] == b["ids"] for r, b in pairs) if pairs else None)
        out.append(one)
    return out


def acceptance(runs: list) -> dict:
    """Drafting over runs: accepted per verify step, and the accepted share of drafted tokens."""
    d = sum(r.get("drafted") or 0 for r in runs)
    a = sum(r.get("accepted") or 0 for r in runs)
    s = sum(r.get("verify_steps") or 0 for r in runs)
    return {"drafted": d, "accepted": a, "verify_steps": s,
            "accepted_per_step": a / s if s else None, "accepted_share": a / d if d else None}


def per_kind(prompt_rows: list, rows: list, variants: list) -> dict:
    out = {}
    for kind in KINDS:
        ps = [p for p in prompt_rows if p["kind"] == kind]
        if not ps:
            continue
        ids = {p["id"] for p in ps}
        keys = sorted({k for p in ps for k in p["ratios"]})
        ekeys = sorted({k for p in ps for k in p["e2e_speedups"]})
        specs = sorted({s for p in ps for s in p["acceptance"]})
        out[kind] = {
            "prompts": len(ps),
            "decode_tok_s": {v: spread(p["decode_tok_s"].get(v) for p in ps) for v in variants},
            "ratios": {k: spread(p["ratios"].get(k) for p in ps) for k in keys},
            "e2e_speedups": {k: spread(p["e2e_speedups"].get(k) for p in ps) for k in ekeys},
            "acceptance": {s: acceptance([r for r in rows if r["variant"] == s and r["prompt"] in ids])
                           for s in specs},
            "identical": {s: f"{sum(p['identical'].get(s) is True for p in ps)}/{len(ps)}" for s in specs},
        }
    return out


def targets(kinds: dict, precision: str, mode: str = "auto") -> dict:
    """The targets against what was measured (None: not measured)."""
    s = f"socllm-{mode}"
    g, o = kinds.get("grounded", {}), kinds.get("open", {})

    def at(k, key, stat):
        x = (k.get("ratios") or {}).get(key)
        return x[stat] if x else None

    def ok(x, bound):
        return None if x is None else x >= bound
    vs_off, vs_llama = at(g, f"{s}/{OFF}", "median"), at(g, f"{s}/best llama.cpp", "median")
    open_min = at(o, f"{s}/{OFF}", "min")
    same = [v for k in (g, o) for key, v in (k.get("identical") or {}).items() if key == s]
    return {
        f"grounded {s}/{OFF} median >= {TARGETS['grounded']['vs_off']}":
            ok(vs_off, TARGETS["grounded"]["vs_off"]),
        f"grounded {s}/best llama.cpp median >= {TARGETS['grounded']['vs_llama']}":
            ok(vs_llama, TARGETS["grounded"]["vs_llama"]),
        f"open {s}/{OFF} min >= {TARGETS['open']['vs_off_min']}":
            ok(open_min, TARGETS["open"]["vs_off_min"]),
        f"tokens identical with and without drafting (at {precision}; the target is at f32)":
            (all(x.split("/")[0] == x.split("/")[1] for x in same) if same else None),
    }


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _sp(x) -> str:
    return "-" if not x else f"{x['min']:.2f} / {x['median']:.2f} / {x['max']:.2f}"


def table(prompt_rows: list, kinds: dict, variants: list) -> str:
    """Per prompt: each variant's median decode tok/s; per kind: the ratios' min / median / max."""
    lines = ["| prompt | kind | " + " | ".join(variants) + " | ratios | accepted/step |",
             "|---|---|" + "---|" * len(variants) + "---|---|"]
    for p in prompt_rows:
        ratios = ", ".join(f"{k}: {_f(v)}" for k, v in p["ratios"].items())
        acc = ", ".join(f"{_f(a['accepted_per_step'])}" for a in p["acceptance"].values())
        lines.append(f"| {p['id']} | {p['kind']} | "
                     + " | ".join(_f(p["decode_tok_s"].get(v), "{:.1f}") for v in variants)
                     + f" | {ratios} | {acc} |")
    lines += ["", "| kind | ratio (decode tok/s) | min / median / max |", "|---|---|---|"]
    for kind, k in kinds.items():
        for key, x in k["ratios"].items():
            lines.append(f"| {kind} | {key} | {_sp(x)} |")
        for key, x in k["e2e_speedups"].items():
            lines.append(f"| {kind} | end-to-end {key} | {_sp(x)} |")
        for s, a in k["acceptance"].items():
            lines.append(f"| {kind} | {s}: accepted per verify step {_f(a['accepted_per_step'])}, "
                         f"accepted share {_f(a['accepted_share'])}, identical tokens "
                         f"{k['identical'][s]} prompts | |")
    return "\n".join(lines)


# -- engines -------------------------------------------------------------------------------------
class Socllm:
    """One socllm.LLM engine (service speculate auto), requests through its Python client."""

    def __init__(self, model, precision: str, draft_max: int, prefix_cache: bool, draft_ranks: int,
                 plan: str = "gpu"):
        import socllm
        self.llm = socllm.LLM(model, precision=precision, plan=plan, policy="fcfs", max_seqs=MAX_SEQS,
                              threads=THREADS, context=CONTEXT, speculate="auto",
                              draft_max=draft_max, prefix_cache=prefix_cache, draft_ranks=draft_ranks)
        self.client, self.service = self.llm._client, self.llm._service

    def counters(self) -> dict:
        return self.llm.status()["speculation"]

    def run(self, messages: list, max_tokens: int, mode: str) -> dict:
        import ray
        t0 = time.perf_counter()
        rid = self.client.submit(messages=messages, max_tokens=max_tokens, temperature=0.0,
                                 speculate=mode)
        pieces, first, out = [], None, None
        for out in self.client.polls(rid):
            if out["pieces"] and first is None:
                first = time.perf_counter()
            pieces += out["pieces"]
        end = time.perf_counter()
        rec = ray.get(self.service.request.remote(rid))
        usage = rec["usage"]
        sp = rec.get("speculation") or {"drafted": 0, "accepted": 0, "verify_steps": 0}
        spec = usage.get("completion_tokens_details") or {}
        return {"decode_tok_s": rec["timings"]["decode_tok_s"] or None, "e2e_s": end - t0,
                "ttft_s": rec["timings"]["ttft_s"], "client_first_piece_s": (first or end) - t0,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "sampled_tokens": len(rec["tokens"]), "completion_tokens": usage["completion_tokens"],
                "finish_reason": out["finish_reason"], "text": "".join(pieces), "ids": rec["tokens"],
                "accepted": spec.get("accepted_prediction_tokens", 0),
                "rejected": spec.get("rejected_prediction_tokens", 0),
                "drafted": sp["drafted"], "verify_steps": sp["verify_steps"],
                "service_accepted": sp["accepted"]}

    def close(self):
        self.llm.close()


class LlamaCpp:
    """One llama_cpp.Llama; lookup: built with a prompt-lookup draft model (set per run)."""

    def __init__(self, gguf: str, lookup: bool, keep_cache: bool):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        self.keep_cache, self.draft = keep_cache, LlamaPromptLookupDecoding
        # logits_all=True said again with a draft model: llama-cpp-python 0.3.36 turns it on for
        # drafting but sizes its logits buffer by the argument (n_batch rows), so a prompt longer
        # than n_batch (512) fails in eval ("could not broadcast ... into shape (0,)")
        kw = ({"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=10), "logits_all": True}
              if lookup else {})
        self.llm = Llama(model_path=gguf, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=CONTEXT,
                         verbose=False, **kw)
        self.stamps, self.prompt_tokens = [], 0
        sample = self.llm.sample

        def stamped(*a, **k):           # the generator calls self.sample once per emitted token
            tok = sample(*a, **k)
            if not self.stamps:
                self.prompt_tokens = self.llm.n_tokens
            self.stamps.append((time.perf_counter(), tok))
            return tok
        self.llm.sample = stamped

    def run(self, messages: list, max_tokens: int, num_pred: int | None) -> dict:
        import llama_cpp
        llm = self.llm
        if num_pred is not None:
            llm.draft_model = self.draft(num_pred_tokens=num_pred)
        if not self.keep_cache:
            llm.reset()                 # no reuse of the previous request's prompt
        self.stamps = []
        pieces, finish = [], None
        t0 = time.perf_counter()
        for chunk in llm.create_chat_completion(messages, temperature=0.0, max_tokens=max_tokens,
                                                stream=True):
            c = chunk["choices"][0]
            if c["delta"].get("content"):
                pieces.append(c["delta"]["content"])
            finish = c.get("finish_reason") or finish
        end = time.perf_counter()
        st = self.stamps
        ids = [t for _, t in st]
        n_eog = sum(bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)) for t in ids)
        return {"decode_tok_s": (len(st) - 1) / (st[-1][0] - st[0][0]) if len(st) > 1 else None,
                "e2e_s": end - t0, "ttft_s": st[0][0] - t0 if st else None,
                "prompt_tokens": self.prompt_tokens, "sampled_tokens": len(st),
                "completion_tokens": len(st) - n_eog, "finish_reason": finish,
                "text": "".join(pieces), "ids": ids}


class LlamaCppProcess(LineChild):
    """A LlamaCpp in a process of its own (scripts/peers.py LineChild): its threads and memory
    apart from socllm's engine and this process. With both engines in this process each decoded
    slower (the 2-core Xeon VM, 6 grounded prompts: socllm off 44-60 tok/s against 67-73,
    llama.cpp 52-65 against 71-78), and the ratios moved little."""

    def __init__(self, gguf: str, lookup: bool, keep_cache: bool):
        super().__init__("llama.cpp", "socllm.scripts.spec_bench", "--serve-llama",
                         [gguf, lookup, keep_cache])

    def run(self, messages: list, max_tokens: int, num_pred: int | None) -> dict:
        return self.ask([messages, max_tokens, num_pred])


def _serve_llama(spec: str) -> int:
    """--serve-llama: one LlamaCpp answering LlamaCppProcess's lines until stdin closes."""
    eng = LlamaCpp(*json.loads(spec))
    return serve_lines(lambda req: eng.run(*req))


# -- the run -------------------------------------------------------------------------------------
def _git() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE.parent), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+changes" if dirty else "")
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="spec_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--precision", default="q16")
    ap.add_argument("--plan", default="gpu", help="socllm's serving plan (hcmp: Ghidorah's split)")
    ap.add_argument("--modes", default="off,auto", help="socllm requests' speculate values")
    ap.add_argument("--draft-max", type=int, default=8, help="socllm's, per sequence and step")
    ap.add_argument("--draft-ranks", type=int, default=2, help="socllm's draft heads' candidates "
                    "per head (1: chains)")
    ap.add_argument("--llama-variants", default="plain,lookup10,lookup2",
                    help="plain and/or lookupN (LlamaPromptLookupDecoding(num_pred_tokens=N)); '' for none")
    ap.add_argument("--limit", type=int, default=None, help="prompts per kind (smoke runs)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="leave socllm's prefix cache and llama-cpp-python's prompt reuse on")
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--tag", default="2core")
    ap.add_argument("--serve-llama", default=None, help=argparse.SUPPRESS)   # LlamaCppProcess's child
    a = ap.parse_args(argv)
    if a.serve_llama:
        return _serve_llama(a.serve_llama)
    kinds = [k for k in a.kinds.split(",") if k]
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: of {', '.join(KINDS)}")
    modes, llamas = socllm_modes(a.modes), llama_variants(a.llama_variants)
    prompts = load_prompts(a.prompts, kinds, a.limit)
    if not prompts:
        ap.error("no prompts of those kinds")
    from socllm.models.gguf_file import default_model_path, model_path
    gguf = model_path(a.model) if a.model else default_model_path()
    out_path = RESULTS / f"spec-{a.tag}.json"

    report = {"device": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}): "
                        "socllm's gpu actor is OpenCL on PoCL (the CPU)",
              "model": os.path.basename(gguf), "socllm": _git(), "settings": vars(a),
              "load_before": os.getloadavg(), "missing": {}}
    engines: dict = {}                  # variant -> (runner, run's extra argument)
    socllm_engine = lookup = None
    try:
        print(f"# socllm: starting ({a.precision}, plan {a.plan}, fcfs, max_seqs {MAX_SEQS})", flush=True)
        socllm_engine = Socllm(a.model, a.precision, a.draft_max, a.prefix_cache, a.draft_ranks, a.plan)
        report["socllm_describe"] = socllm_engine.llm.describe
        gpu = [f"{p.get('api') or ''} {p.get('device') or ''}".strip()
               for p in socllm_engine.llm.status().get("processors", []) if p.get("processor") == "gpu"]
        report["device"] = (f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}); "
                            f"socllm's gpu actor: {gpu[0] if gpu else 'none'}")
        for m in modes:
            engines[f"socllm-{m}"] = (socllm_engine, m)
        if llamas:
            try:
                import llama_cpp
                report["llama_cpp"] = llama_cpp.__version__
                for name, n in llamas:
                    if n is None:
                        engines[name] = (LlamaCppProcess(gguf, False, a.prefix_cache), None)
                    else:
                        lookup = lookup or LlamaCppProcess(gguf, True, a.prefix_cache)
                        engines[name] = (lookup, n)
            except ImportError as e:
                report["missing"]["llama.cpp"] = (f"llama-cpp-python is not installed ({e}): "
                                                  "pip install -e '.[bench]'")
                print(f"# llama.cpp: missing ({e})", file=sys.stderr)
        variants = list(engines)
        rows = []

        def one(p, v, rep, order):
            eng, arg = engines[v]
            r = eng.run(p["messages"], a.max_tokens, arg)
            r.update(prompt=p["id"], kind=p["kind"], variant=v, rep=rep, order=order)
            return r

        warm = prompts[0]
        for v in variants:              # warm-up: kernels, caches, socllm's step costs; not kept
            one(warm, v, -1, 0)
        for rep in range(a.reps):
            for i, p in enumerate(prompts):
                for order, v in enumerate(rotated(variants, rep + i)):
                    r = one(p, v, rep, order)
                    rows.append(r)
                    acc = (f"  drafts {r['accepted']}/{r['drafted']} in {r['verify_steps']} steps"
                           if "drafted" in r and r["drafted"] else "")
                    print(f"rep {rep} {p['id']:>16} {v:>20} {_f(r['decode_tok_s'], '{:7.1f}')} tok/s "
                          f"{r['e2e_s']:6.2f} s  {r['sampled_tokens']:4d} tok{acc}", flush=True)
        report["speculation_status"] = socllm_engine.counters()
    finally:
        if socllm_engine is not None:
            socllm_engine.close()
        for eng in {id(e): e for e, _ in engines.values() if e is not socllm_engine}.values():
            eng.close()
    report["load_after"] = os.getloadavg()
    prompt_rows = per_prompt(rows, prompts, variants)
    kinds_out = per_kind(prompt_rows, rows, variants)
    spec_mode = next((m for m in modes if m != "off"), None)
    report.update(variants=variants, per_prompt=prompt_rows, per_kind=kinds_out,
                  targets=targets(kinds_out, a.precision, spec_mode) if spec_mode and "off" in modes else {},
                  runs=[{k: v for k, v in r.items() if k != "ids"} for r in rows])
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1))
    print(table(prompt_rows, kinds_out, variants))
    for k, ok in report["targets"].items():
        print(f"target {k}: {'-' if ok is None else 'met' if ok else 'NOT met'}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
