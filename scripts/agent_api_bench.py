"""What agents get from the service, measured (issue 27's targets), socllm against llama-server in
the same run, one engine at a time on this machine's cores.

    python -m socllm.scripts.agent_api_bench [--reps 5] [--prefix-tokens 1000] [--json FILE]
        [--parts prefix,json,tools,speed] [--llama-server BIN]

prefix  a pair of requests sharing a --prefix-tokens prefix (different public-domain text each
        rep): the second's time to first token against the first's, for socllm (prefix cache
        on), socllm --no-prefix-cache and llama-server (cache_prompt on, one slot, as its
        default), streaming /v1/completions, max_tokens 8.
json    5 JSON schemas x --json-requests requests (a third greedy, the rest at temperature
        0.8): the share that parse and validate.
tools   --json-requests requests with tool_choice "required" over two tools: the share whose
        calls are well-formed with arguments valid for their function's schema.
speed   8 concurrent streams, the same prompt and length, under a JSON schema and without:
        decode tok/s over all streams (output tokens / (last token - first token)).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import requests

from .serve_bench import DATA, LlamaServer, start_llama_server, start_socllm, stop_socllm

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "unsure"]},
                                      "reason": {"type": "string", "maxLength": 80}},
     "required": ["answer", "reason"]},
    {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 4},
                                      "draft": {"type": "boolean"}}, "required": ["title", "tags", "draft"]},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"n": {"type": "integer"}, "do": {"type": "string", "maxLength": 30}},
        "required": ["n", "do"]}}}, "required": ["steps"]},
]
QUESTIONS = ["Describe the city you like most.", "Is it going to rain tomorrow? Say why.",
             "List a few fruits.", "Write a note about a meeting.", "How do I boil an egg?"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the notes for a query",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                                        "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
                       "required": ["query"]}}}]


# -- engines -------------------------------------------------------------------------------------
class Socllm:
    def __init__(self, gguf: str, prefix_cache: bool, context: int):
        self.name = "socllm" if prefix_cache else "socllm --no-prefix-cache"
        self.gguf, self.prefix_cache, self.context = gguf, prefix_cache, context

    def start(self) -> str:
        self.svc, self.info, self.url = start_socllm(self.gguf, prefix_cache=self.prefix_cache,
                                                     context=self.context)
        return self.url

    def memory(self) -> dict:
        import ray
        st = ray.get(self.svc.status.remote())
        return {"pss_mb": st["memory_pss_mb"], "by_process": st["memory_pss_mb_by_process"],
                "kv": st["kv"]}

    def stop(self):
        stop_socllm(self.svc)


class Llama:
    name = "llama-server"

    def __init__(self, gguf: str, binary: str | None, context: int):
        ls = LlamaServer(gguf, binary)
        self.gguf, self.binary, self.version, self.context = gguf, ls.binary, ls.version, context

    def start(self) -> str:
        self.proc, url = start_llama_server(self.binary, self.gguf, 1, self.context)
        return url

    def memory(self) -> dict:
        from socllm.actors.metrics import pss_mb
        return {"pss_mb": pss_mb([self.proc.pid])}

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


# -- the parts -----------------------------------------------------------------------------------
def ttft(url: str, prompt: str, extra: dict) -> tuple:
    """Seconds to the first streamed text, and the reply's cached prompt tokens where said."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    t0, first, cached = time.perf_counter(), None, None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
            if "timings" in chunk:                 # llama-server's own count
                cached = chunk["timings"].get("cache_n", cached)
    return first, cached


