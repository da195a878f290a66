"""`socllm generate` against a running service over its HTTP endpoint, without importing Ray.

Importing Ray and joining its cluster take ~0.5 s of a `generate` that a running service answers
in ~0.05 s. So `socllm serve` leaves a record of the service, and `generate` (streamed text, not
--json, which needs the token ids only Ray's path hands out) reads it and streams from the
service's OpenAI endpoint. Anything missing or not answering sends it back to Ray's path
(actors/front/serve.py generate_served), which finds out what runs.

The record: `<XDG_RUNTIME_DIR or /tmp>/socllm-<uid>/service-<cluster address>.json`, written by
`serve` and removed by `stop`; its folder 0700 and the file 0600, both this user's, or it is not
read (a record planted by another user redirects nothing). It holds the service's URL, its
process id and host (a record whose process has ended is passed over), what it runs (model,
plan, precision, placement: `generate --model/--plan/--precision` are checked against it as on
Ray's path) and whether HTTP needs an API key; never the key itself. With a key set, `generate`
sends SOCLLM_API_KEY from its environment, and takes Ray's path without one.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import sys
import urllib.parse

from socllm.policies.config import ServeConfig

from socllm.actors.front.cluster import NoCluster, find


SHAPING_OFF = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def shaping(a) -> dict:
    """generate's --top-k, --min-p and --repetition-penalty, where they ask for something."""
    return {k: getattr(a, k) for k, off in SHAPING_OFF.items() if getattr(a, k) != off}


def _folder() -> str:
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"socllm-{os.getuid()}")


def record_path(address: str) -> str:
    """The record of the service on the cluster at `address` (the form actors/front/cluster.py finds)."""
    return os.path.join(_folder(), "service-" + re.sub(r"[^A-Za-z0-9.-]", "_", address) + ".json")


def _own(path: str) -> bool:
    """Whether path is this user's and no one else may write it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def write_record(address: str, record: dict) -> str | None:
    """Write the record (atomically, 0600); None where its folder is not this user's alone."""
    folder = _folder()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return None
    if not _own(folder):
        return None
    path = record_path(address)
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record | {"host": socket.gethostname()}, f)
    os.replace(tmp, path)
    return path


def remove_record(address: str):
    try:
        os.unlink(record_path(address))
    except OSError:
        pass


def _alive(pid) -> bool:
    """Whether this user's process pid runs (another user's: PermissionError, not ours)."""
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def read_record(address: str) -> dict | None:
    """The record of a service that runs, else None (absent, not this user's alone, unreadable,
    of another host, or its process has ended)."""
    path = record_path(address)
    if not (_own(os.path.dirname(path)) and _own(path)):
        return None
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("host") != socket.gethostname() \
            or not _alive(rec.get("pid")) or not isinstance(rec.get("url"), str):
        return None
    return rec


def generate_direct(a) -> int | None:
    """Stream `socllm generate`'s request from the running service's HTTP endpoint; None where
    this path cannot (no record, --json, a key it lacks, the endpoint not answering)."""
    if a.json or a.local:
        return None
    try:
        address, _ = find(a.address)
    except NoCluster:
        return None                      # Ray's path says what was tried, or runs a private engine
    rec = read_record(address)
    key = ServeConfig.from_env().api_key             # SOCLLM_API_KEY
    if rec is None or rec.get("api_key") and not key:
        return None
    same_service(a, rec["model_path"], rec["plan"], rec["precision"], rec.get("hcmp_share"))
    body = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p,
            "seed": a.seed, "stop": a.stop, "priority": a.priority, "speculate": a.speculate,
            "stream": True, "stream_options": {"include_usage": True}, **shaping(a)}
    body = {k: v for k, v in body.items() if v is not None}
    if a.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": a.prompt}]
    else:
        path, body["prompt"] = "/v1/completions", a.prompt
    url = urllib.parse.urlsplit(rec["url"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        try:
            conn.request("POST", path, json.dumps(body), headers)
            resp = conn.getresponse()
        except OSError:
            return None                  # the endpoint went away: Ray's path finds out what runs
        if resp.status == 401:           # not this key: Ray's path, which needs none
            print(f"socllm: warning: the service's HTTP refused SOCLLM_API_KEY (401); asking it "
                  f"through Ray instead", file=sys.stderr)
            return None
        if resp.status != 200:
            raise ValueError(_error_of(resp))
        return _stream(resp, rec, a.chat)
    finally:
        conn.close()                     # Ctrl-C: the service cancels the request


def same_service(a, model_path: str, plan: str, precision: str, hcmp_share: float):
    """`generate`'s --model, --plan, --precision and --hcmp-share, where given, against the
    running service's (ValueError, pointing to --local, where one differs)."""
    for flag, mine, theirs in (("--model", a.model and os.path.realpath(a.model), model_path),
                               ("--plan", a.plan, plan), ("--precision", a.precision, precision),
                               ("--hcmp-share", a.hcmp_share, hcmp_share)):
        if mine is not None and mine != theirs:
            theirs = "as timed at its start" if theirs is None else theirs     # --hcmp-share
            raise ValueError(f"the running service uses {flag} {theirs}; add --local for a "
                             f"private engine with {flag} {mine}")


def timings_line(where: str, plan: str, placement: dict, precision: str, ttft_s: float,
                 prefill_tok_s: float, decode_tok_s: float, spec: dict | None) -> str:
    """The line `generate` writes on stderr after the text: how the request ran."""
    placed = "+".join(f"{k} {v}" for k, v in placement.items())
    drafts = f", drafts accepted {spec['accepted_prediction_tokens']}/" \
             f"{spec['accepted_prediction_tokens'] + spec['rejected_prediction_tokens']}" if spec else ""
    return (f"[{where}: {plan} ({placed}), {precision}: ttft {ttft_s * 1e3:.0f} ms, prefill "
            f"{prefill_tok_s:.1f} tok/s, decode {decode_tok_s:.1f} tok/s{drafts}]")


def _error_of(resp) -> str:
    raw = resp.read()
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"the service answered {resp.status} {resp.reason}"


def _stream(resp, rec: dict, chat: bool) -> int:
    """Write the text of the server-sent events as they come, then the timings line."""
    timings, usage = None, None
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise ValueError(ev["error"]["message"])
        for c in ev["choices"]:
            piece = (c["delta"].get("content") if chat else c["text"]) or ""
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
        timings, usage = ev.get("timings", timings), ev.get("usage") or usage
    sys.stdout.write("\n")
    if timings:
        ttft = timings["ttft_ms"] / 1e3
        prefill = usage["prompt_tokens"] / ttft if usage and ttft > 0 else 0.0   # as the service's
        print(timings_line("service over HTTP", rec["plan"], rec["placement"], rec["precision"], ttft,
                           prefill, timings["predicted_per_second"],
                           (usage or {}).get("completion_tokens_details")), file=sys.stderr)
    return 0
