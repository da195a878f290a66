"""Agents' requests, mixed, against a running service: what an agent developer's stress test sends.

    ray start --head && socllm serve
    python -m socllm.scripts.agent_stress [--minutes 4] [--clients 16] [--url URL] [--json FILE]

Each client thread sends, one after another until the time is up, a request of a kind drawn at
random (weights in KINDS) through the official `openai` client or plain HTTP: plain chat (streamed
or not, temperature 0-1, stop strings), a JSON schema (strict; the reply must parse and validate),
tools (`required`, `auto` or a named function, streamed or not, parallel or not; every call's
arguments must validate), logprobs with top_logprobs, n > 1, completions with echo and logprobs,
embeddings of several inputs, a stream the client drops after a few chunks, an agent's second
turn (an assistant's tool call, the tool's result, content as parts), and bad input (each must get
a 4xx: never a 5xx, never a 200). Reports counts by kind, every wrong outcome, the service's
requests and KV/prefix-cache state, and the PSS of socllm's processes idle before and a few
seconds after (`socllm status`). Exit status 1 if anything went wrong.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import subprocess
import sys
import threading
import time

import requests

from .agent_api_bench import SCHEMAS, TOOLS
from .serve_bench import DATA


class Run:
    def __init__(self, url: str):
        from openai import OpenAI
        self.url, self.words = url, open(DATA).read().split()
        self.oa = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        self.lock = threading.Lock()
        self.counts, self.wrong = collections.Counter(), []

    def text(self, n: int) -> str:
        lo = random.randrange(len(self.words) - n)
        return " ".join(self.words[lo:lo + n])

    def note(self, key: str, wrong: str | None = None):
        with self.lock:
            self.counts[key] += 1
            if wrong:
                self.wrong.append(f"{key}: {wrong[:400]}")

    def chat(self, **kw):
        return self.oa.chat.completions.create(model="socllm", **kw)

    # -- the kinds ---------------------------------------------------------------------------
    def plain(self):
        kw = dict(messages=[{"role": "user", "content": self.text(random.randint(3, 200))}],
                  max_tokens=random.randint(1, 96), temperature=random.choice([0, 0.7, 1.0]),
                  stop=random.choice([None, ["."], ["\n", "the"]]))
        if random.random() < 0.5:
            fin = [c.choices[0].finish_reason for c in self.chat(stream=True, **kw) if c.choices][-1]
        else:
            fin = self.chat(**kw).choices[0].finish_reason
        if fin not in ("stop", "length"):
            self.note("wrong", f"plain: finish_reason {fin}")

    def schema(self):
        import jsonschema
        s = random.choice(SCHEMAS)
        c = self.chat(messages=[{"role": "user", "content": "Give JSON about: " + self.text(20)}],
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": s, "strict": True}},
                      max_tokens=400, temperature=random.choice([0, 0.8])).choices[0]
        if c.finish_reason == "length":
            return self.note("cut_by_max_tokens")
        try:
            jsonschema.validate(json.loads(c.message.content), s)
        except Exception as e:
            self.note("wrong", f"schema: {e!r} in {c.message.content!r}")

    def tools(self):
        import jsonschema
        choice = random.choice(["required", "auto", {"type": "function", "function": {
            "name": TOOLS[0]["function"]["name"]}}])
        kw = dict(messages=[{"role": "user", "content": "Use a tool for: " + self.text(15)}],
                  tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=random.choice([0, 0.8]),
                  parallel_tool_calls=random.choice([True, False]))
        if random.random() < 0.4:
            calls, fin = {}, None
            for ch in self.chat(stream=True, **kw):
                for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                    e = calls.setdefault(tc.index, ["", ""])
                    e[0] += tc.function.name or "" if tc.function else ""
                    e[1] += tc.function.arguments or "" if tc.function else ""
                fin = (ch.choices[0].finish_reason if ch.choices else None) or fin
            got = list(calls.values())
        else:
            c = self.chat(**kw).choices[0]
            fin, got = c.finish_reason, [[t.function.name, t.function.arguments]
                                         for t in c.message.tool_calls or []]
        if fin == "length":
            return self.note("cut_by_max_tokens")
        if choice != "auto" and (fin != "tool_calls" or not got):
            self.note("wrong", f"tools {choice}: finish_reason {fin}, calls {got}")
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for name, args in got:
            try:
                jsonschema.validate(json.loads(args), params[name])
            except Exception as e:
                self.note("wrong", f"tool call {name}: {e!r}")

    def logprobs(self):
        r = self.chat(messages=[{"role": "user", "content": self.text(30)}],
                      max_tokens=random.randint(1, 40), logprobs=True,
                      top_logprobs=random.randint(0, 5), temperature=0)
        n, lp = r.usage.completion_tokens, r.choices[0].logprobs.content
        if len(lp) not in (n, n - 1):            # a stop token has no text, nor logprob entry
            self.note("wrong", f"logprobs: {len(lp)} entries for {n} tokens")

    def choices(self):
        n = random.randint(2, 4)
        r = self.chat(messages=[{"role": "user", "content": self.text(40)}], n=n, max_tokens=30,
                      temperature=0.9)
        if len(r.choices) != n:
            self.note("wrong", f"n={n}: {len(r.choices)} choices")

    def echo(self):
        r = requests.post(self.url + "/v1/completions", json={
            "prompt": self.text(50), "max_tokens": 1, "echo": True, "logprobs": 1}, timeout=300)
        if r.status_code != 200:
            self.note("wrong", f"echo: {r.status_code} {r.text}")

    def embed(self):
        r = self.oa.embeddings.create(model="socllm", input=[
            self.text(random.randint(1, 100)) for _ in range(random.randint(1, 6))])
        if any(abs(sum(x * x for x in d.embedding) - 1) > 1e-3 for d in r.data):
            self.note("wrong", "an embedding is not L2-normalized")

    def dropped(self):
        with requests.post(self.url + "/v1/chat/completions", stream=True, timeout=300, json={
                "messages": [{"role": "user", "content": self.text(100)}], "max_tokens": 200,
                "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > random.randint(0, 6):
                    break

    def second_turn(self):
        name = TOOLS[0]["function"]["name"]
        self.chat(messages=[
            {"role": "user", "content": "What does the tool say?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": self.text(20)},
            {"role": "user", "content": [{"type": "text", "text": "And so?"}]}],
            max_tokens=20, tools=TOOLS)

    BAD = [({"messages": [], "max_tokens": 5}, "no messages"),
           ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens -1"),
           ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "an unknown field"),
           ({"messages": [{"role": "user", "content": "hi"}], "response_format": {
               "type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "a bad schema"),
           ({"messages": [{"role": "user", "content": "hi " * 5000}]}, "over the context"),
           ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n 0"),
           ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "a string temperature"),
           ({"messages": [{"role": "tool", "content": "x"}]}, "a tool message answering no call"),
           ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "a bad tool"),
           ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 5}}, "a bad logit_bias"),
           ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
            "top_logprobs 50"),
           ({"messages": [{"role": "user", "content": "hi"}], "grammar": "root ::= ("}, "a bad grammar"),
           ("{not json", "a body that is not JSON")]

    def bad(self):
        body, what = random.choice(self.BAD)
        r = requests.post(self.url + "/v1/chat/completions", timeout=300,
                          data=body if isinstance(body, str) else json.dumps(body),
                          headers={"Content-Type": "application/json"})
        if not 400 <= r.status_code < 500:
            self.note("wrong", f"bad input ({what}): {r.status_code} {r.text}")


KINDS = {"plain": 4, "schema": 2, "tools": 2, "logprobs": 1, "choices": 1, "echo": 1, "embed": 1,
         "dropped": 2, "second_turn": 1, "bad": 2}


def status() -> dict:
    out = subprocess.run([sys.executable, "-m", "socllm.actors.front.cli", "status", "--json"],
                         capture_output=True, text=True, timeout=120)
    st = json.loads(out.stdout)
    return {"memory_pss_mb": st["memory_pss_mb"], "by_process": st["memory_pss_mb_by_process"],
            "requests": st["requests"], "kv": st["kv"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="agent_stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--json")
    a = p.parse_args(argv)
    run, before = Run(a.url), status()
    picks = [k for k, w in KINDS.items() for _ in range(w)]
    end = time.time() + 60 * a.minutes

    def client(i):
        random.seed(i)
        while time.time() < end:
            kind = random.choice(picks)
            try:
                getattr(run, kind)()
                run.note(kind)
            except Exception as e:
                run.note("wrong", f"{kind}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    time.sleep(5)                       # the idle loop gives memory back
    health = requests.get(a.url + "/health", timeout=30).json()
    out = {"minutes": a.minutes, "clients": a.clients, "counts": dict(run.counts),
           "wrong": run.wrong, "health": health, "before": before, "after": status()}
    print(json.dumps({k: v for k, v in out.items() if k != "wrong"}, indent=1))
    print("\n".join(run.wrong) or "nothing went wrong")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if run.wrong or health.get("status") != "ok" else 0


if __name__ == "__main__":
    sys.exit(main())