def prefixes(n_tokens: int, reps: int, tokenizer) -> list:
    """reps different texts of about n_tokens tokens (windows of the public-domain text)."""
    words = open(DATA).read().split()
    out = []
    for r in range(reps):
        lo, n = (r * 131) % (len(words) // 3), 100
        while len(tokenizer.encode(" ".join(words[lo:lo + n]))) < n_tokens and lo + n < len(words):
            n += 20
        out.append(" ".join(words[lo:lo + n]))
    return out


def part_prefix(url: str, texts: list, extra: dict) -> dict:
    pairs = []
    for text in texts:
        a = ttft(url, text + "\nQuestion: who is Mr. Bennet? Answer:", extra)
        b = ttft(url, text + "\nQuestion: where does Mr. Bingley live? Answer:", extra)
        pairs.append({"first_s": a[0], "second_s": b[0], "cached_second": b[1]})
    firsts, seconds = [p["first_s"] for p in pairs], [p["second_s"] for p in pairs]
    return {"pairs": pairs, "first_median_s": statistics.median(firsts),
            "second_median_s": statistics.median(seconds),
            "second_min_s": min(seconds), "second_max_s": max(seconds),
            "speedup_median": statistics.median(f / s for f, s in zip(firsts, seconds))}


def chat(url: str, body: dict) -> dict:
    r = requests.post(url + "/v1/chat/completions", json={"model": "m", **body}, timeout=600)
    r.raise_for_status()
    return r.json()


def part_json(url: str, n: int) -> dict:
    import jsonschema
    ok, total, bad = 0, 0, []
    for i, schema in enumerate(SCHEMAS):
        for k in range(n):
            t = 0 if k < n // 3 else 0.8
            r = chat(url, {"messages": [{"role": "user", "content": QUESTIONS[i] + " Answer in JSON."}],
                           "max_tokens": 200, "temperature": t, "seed": k,
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}})
            text, total = r["choices"][0]["message"]["content"], total + 1
            try:
                jsonschema.validate(json.loads(text), schema)
                ok += 1
            except Exception as e:
                bad.append({"schema": i, "text": text[:200], "error": f"{type(e).__name__}"})
    return {"requests": total, "valid": ok, "valid_share": ok / total, "invalid": bad[:5]}


