"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment (FastAPI) in front of the service.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, then [DONE])
    GET  /v1/models   GET /v1/models/{id}   GET /metrics (Prometheus text)   GET /health (open)
    POST /tokenize   POST /detokenize   (llama.cpp's and vLLM's: a client counts its tokens)

The door: with an API key set (`socllm serve --api-key`, or SOCLLM_API_KEY), every route but
/health needs `Authorization: Bearer <key>` (401 otherwise). A body over --max-body-mb is refused
(413) before it is read whole; a request finding --max-waiting others waiting gets 429 with
Retry-After; a prompt over the context a 400 (the service refuses a text far too long before
tokenizing it, and tokenizes the rest beside its serving loop).

Bodies are checked here: malformed JSON, a field of the wrong type, an invalid value or a prompt
too long get a 400 with an OpenAI-style error object, never a 500, and nothing else is disturbed.
Extension fields: `priority` ("reactive" | "proactive"), `seed`, `ignore_eos` (as llama.cpp's),
`speculate` ("auto" | "lookup" | "off": this request's speculative decoding); in replies (and in
a stream's finish chunk) `timings` as llama.cpp's server gives them, and `ttft_ms`. A client that disconnects
mid-stream cancels its request: a task beside the handler waits for the ASGI disconnect message
(Serve behind its proxy does not cancel a streaming handler when the client leaves; polling
`request.is_disconnected()` between pieces missed 5 of 20 disconnects, a receive it cancels can
swallow the message). Still a few streams closed after their first token run on (1-3 of 20 on
Ray 2.5x; 1 of 50 and 0 of 30 on Ray 2.60): the disconnect never reaches the replica, which
polls on until the generation ends or Serve stops taking its pieces (then --abandon-s applies).
"""
import asyncio
import base64
import hmac
import json
import os
import re
import struct
import time
from contextlib import aclosing, asynccontextmanager

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from socllm.policies.request import ENDED, QueueFull

from socllm.actors.front import anthropic_api, ollama_api, responses
from socllm.actors.front.cluster import NAME, NAMESPACE

APP = "socllm"          # no `from __future__ import annotations` here: FastAPI reads the hints

app = FastAPI(title="socllm", docs_url=None, redoc_url=None)


@asynccontextmanager
async def _cancel_on_disconnect(request: Request, svc, fans: list):
    """While the body runs, a task waits for the client's disconnect and cancels the requests
    of fans (each prompt's choices: they grow as its choices past the first start)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for f in fans:
            for r in f:
                svc.cancel.remote(r)
    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


class _ClosingStream(StreamingResponse):
    """A streaming response that, however it ends, cancels its request (a no-op for one that
    ended) before anything that could be interrupted, then closes its body generator. Starlette
    cancels the streaming task when the client disconnects; cancelled inside `send`, the
    generator is left suspended at its `yield`, and cleanup that awaits may be cancelled again."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _error(message: str, param=None, status: int = 400, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None):
    """An OpenAI error object: message, type, param, code (OpenAI's codes where one applies)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def _code_of(message: str) -> str | None:
    """OpenAI's code for a service's ValueError, where one applies."""
    return "context_length_exceeded" if "context" in message and "hold" in message else None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it passes `limit` bytes: never read whole, never parsed."""
    said = request.headers.get("content-length")
    if said is not None and said.isdigit() and int(said) > limit:
        raise BadRequest(f"the body has {int(said)} bytes; this service takes at most {limit} "
                         f"(--max-body-mb)", status=413, code="request_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadRequest(f"the body passes {limit} bytes, the most this service takes "
                             f"(--max-body-mb)", status=413, code="request_too_large")
        parts.append(part)
    return b"".join(parts)


def _typed(body: dict, name: str, types, check=None, what: str = ""):
    """body[name] if present, of the right type (a bool is no number) and passing `check`."""
    v = body.get(name)
    if v is None:
        return None
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types) \
            or (check is not None and not check(v)):
        raise BadRequest(f"'{name}' must be {what}", name)
    return v


# the fields of an OpenAI body this service honours (parse; metadata labels a request and is
# kept nowhere, as OpenAI keeps it only with store), and those it takes only at the value that
# asks for nothing (what OpenAI's own clients send by default); any other field, or one of these
# at another value, is a 400 that names it: never a silent 200 for what was not done
HONOURED = {"model", "messages", "prompt", "n", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "seed", "priority", "stop", "stream", "ignore_eos", "user",
            "response_format", "grammar", "tools", "tool_choice", "parallel_tool_calls",
            "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
            "top_logprobs", "echo", "speculate", "top_k", "min_p", "repetition_penalty",
            "repeat_penalty", "min_tokens", "stop_token_ids", "prompt_logprobs",
            "continue_final_message", "add_generation_prompt", "prediction", "metadata"}
NEUTRAL = {"best_of": (1,), "suffix": ("",), "store": (False,)}   # store: nothing is kept
MAX_N = 8                 # choices of one request (they share the prompt's blocks: prefix cache)
MAX_BATCH = 64            # prompts of one completion request (vLLM's and OpenAI's batch)
MAX_CHOICES = 128         # prompts x n of one request (the service keeps 256 ended requests)
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


def _unhonoured(body: dict, chat: bool):
    """A 400 naming the first field the route does not honour (a chat's prompt, a completion's
    messages included)."""
    honoured = HONOURED - ({"prompt"} if chat else {"messages"})
    for name, value in body.items():
        if name in honoured or value is None or value in NEUTRAL.get(name, ()):
            continue
        raise BadRequest(f"'{name}' is not supported by {'chat' if chat else 'completion'} requests "
                         f"here (they honour {', '.join(sorted(honoured - {'user', 'model'}))})",
                         name, code="unsupported_parameter")


def _token_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in v)


def _only(body: dict, fields: set):
    """A 400 naming the first field of body not in fields."""
    for name in body:
        if name not in fields:
            raise BadRequest(f"'{name}' is not supported here (this route takes "
                             f"{', '.join(sorted(fields - {'model'}))})", name,
                             code="unsupported_parameter")


def _one_prompt(p) -> dict:
    """A completion's prompt: text, or token ids (OpenAI's tokenized prompt, checked by the
    service), as submit()'s argument."""
    if _token_ids(p):
        return {"ids": p}
    if not isinstance(p, str) or not p.strip():
        raise BadRequest("'prompt' must be a non-empty string, a list of token ids, or a list "
                         "of those (a batch)", "prompt")
    return {"prompt": p}


MAX_INPUTS = 256          # inputs of one embeddings request


def _embed_inputs(v) -> list:
    """OpenAI's embeddings input: a text, token ids, or a list of either -> submit()'s
    arguments, one per input."""
    batch = [v] if isinstance(v, str) or _token_ids(v) else v
    if not isinstance(batch, list) or not batch or len(batch) > MAX_INPUTS:
        raise BadRequest(f"'input' must be a non-empty string, a list of token ids, or a list of "
                         f"at most {MAX_INPUTS} of those", "input")
    out = []
    for x in batch:
        if not (_token_ids(x) or isinstance(x, str) and x.strip()):
            raise BadRequest("each 'input' must be a non-empty string or a list of token ids", "input")
        out.append({"ids": x} if _token_ids(x) else {"prompt": x})
    return out


def _encoded(v: list, fmt: str):
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32s."""
    return v if fmt == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()


def parse(body, chat: bool) -> dict:
    """An OpenAI request body -> the service's submit() arguments (BadRequest if invalid, or if
    it asks for what this service does not do)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _unhonoured(body, chat)
    _typed(body, "metadata", dict, lambda v: len(v) <= 16 and all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()), "an object of at most 16 string pairs")
    req = {}
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:      # each message is checked by the service
            raise BadRequest("'messages' must be a non-empty list of messages", "messages")
        req["messages"] = msgs
        if body.get("tools") == []:
            body = {k: v for k, v in body.items() if k not in CHAT_ONLY}
        for name in CHAT_ONLY:
            if body.get(name) is not None:
                req[name] = body[name]
    else:
        for name in CHAT_ONLY:
            if body.get(name) not in (None, []):
                raise BadRequest(f"'{name}' is for chat messages only, not a prompt", name,
                                 code="unsupported_parameter")
        prompt = body.get("prompt")
        batch = prompt if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _token_ids(p) for p in prompt) and not _token_ids(prompt) else [prompt]
        if len(batch) > MAX_BATCH:
            raise BadRequest(f"'prompt' holds {len(batch)} prompts; this service takes at most "
                             f"{MAX_BATCH} in one request", "prompt")
        batch = [_one_prompt(p) for p in batch]
        if len(batch) == 1:
            req.update(batch[0])
        else:
            req["batch"] = batch                         # a choice (or n) each, in order
    if _continuation(body, chat):
        req["continue_final_message"] = True
    if body.get("prediction") is not None:
        req["prediction"] = _prediction(body["prediction"])
    n = _typed(body, "n", int, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]")
    if n and n > 1:
        req["n"] = n
    # checked by the sampler (top_k, min_p and repetition_penalty: vLLM's and llama.cpp's extensions)
    for name in ("frequency_penalty", "presence_penalty", "logit_bias", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "stop_token_ids"):
        if body.get(name) is not None:
            req[name] = body[name]
    rp = _typed(body, "repeat_penalty", (int, float), lambda v: 0 < v <= 10,
                "a number in (0, 10] (1: off)")                   # llama.cpp's name for it
    if rp is not None:
        if req.get("repetition_penalty", rp) != rp:
            raise BadRequest("'repeat_penalty' and 'repetition_penalty' differ: give one",
                             "repeat_penalty")
        req["repetition_penalty"] = rp
    if chat:
        lp = _typed(body, "logprobs", bool, None, "a boolean")
        top = _typed(body, "top_logprobs", int, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        if top is not None and not lp:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if lp:
            req["logprobs"] = top or 0
        if _typed(body, "echo", bool, None, "a boolean"):      # vLLM's: the final assistant
            if lp or body.get("tools"):                        # message's text, then the reply
                raise BadRequest("'echo' on chat is taken without logprobs and tools", "echo")
            req["echo"] = True
    else:
        lp = _typed(body, "logprobs", int, lambda v: 0 <= v <= 5, "an integer in [0, 5]")
        if lp is not None:
            req["logprobs"] = lp
        if body.get("top_logprobs") is not None:
            raise BadRequest("'top_logprobs' is for chat; completions take 'logprobs': k", "top_logprobs")
        if _typed(body, "echo", bool, None, "a boolean"):
            req["echo"] = True
            if lp is not None:                   # OpenAI's: the echoed prompt's tokens' too
                if body.get("stream"):
                    raise BadRequest("'echo' with 'logprobs' (the prompt's logprobs) is answered "
                                     "in a reply that is not streamed", "stream")
                req["prompt_logprobs"] = lp
    pl = _typed(body, "prompt_logprobs", int, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    if pl is not None:                           # vLLM's: each prompt token's, and the top k's
        if body.get("stream"):
            raise BadRequest("'prompt_logprobs' is answered in a reply that is not streamed",
                             "prompt_logprobs")
        req["prompt_logprobs"] = max(pl, req.get("prompt_logprobs", 0))
        req["vllm_prompt_logprobs"] = pl         # the handler's: the service computes the larger
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        req["max_tokens"] = _typed({"max_tokens": mt}, "max_tokens", int, lambda v: v >= 1,
                                   "an integer >= 1")
    t = _typed(body, "temperature", (int, float), lambda v: 0 <= v <= 2, "a number in [0, 2]")
    if t is not None:
        req["temperature"] = float(t)
    p = _typed(body, "top_p", (int, float), lambda v: 0 < v <= 1, "a number in (0, 1]")
    if p is not None:
        req["top_p"] = float(p)
    seed = _typed(body, "seed", int, lambda v: v >= 0, "a non-negative integer")
    if seed is not None:
        req["seed"] = seed
    pr = _typed(body, "priority", str, lambda v: v in ("reactive", "proactive"),
                "'reactive' or 'proactive'")
    if pr is not None:
        req["priority"] = pr
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a non-empty string or a list of at most 4", "stop")
        req["stop"] = stop
    for name in ("response_format", "grammar"):          # checked (and compiled) by the service
        if body.get(name) is not None:
            req[name] = body[name]
    _typed(body, "stream", bool, None, "a boolean")
    _stream_options(body)
    if _typed(body, "ignore_eos", bool, None, "a boolean"):     # llama.cpp's extension
        req["ignore_eos"] = True
    spec = _typed(body, "speculate", str, None, "a string")    # checked by the service
    if spec is not None:
        req["speculate"] = spec
    return req


def _prediction(p) -> str:
    """OpenAI's Predicted Outputs, {type: content, content: text or text parts} -> the text."""
    c = p.get("content") if isinstance(p, dict) and p.get("type") == "content" else None
    if isinstance(c, list) and all(isinstance(x, dict) and x.get("type") == "text"
                                   and isinstance(x.get("text"), str) for x in c):
        c = "".join(x["text"] for x in c)
    if not isinstance(c, str):
        raise BadRequest("'prediction' must be {type: content, content: text or text parts}", "prediction")
    return c


def _continuation(body: dict, chat: bool) -> bool:
    """vLLM's continue_final_message (the reply continues the chat's final, assistant, message:
    checked by the service) and add_generation_prompt (true; false only with it)."""
    cont = _typed(body, "continue_final_message", bool, None, "a boolean")
    gen = _typed(body, "add_generation_prompt", bool, None, "a boolean")
    name = "continue_final_message" if cont else "add_generation_prompt"
    if not chat and (cont or gen is False):
        raise BadRequest(f"'{name}' is for chat messages only, not a prompt", name,
                         code="unsupported_parameter")
    if cont and gen:
        raise BadRequest("'continue_final_message' and 'add_generation_prompt' cannot both be "
                         "true: the reply continues the final message or starts a new one",
                         "add_generation_prompt")
    if gen is False and not cont:
        raise BadRequest("'add_generation_prompt': false is taken only with "
                         "'continue_final_message': true", "add_generation_prompt",
                         code="unsupported_parameter")
    return bool(cont)


def _stream_options(body: dict):
    """stream_options, as vLLM takes it: only on a stream; include_usage (a last chunk with the
    usage) and continuous_usage_stats (each chunk with its choice's usage so far), booleans."""
    opts = _typed(body, "stream_options", dict, None, "an object")
    if opts is None:
        return
    if not body.get("stream"):
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for k, v in opts.items():
        if k not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise BadRequest(f"'stream_options.{k}' is not supported by this service (it takes "
                             "include_usage and continuous_usage_stats)", f"stream_options.{k}")
        if not isinstance(v, bool):
            raise BadRequest(f"'stream_options.{k}' must be a boolean", f"stream_options.{k}")
        if k == "include_obfuscation" and v:        # OpenAI's padding: never added here
            raise BadRequest("'stream_options.include_obfuscation' true is not supported by this "
                             "service (it pads no chunk)", f"stream_options.{k}")


def _reason(out: dict) -> str:
    r = out["finish_reason"]
    return "stop" if r in ("stop", "cancelled", "abandoned") else r


def _message(text: str, out: dict) -> dict:
    """The assistant's message: its text, or (a request with tools) the calls it made."""
    said = out.get("message")
    if said is None:
        return {"role": "assistant", "content": text}
    msg = {"role": "assistant", "content": said["content"]}
    if said["tool_calls"]:
        msg["tool_calls"] = said["tool_calls"]
    return msg


async def _all(*aws) -> list:
    """asyncio.gather that lets every awaitable finish (or fail) before it raises the first
    failure: none goes on submitting or polling behind a reply that has already ended."""
    out = await asyncio.gather(*aws, return_exceptions=True)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _usage(each: list, n: int) -> dict:
    """A reply's usage from each choice's (n a prompt, prompts in order): the prompts' tokens
    once a prompt, every choice's completion tokens; the first prompt's cache details."""
    usage = dict(each[0])
    usage["prompt_tokens"] = sum(u["prompt_tokens"] for u in each[::n])
    usage["completion_tokens"] = sum(u["completion_tokens"] for u in each)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    for name, of in (("prompt_tokens_details", each[::n]), ("completion_tokens_details", each)):
        keys = {k: None for u in of for k in u.get(name) or {}}    # any choice's (the first's may
        if keys:                                                   # have none: it drafted none)
            usage[name] = {k: sum(u.get(name, {}).get(k, 0) for u in of) for k in keys}
    return usage


def _timings(out: dict) -> dict:
    """How a request ran, in the `timings` object llama.cpp's server adds to its replies:
    prompt_* its prefill (tokens not found in the prefix cache; from its first chunk to its first
    token), predicted_* its decoding (the tokens after the first); and ttft_ms, its time to first
    token from arrival, queueing included."""
    t, u = out.get("timings"), out.get("usage")
    if not t or not u:
        return {}
    pn = u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
    dn = max(0, u["completion_tokens"] - 1)
    return {"timings": {"prompt_n": pn, "prompt_ms": 1e3 * t["prefill_s"],
                        "prompt_per_second": pn / t["prefill_s"] if t["prefill_s"] > 0 else 0.0,
                        "predicted_n": dn, "predicted_ms": 1e3 * t["decode_s"],
                        "predicted_per_second": t["decode_tok_s"], "ttft_ms": 1e3 * t["ttft_s"]}}


def _refused(e: ray.exceptions.RayTaskError):
    """The service refused a request: 429 (its queue is full), 400 (bad input) or 503."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, QueueFull):
        return _error(str(cause), status=429, kind="rate_limit_error",
                      code="rate_limit_exceeded", headers={"Retry-After": "1"})
    if isinstance(cause, ValueError):
        line = str(cause).splitlines()[0]
        return _error(line, getattr(cause, "field", None), code=_code_of(line))
    return _error(f"the service failed: {type(cause or e).__name__}", status=503, kind="server_error")


def _logprobs(entries: list, chat: bool, offset: int, prompt: list | None = None, k: int = 0):
    """The tokens' logprobs in OpenAI's shapes: chat {content: [...]}; completions {tokens,
    token_logprobs, top_logprobs, text_offset} (offset: where the generated text starts; prompt:
    the echoed prompt's tokens' before them, from offset 0, the first's logprob None, each with
    its top k: the service may have computed more for vLLM's prompt_logprobs)."""
    if chat:
        return {"content": entries, "refusal": None}
    offsets = []
    for part, at in ((prompt or [], 0), (entries, offset)):
        for e in part:
            offsets.append(at)
            at += len(e["token"])
    entries = [dict(e, top_logprobs=e["top_logprobs"] and e["top_logprobs"][:k])
               for e in prompt or []] + entries
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else
                             {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _vllm_prompt(entries: list | None, k: int) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first), else {id: {logprob, rank,
    decoded_token}} of the token itself and of the k likeliest there (ranks 1 .. k)."""
    if entries is None:
        return None
    out = [None]
    for e in entries[1:]:
        d = {str(t["id"]): {"logprob": t["logprob"], "rank": j + 1, "decoded_token": t["token"]}
             for j, t in enumerate(e["top_logprobs"][:k])}
        d[str(e["id"])] = {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"]}
        out.append(d)
    return out


def _reshaped(out, body):
    """A route's answer; an error (an OpenAI error object) as body(that object, status) makes
    it, with its Retry-After and WWW-Authenticate headers."""
    if not (isinstance(out, JSONResponse) and out.status_code >= 400):
        return out
    return JSONResponse(body(json.loads(out.body), out.status_code), status_code=out.status_code,
                        headers=_kept(out))


def _renamed(out, names: dict):
    """A route's answer; its error (an OpenAI error object) naming the chat route's field in
    the caller's API's terms (names: the chat route's field -> that API's), in param and text."""
    if not (isinstance(out, JSONResponse) and out.status_code >= 400):
        return out
    err = json.loads(out.body)
    old = err["error"].get("param")
    if old not in names:
        return out
    new = names[old]                          # where the text names it: quoted, or first
    err["error"].update(param=new, message=re.sub(rf"^{re.escape(old)}\b|'{re.escape(old)}'",
                                                  lambda m: m[0].replace(old, new), err["error"]["message"]))
    return JSONResponse(err, status_code=out.status_code, headers=_kept(out))


def _kept(out) -> dict:
    """An error answer's headers that a reshaped one keeps: Retry-After, WWW-Authenticate."""
    return {k: v for k, v in out.headers.items() if k.lower() in ("retry-after", "www-authenticate")}


def _anthropic_error(out):
    """A route's answer, its error (if it is one) in Anthropic's shape."""
    return _reshaped(out, anthropic_api.error_body)


def _ollama_error(out):
    """A route's answer, its error (if it is one) in Ollama's shape: {"error": message}."""
    return _reshaped(out, lambda err, status: ollama_api.error_body(err["error"]["message"]))


def _shaped(request, out):
    """An error answer in the shape of the API the request's path belongs to."""
    path = request.url.path
    if path.startswith("/api/"):
        return _ollama_error(out)
    return _anthropic_error(out) if path.startswith("/v1/messages") else out


@app.exception_handler(Exception)
async def _unexpected(request, exc):      # never a bare 500 page: an error object
    return _shaped(request, _error(f"internal error: {type(exc).__name__}", status=500,
                                   kind="server_error"))


@app.exception_handler(StarletteHTTPException)
async def _no_route(request, exc):        # a path or method no route takes: not FastAPI's shape
    what = "no route" if exc.status_code == 404 else exc.detail
    return _shaped(request, _error(f"{what}: {request.method} {request.url.path}",
                                   status=exc.status_code, code="not_found" if exc.status_code == 404 else None))


# (everything the routes use is defined above: serve.ingress freezes a copy of the app, and
# of the globals its routes name, when the class below is decorated)
# graceful_shutdown_wait_loop_s: how often a replica being removed looks whether its requests
# are done (Serve's default, 2 s, was most of `socllm stop`'s time)
@serve.deployment(name="openai", num_replicas=1, max_ongoing_requests=1024,
                  ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=0.1)
@serve.ingress(app)
class OpenAIServer:
    """Forwards to the service actor; holds nothing but its handle."""

    def __init__(self, url: str = "", api_key: str | None = None, max_body: int = 4 << 20,
                 model: str | None = None):
        """model: the served model's file name (None: asked of the service, which must be up;
        `socllm serve` starts this while the service still loads it)."""
        import os
        self.svc = ray.get_actor(NAME, namespace=NAMESPACE)
        self.model = model or ray.get(self.svc.describe.remote())["model"]
        self.key, self.max_body = api_key, max_body
        self.context = None           # the service's, asked at the first /tokenize
        self.svc.register_frontend.remote("http", os.getpid(), url)

    def _locked(self, request: Request):
        """A 401 for a request without the API key (where one is set), else None."""
        if self.key is None:
            return None
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key.encode()):
            return None
        if hmac.compare_digest(request.headers.get("x-api-key", "").encode(), self.key.encode()):
            return None                  # Anthropic's clients send the key so
        return _error("a valid API key is needed: Authorization: Bearer <key>", status=401,
                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health(self):
        """Asks the service: 200 while its serving loop runs, else 503."""
        try:
            state = await asyncio.wait_for(self.svc.health.remote(), 5.0)
        except Exception as e:
            return _error(f"the service does not answer: {type(e).__name__}", status=503,
                          kind="server_error")
        return state if state["status"] == "ok" else JSONResponse(state, status_code=503)

    def _model(self) -> dict:
        return {"id": self.model, "object": "model", "owned_by": "socllm", "created": 0}

    @app.get("/v1/models")
    async def models(self, request: Request):
        return self._locked(request) or {"object": "list", "data": [self._model()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        if (locked := self._locked(request)) is not None:
            return locked
        if model_id != self.model:
            return _error(f"the model '{model_id}' does not exist (this service runs "
                          f"'{self.model}')", "model", status=404, code="model_not_found")
        return self._model()

    @app.get("/metrics")
    async def metrics(self, request: Request):
        return self._locked(request) or PlainTextResponse(
            await self.svc.prometheus.remote(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """llama.cpp's and vLLM's: {"content" or "prompt": text} or {"messages": [...]}, and
        add_special (default true) -> {"tokens", "count", "max_model_len"}."""
        async def run(body):
            _only(body, {"content", "prompt", "messages", "add_special", "model", "with_pieces",
                         "tools", "tool_choice", "continue_final_message", "add_generation_prompt"})
            if body.get("with_pieces"):
                raise BadRequest("'with_pieces' is not supported by this service", "with_pieces",
                                 code="unsupported_parameter")
            text = body.get("content", body.get("prompt"))
            add = _typed(body, "add_special", bool, None, "a boolean")
            cont = _continuation(body, body.get("messages") is not None)
            ids = await self.svc.tokenize.remote(text, body.get("messages"), add is not False,
                                                 body.get("tools"), body.get("tool_choice"), cont)
            if self.context is None:
                self.context = (await self.svc.describe.remote())["context"]
            return {"tokens": ids, "count": len(ids), "max_model_len": self.context}
        return await self._tool(request, run)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        """{"tokens": [ids]} -> {"content": text} (llama.cpp's), also as "prompt" (vLLM's)."""
        async def run(body):
            _only(body, {"tokens", "model"})
            text = await self.svc.detokenize.remote(body.get("tokens"))
            return {"content": text, "prompt": text}
        return await self._tool(request, run)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        """OpenAI's: {"input": text | ids | a list of those, "encoding_format": "float" |
        "base64"} -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
        "model", "usage"}; the extension "pooling": "mean" (default) | "last" (the prompt rows'
        final hidden states, L2-normalized: actors/engine.py _pool)."""
        async def run(body):
            _only(body, {"input", "model", "encoding_format", "user", "pooling"})
            inputs = _embed_inputs(body.get("input"))
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
            outs = await self._embed(inputs, body.get("pooling") or "mean")
            n = sum(o["usage"]["prompt_tokens"] for o in outs)
            return {"object": "list", "model": self.model,
                    "data": [{"object": "embedding", "index": i, "embedding": _encoded(o["embedding"], fmt)}
                             for i, o in enumerate(outs)],
                    "usage": {"prompt_tokens": n, "total_tokens": n}}
        return await self._tool(request, run)

    @app.post("/api/embed")
    async def ollama_embed(self, request: Request):
        """Ollama's: {"input": text | a list of texts} -> {"model", "embeddings", counts}, as
        /v1/embeddings computes them (mean pooling, L2-normalized)."""
        async def run(body):
            _only(body, {"model", "input", "truncate", "keep_alive", "options", "dimensions"})
            try:
                ollama_api.embed_check(body)
            except responses.Refused as e:
                raise BadRequest(str(e), e.param) from None
            t0 = time.perf_counter()
            inputs = _embed_inputs(body.get("input"))
            if _typed(body, "truncate", bool, None, "a boolean") is not False:
                inputs = await self._cut(inputs)          # Ollama's default: cut to fit
            outs = await self._embed(inputs, "mean")
            return {"model": self.model, "embeddings": [o["embedding"] for o in outs],
                    "total_duration": int(1e9 * (time.perf_counter() - t0)), "load_duration": 0,
                    "prompt_eval_count": sum(o["usage"]["prompt_tokens"] for o in outs)}
        return _ollama_error(await self._tool(request, run))

    async def _cut(self, inputs: list) -> list:
        """Ollama's truncate: each input as ids, its end cut to fit the context."""
        if self.context is None:
            self.context = (await self.svc.describe.remote())["context"]
        ids = [x.get("ids") or await self.svc.tokenize.remote(x["prompt"]) for x in inputs]
        return [{"ids": i[:self.context - 1]} for i in ids]

    async def _embed(self, inputs: list, pooling: str) -> list:
        """Each input's embedding (the service's answers): one request each, queued at once, so
        their rows share prefill chunks."""
        rids = []
        try:
            rids = await self.svc.submit_many.remote([{**x, "embed": pooling} for x in inputs])
            outs = [r[1] for r in await asyncio.gather(*(self._gather(rid) for rid in rids))]
        finally:
            for rid in rids:                         # a no-op for those that ended
                self.svc.cancel.remote(rid)
        for o in outs:
            if o.get("embedding") is None:          # failed or cancelled inside the service
                raise BadRequest(f"an input was not embedded ({o['state']}: {o.get('error')})",
                                 status=500)
        return outs

    async def _tool(self, request: Request, run):
        """A small JSON route: the key, the body's size and JSON, bad input as a 400."""
        if (locked := self._locked(request)) is not None:
            return locked
        try:
            raw = await _read_body(request, self.max_body)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            return await run(body)
        except BadRequest as e:
            return _error(str(e), e.param, e.status, code=e.code)
        except ray.exceptions.RayTaskError as e:        # the service's ValueError: a 400
            return _refused(e)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API, on the chat path (actors/front/responses.py); an error the
        chat path finds names the Responses field (max_output_tokens, not max_tokens)."""
        return _renamed(await self._serve(request, chat=True, api="responses"), responses.FIELD_OF)

    @app.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API, on the chat path (actors/front/anthropic_api.py); errors in
        its shape."""
        return _anthropic_error(await self._serve(request, chat=True, api="messages"))

    @app.post("/api/chat")
    async def ollama_chat(self, request: Request):
        """Ollama's chat API, on the chat path (actors/front/ollama_api.py); errors in its shape."""
        return _ollama_error(_renamed(await self._serve(request, chat=True, api="ollama"),
                                      ollama_api.FIELD_OF))

    @app.post("/api/generate")
    async def ollama_generate(self, request: Request):
        """Ollama's generate API: its prompt templated as a user turn (the chat path), or raw
        (the completion path)."""
        return _ollama_error(_renamed(await self._serve(request, chat=True, api="ollama generate"),
                                      ollama_api.FIELD_OF))

    @app.get("/api/tags")
    async def ollama_tags(self, request: Request):
        """Ollama's list of models: the one this service runs."""
        return _ollama_error(self._locked(request)) or {"models": [await self._ollama_model()]}

    @app.get("/api/ps")
    async def ollama_ps(self, request: Request):
        """Ollama's running models: the one this service runs, loaded for as long as it runs."""
        return _ollama_error(self._locked(request)) or {
            "models": [await self._ollama_model() | {"expires_at": None}]}

    @app.post("/api/show")
    async def ollama_show(self, request: Request):
        """Ollama's model details: its family, context length and what it can do."""
        async def run(body):
            _only(body, {"model", "name", "verbose"})
            d = await self.svc.describe.remote()
            return {"details": (await self._ollama_model())["details"],
                    "model_info": {"general.architecture": d["arch"], f"{d['arch']}.context_length": d["context"]},
                    "capabilities": ["completion", "tools"], "parameters": "", "modelfile": ""}
        return _ollama_error(await self._tool(request, run))

    @app.get("/api/version")
    async def ollama_version(self, request: Request):
        from importlib.metadata import version
        return _ollama_error(self._locked(request)) or {"version": version("socllm")}

    async def _ollama_model(self) -> dict:
        d = await self.svc.describe.remote()
        return {"name": self.model, "model": self.model, "size": os.path.getsize(d["model_path"]),
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(os.path.getmtime(d["model_path"]))),
                "digest": "", "details": {"format": "gguf", "family": d["arch"], "families": [d["arch"]],
                                          "parameter_size": "", "quantization_level": ""}}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        """Anthropic's: the input tokens a Messages request would start from (its system prompt,
        messages and tools through the model's template), as /tokenize counts them."""
        async def run(body):
            try:
                chat = anthropic_api.to_chat(body, count=True)
            except anthropic_api.Refused as e:
                raise BadRequest(str(e), e.param) from None
            ids = await self.svc.tokenize.remote(None, chat["messages"], True, chat.get("tools"),
                                                 chat.get("tool_choice"),
                                                 chat.get("continue_final_message", False))
            return {"input_tokens": len(ids)}
        return _anthropic_error(await self._tool(request, run))

    async def _serve(self, request: Request, chat: bool, api: str = ""):
        if (locked := self._locked(request)) is not None:
            return locked
        try:
            raw = await _read_body(request, self.max_body)
        except BadRequest as e:
            return _error(str(e), e.param, e.status, code=e.code)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return _error(f"the body is not valid JSON: {e}")
        asked = body
        if api:
            front = {"responses": responses, "messages": anthropic_api}.get(api, ollama_api)
            try:
                body = front.to_chat(body, generate=True) if api == "ollama generate" else front.to_chat(body)
            except responses.Refused as e:          # (anthropic_api's and ollama_api's too)
                return _error(str(e), e.param, code=e.code)
            if body.get("load"):                    # Ollama's "load a model"
                return JSONResponse(ollama_api.loaded(self.model, api == "ollama generate"))
            chat = "messages" in body               # a raw /api/generate: the completion path
        subs, rids = [], []
        try:
            args = parse(body, chat)
            n, echo = args.pop("n", 1), args.pop("echo", False)
            vllm_k = args.pop("vllm_prompt_logprobs", None)
            subs = [dict(args, **one) for one in args.pop("batch", [{}])]   # a prompt each
            if len(subs) * n > MAX_CHOICES:
                raise BadRequest(f"{len(subs)} prompts x n {n} = {len(subs) * n} choices; this "
                                 f"service gives at most {MAX_CHOICES} in one request", "n")
            for sub in subs:
                rids.append(await self.svc.submit.remote(**sub))
            echoes = [await self._echo(sub) if echo else None for sub in subs]
        except BaseException as e:
            for r in rids:                               # a batch's prompts taken before it
                self.svc.cancel.remote(r)
            if isinstance(e, BadRequest):
                return _error(str(e), e.param, e.status, code=e.code)
            if isinstance(e, ray.exceptions.RayTaskError):
                return _refused(e)
            raise
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rids[0]}", "created": int(time.time()),
                "model": self.model,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        shape = {"chat": chat, "logprobs": args.get("logprobs") is not None, "echo": echoes,
                 "hold": "tools" in args and args.get("tool_choice") != "none"}
        fans = [[r] for r in rids]         # each prompt's choices: its n requests, as they start
        if body.get("stream"):
            chunks = self._events(fans, meta, shape, request, body.get("stream_options") or {},
                                  (subs, n))
            if api == "responses":
                chunks = responses.events(asked, self.model, chunks)
            elif api == "messages":
                chunks = anthropic_api.events(self.model, chunks)
            elif api:
                chunks = ollama_api.events(self.model, chunks, chat, api == "ollama generate")
            return _ClosingStream(chunks,
                                  lambda: [self.svc.cancel.remote(r) for f in fans for r in f],
                                  media_type="application/x-ndjson" if api.startswith("ollama")
                                  else "text/event-stream")
        async def choices_of(f: list, sub: dict) -> list:
            """A prompt's n choices, each read from its start (a request nobody polls is
            abandoned after abandon_s)."""
            first = asyncio.create_task(self._gather(f[0]))
            try:
                await self._more(f, sub, n)
            except BaseException:
                first.cancel()
                raise
            return await _all(first, *(self._gather(r) for r in f[1:]))
        try:
            async with _cancel_on_disconnect(request, self.svc, fans):
                parts = await _all(*(choices_of(f, sub) for f, sub in zip(fans, subs)))
                results = [r for part in parts for r in part]
        except ray.exceptions.RayTaskError as e:
            return _refused(e)
        finally:
            for f in fans:
                for r in f:
                    self.svc.cancel.remote(r)           # a no-op for those that ended
        choices = []
        for i, (text, out, lps) in enumerate(results):
            if out["state"] == "failed":
                return _error(f"generation failed: {out['error']}", status=500, kind="server_error")
            echoed = echoes[i // n] or ""
            prompt_lps = results[i - i % n][1].get("prompt_logprobs")   # the prompt's first choice's
            choice = {"index": i, "finish_reason": _reason(out), "stop_reason": out.get("stop_string"),
                      "logprobs": _logprobs(lps, chat, len(echoed), echoed and prompt_lps,
                                            args.get("logprobs"))
                      if shape["logprobs"] else None}
            choice.update({"message": _message(echoed + text, out)} if chat else {"text": echoed + text})
            if vllm_k is not None and not chat:
                choice["prompt_logprobs"] = _vllm_prompt(prompt_lps, vllm_k)
            choices.append(choice)
        more = {"prompt_logprobs": _vllm_prompt(results[0][1].get("prompt_logprobs"), vllm_k)} \
            if vllm_k is not None and chat else {}             # vLLM's: the response's, in chat
        reply = {**meta, "object": "chat.completion" if chat else "text_completion",
                 "choices": choices, **more, "usage": _usage([r[1]["usage"] for r in results], n),
                 **_timings(results[0][1])}
        return responses.reply(asked, self.model, reply) if api == "responses" else \
            anthropic_api.reply(self.model, reply) if api == "messages" else \
            ollama_api.reply(self.model, reply, api == "ollama generate") if api else reply

    async def _echo(self, sub: dict) -> str:
        """A completion's prompt as its text (echo): as given, or its token ids detokenized; a
        chat's final message where it is the assistant's (vLLM's: what the reply continues)."""
        if "messages" in sub:
            last = sub["messages"][-1]
            c = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else ""
            if isinstance(c, list):                  # text parts, as vLLM joins them
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
            return c if isinstance(c, str) else ""
        return sub["prompt"] if "prompt" in sub else await self.svc.detokenize.remote(sub["ids"])

    async def _gather(self, rid: str) -> tuple:
        """A request's whole text, its last poll and its tokens' logprobs."""
        text, out, lps = "", None, []
        async with aclosing(self._polls(rid)) as polls:
            async for out in polls:
                text += "".join(out["pieces"])
                lps += out.get("logprobs", [])
        return text, out, lps

    def _polls(self, rid: str):
        """The request's polls (actors/front/client.py apolls: leaving early cancels the request)."""
        from socllm.actors.front.client import Client
        return Client(self.svc).apolls(rid)

    async def _more(self, rids: list, args: dict, n: int):
        """The 2nd .. nth choice of a request (n), appended to rids once the first has its first
        token: its prompt's blocks are in the prefix cache by then, so they prefill none of it
        again. Each its own seed where one was given (seed + i)."""
        if n > 1:
            await self.svc.poll.remote(rids[0], 0, 600.0, 0.0)
            args = {k: v for k, v in args.items() if k != "prompt_logprobs"}   # the first's serve
            for i in range(1, n):
                more = dict(args, seed=args["seed"] + i) if args.get("seed") is not None else args
                rids.append(await self.svc.submit.remote(**more, queue_bound=False))

    async def _events(self, fans: list, meta: dict, shape: dict, request: Request,
                      opts: dict, fan: tuple):
        """Server-sent events as OpenAI streams them: per choice, a chunk per piece (per poll's
        pieces, with their tokens' logprobs, where asked) and one with its finish reason; then
        (stream_options.include_usage) one with no choices and the usage; with
        stream_options.continuous_usage_stats (vLLM's), each chunk after the first also carries its
        choice's usage so far. A request with tools
        (shape["hold"]): its JSON is read at the end, then sent as the reply's text or as its
        tool calls, each call whole in one delta. fans: each prompt's requests (a batch of
        prompts: one each); fan: (each prompt's submit arguments, n): a prompt's other choices
        start after its first's first token (_more). Choice p n + j is prompt p's j-th; their
        chunks interleave, told apart by index."""
        chat = shape["chat"]
        at = {}                                    # choice -> its logprobs' text sent so far

        def event(i, delta, reason=None, first=False, lps=None, extra=None, matched=None):
            if chat:
                d = ({"role": "assistant", "content": None if shape["hold"] else ""} if first else
                     delta if isinstance(delta, dict) else
                     {"content": delta} if delta is not None else {})
                choice = {"index": i, "delta": d, "finish_reason": reason,
                          "logprobs": _logprobs(lps, True, 0) if lps else None}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": reason,
                          "logprobs": _logprobs(lps, False, at.get(i, 0)) if lps else None}
                at[i] = at.get(i, 0) + sum(len(e["token"]) for e in lps or ())
            if reason is not None:
                choice["stop_reason"] = matched     # vLLM's: the stop string that ended it, or null
            return f"data: {json.dumps({**meta, 'choices': [choice], **(extra or {})})}\n\n"

        def said(i, out):
            """The chunks of one poll of choice i."""
            so_far = {"usage": out["usage"]} if opts.get("continuous_usage_stats") and \
                opts.get("include_usage") and out.get("usage") else {}
            if shape["hold"]:
                if so_far and not out["state"] in ENDED:   # the usage so far, the text held
                    yield event(i, {}, extra=so_far)
            elif out["pieces"] or out.get("logprobs"):    # one chunk a poll: each costs CPU
                yield event(i, "".join(out["pieces"]), lps=out.get("logprobs"), extra=so_far)
            if out["state"] in ENDED and out.get("message"):
                msg = out["message"]
                if msg["tool_calls"]:
                    yield event(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]},
                                extra=so_far)
                elif msg["content"]:
                    yield event(i, msg["content"], extra=so_far)
            if out["state"] == "failed":
                err = {"error": {"message": f"generation failed: {out['error']}",
                                 "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
            elif out["state"] in ENDED:
                yield event(i, None, _reason(out), extra=_timings(out) | so_far,
                            matched=out.get("stop_string"))

        queue: asyncio.Queue = asyncio.Queue()

        async def follow(i: int, rid: str):
            # aclosing: when Serve closes this stream (the client went away), _polls' `finally`
            # cancels the request now, not whenever the event loop collects the generator
            try:
                async with aclosing(self._polls(rid)) as polls:
                    async for out in polls:
                        await queue.put((i, out))
            except Exception as e:           # said as a failed choice, never lost
                await queue.put((i, {"pieces": [], "state": "failed", "error": str(e)}))

        subs, n = fan
        tasks = []
        try:
            async with _cancel_on_disconnect(request, self.svc, fans):
                for i in range(len(fans) * n):
                    if chat:
                        yield event(i, None, first=True)
                    if shape["echo"][i // n]:
                        yield event(i, shape["echo"][i // n])
                async def fan_out(p: int, f: list, sub: dict):
                    await self._more(f, sub, n)       # each choice followed once it starts
                    tasks.extend(asyncio.create_task(follow(p * n + j, r))
                                 for j, r in enumerate(f[1:], 1))
                tasks += [asyncio.create_task(follow(p * n, f[0])) for p, f in enumerate(fans)]
                await _all(*(fan_out(p, f, sub) for p, (f, sub) in enumerate(zip(fans, subs))))
                ended, usage = 0, [None] * (len(fans) * n)
                while ended < len(usage):
                    i, out = await queue.get()
                    for chunk in said(i, out):
                        yield chunk
                    if out["state"] in ENDED:
                        ended += 1
                        usage[i] = out.get("usage")
                if opts.get("include_usage") and usage[0] is not None:   # a failed choice's counts as none
                    usage = [u or {"prompt_tokens": 0, "completion_tokens": 0} for u in usage]
                    yield f"data: {json.dumps({**meta, 'choices': [], 'usage': _usage(usage, n)})}\n\n"
        finally:
            for t in tasks:
                t.cancel()
        yield "data: [DONE]\n\n"


def deploy(host: str, port: int, api_key: str | None = None, max_body_mb: float = 4.0,
           model: str | None = None) -> str:
    """Start Serve's HTTP proxy on host:port (if Serve is not running yet) and the ingress
    (model: the served model's file name, where the service may not be up yet)."""
    url = f"http://{host}:{port}"
    serve.start(http_options={"host": host, "port": port})
    serve.run(OpenAIServer.bind(url, api_key, int(max_body_mb * 2**20), model), name=APP,
              route_prefix="/")
    return url


def undeploy():
    """Remove the ingress; shut Serve down too when socllm's was its only application."""
    try:
        apps = serve.status().applications
    except Exception:
        return
    if not set(apps) - {APP}:
        serve.shutdown()            # removes the ingress with Serve's own actors
        return
    if APP in apps:                 # Serve's blocking delete looks once a second
        serve.delete(APP, _blocking=False)
        end = time.monotonic() + 60
        while APP in serve.status().applications and time.monotonic() < end:
            time.sleep(0.05)