def part_tools(url: str, n: int) -> dict:
    import jsonschema
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    asks = ["What's the weather in Lyon?", "Find my notes about the budget.",
            "Is it cold in Oslo, and what did I write about trains?"]
    ok, calls_seen, bad = 0, 0, []
    for k in range(n):
        r = chat(url, {"messages": [{"role": "user", "content": asks[k % len(asks)]}], "tools": TOOLS,
                       "tool_choice": "required", "max_tokens": 200, "seed": k,
                       "temperature": 0 if k < n // 3 else 0.8})
        msg = r["choices"][0]["message"]
        try:
            assert r["choices"][0]["finish_reason"] == "tool_calls" and msg["tool_calls"]
            for c in msg["tool_calls"]:
                jsonschema.validate(json.loads(c["function"]["arguments"]), params[c["function"]["name"]])
                calls_seen += 1
            ok += 1
        except Exception as e:
            bad.append({"message": str(msg)[:200], "error": type(e).__name__})
    return {"requests": n, "well_formed": ok, "well_formed_share": ok / n, "calls": calls_seen,
            "invalid": bad[:5]}


def streams(url: str, n: int, body: dict) -> dict:
    """n concurrent chat streams of `body`: output tok/s over all (by usage) from the first
    token of any to the last of all."""
    out, lock = [], threading.Lock()

    def one():
        b = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, **body}
        times, tokens = [], 0
        with requests.post(url + "/v1/chat/completions", json=b, stream=True, timeout=900) as r:
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        with lock:
            out.append((times[0], times[-1], tokens))
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = max(e for _, e, _ in out) - min(s for s, _, _ in out)
    return {"tokens": sum(t for *_, t in out), "span_s": span,
            "tok_s": sum(t for *_, t in out) / span}


def part_speed(url: str, reps: int) -> dict:
    """8 streams: under a schema whose replies run long (a list of 24 to 32 short strings), and
    free text of the same length (ignore_eos), interleaved reps times."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 24, "maxItems": 32}
    ask = [{"role": "user", "content": "List many animals."}]
    con, free = [], []
    streams(url, 2, {"messages": ask, "max_tokens": 32, "response_format": {   # warm-up: not kept
        "type": "json_schema", "json_schema": {"name": "l", "schema": schema, "strict": True}}})
    for _ in range(reps):
        c = streams(url, 8, {"messages": ask, "max_tokens": 400, "temperature": 0.8, "seed": 1,
                             "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "l", "schema": schema, "strict": True}}})
        per = max(16, c["tokens"] // 8)
        f = streams(url, 8, {"messages": ask, "max_tokens": per, "temperature": 0.8, "seed": 1,
                             "ignore_eos": True})
        con.append(c)
        free.append(f)
    ratio = [c["tok_s"] / f["tok_s"] for c, f in zip(con, free)]
    return {"constrained_tok_s": [round(c["tok_s"], 1) for c in con],
            "free_tok_s": [round(f["tok_s"], 1) for f in free],
            "tokens_per_stream": [c["tokens"] // 8 for c in con],
            "ratio": [round(r, 3) for r in ratio], "ratio_median": statistics.median(ratio)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="agent_api_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--json-requests", type=int, default=20)
    ap.add_argument("--parts", default="prefix,json,tools,speed")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--priority", default=None, choices=("reactive", "proactive"),
                    help="socllm's requests' class in the prefix part (default: the service's, proactive)")
    ap.add_argument("--engines", default="socllm,nocache,llama-server", help="the prefix part's")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from socllm.models.gguf_file import default_model_path, open_gguf
    from socllm.models.tokenizer import Tokenizer
    gguf = default_model_path()
    tokenizer = Tokenizer(open_gguf(gguf))
    parts = a.parts.split(",")
    report = {"device": "2-core CPU: socllm's gpu actor is OpenCL on PoCL (the CPU)",
              "settings": vars(a), "results": {}}
    context = 2048
    if "prefix" in parts:
        texts = prefixes(a.prefix_tokens, a.reps, tokenizer)
        report["prefix_tokens"] = [len(tokenizer.encode(t)) for t in texts]
        want = a.engines.split(",")
        engines = [e for e, k in ((Socllm(gguf, True, context), "socllm"),
                                  (Socllm(gguf, False, context), "nocache")) if k in want]
        if "llama-server" in want:
            try:
                engines.append(Llama(gguf, a.llama_server, context))
                report["llama_server"] = engines[-1].version
            except Exception as e:
                report["llama_server"] = f"missing: {e}"
        for eng in engines:
            url = eng.start()
            extra = {"priority": a.priority} if a.priority and isinstance(eng, Socllm) else {}
            try:
                part_prefix(url, texts[:1], extra)       # warm-up pair (not reported)
                res = part_prefix(url, texts[1:] if len(texts) > 1 else texts, extra)
                res["memory"] = eng.memory()
            finally:
                eng.stop()
            report["results"][f"prefix {eng.name}"] = res
            print(f"prefix {eng.name}: first {res['first_median_s']:.3f} s, second "
                  f"{res['second_median_s']:.3f} s [{res['second_min_s']:.3f}-{res['second_max_s']:.3f}], "
                  f"x{res['speedup_median']:.1f}", flush=True)
    if {"json", "tools", "speed"} & set(parts):
        eng = Socllm(gguf, True, context)
        url = eng.start()
        try:
            if "json" in parts:
                report["results"]["json"] = r = part_json(url, a.json_requests)
                print(f"json: {r['valid']} of {r['requests']} valid", flush=True)
            if "tools" in parts:
                report["results"]["tools"] = r = part_tools(url, a.json_requests)
                print(f"tools: {r['well_formed']} of {r['requests']} well-formed", flush=True)
            if "speed" in parts:
                report["results"]["speed"] = r = part_speed(url, a.reps)
                print(f"speed: constrained/free {r['ratio']} (median {r['ratio_median']:.3f})", flush=True)
            report["results"]["memory_after"] = eng.memory()
        finally:
            eng.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
