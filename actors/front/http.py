"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment (FastAPI) in front of the service.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, then [DONE])
    GET  /v1/models             GET  /health           GET  /metrics (Prometheus text)

Bodies are checked here: malformed JSON, a field of the wrong type, an invalid value or a prompt
too long get a 400 with an OpenAI-style error object, never a 500, and nothing else is disturbed.
Extension fields: `priority` ("reactive" | "proactive"), `seed`, `ignore_eos` (as llama.cpp's). A client that disconnects
mid-stream cancels its request: a task beside the handler waits for the ASGI disconnect message
(Serve behind its proxy does not cancel a streaming handler when the client leaves; polling
`request.is_disconnected()` between pieces missed 5 of 20 disconnects, a receive it cancels can
swallow the message). Still a few streams closed after their first token run on (1-3 of 20 on
Ray 2.5x; 1 of 50 and 0 of 30 on Ray 2.60): the disconnect never reaches the replica, which
polls on until the generation ends or Serve stops taking its pieces (then --abandon-s applies).
"""
import asyncio
import json
import time
from contextlib import aclosing, asynccontextmanager

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from socllm.policies.request import ENDED

from socllm.actors.service import NAME, NAMESPACE

APP = "socllm"          # no `from __future__ import annotations` here: FastAPI reads the hints

app = FastAPI(title="socllm", docs_url=None, redoc_url=None)


@asynccontextmanager
async def _cancel_on_disconnect(request: Request, svc, rid: int):
    """While the body runs, a task waits for the client's disconnect and cancels request rid."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        svc.cancel.remote(rid)
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
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _error(message: str, param=None, status: int = 400, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status)


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


# the fields of an OpenAI body this service honours (parse), and those it takes only at the value
# that asks for nothing (what OpenAI's own clients send by default); any other field, or one of
# these at another value, is a 400 that names it: never a silent 200 for what was not done
HONOURED = {"model", "messages", "prompt", "n", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "seed", "priority", "stop", "stream", "ignore_eos", "user"}
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False, 0),
           "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
           "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
           "suffix": ("",), "stream_options": ({"include_usage": False}, {"include_usage": True}),
           "parallel_tool_calls": (True, False)}


def _unhonoured(body: dict):
    for name, value in body.items():
        if name in HONOURED or value is None or value in NEUTRAL.get(name, ()):
            continue
        raise BadRequest(f"'{name}' is not supported by this service (it honours "
                         f"{', '.join(sorted(HONOURED - {'user', 'model'}))})", name)


def parse(body, chat: bool) -> dict:
    """An OpenAI request body -> the service's submit() arguments (BadRequest if invalid, or if
    it asks for what this service does not do)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _unhonoured(body)
    req = {}
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of {role, content} strings", "messages")
        req["messages"] = [{"role": m["role"], "content": m["content"]} for m in msgs]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRequest("'prompt' must be a non-empty string", "prompt")
        req["prompt"] = prompt
    _typed(body, "n", int, lambda v: v == 1, "1 (one choice per request)")
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
    _typed(body, "stream", bool, None, "a boolean")
    if _typed(body, "ignore_eos", bool, None, "a boolean"):     # llama.cpp's extension
        req["ignore_eos"] = True
    return req


@serve.deployment(name="openai", num_replicas=1, max_ongoing_requests=1024,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIServer:
    """Forwards to the service actor; holds nothing but its handle."""

    def __init__(self, url: str = ""):
        import os
        self.svc = ray.get_actor(NAME, namespace=NAMESPACE)
        self.model = ray.get(self.svc.describe.remote())["model"]
        self.svc.register_frontend.remote("http", os.getpid(), url)

    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "socllm",
                                            "created": 0}]}

    @app.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(await self.svc.prometheus.remote(),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return _error(f"the body is not valid JSON: {e}")
        try:
            args = parse(body, chat)
            rid = await self.svc.submit.remote(**args)
        except BadRequest as e:
            return _error(str(e), e.param, e.status)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                return _error(str(cause).splitlines()[0])
            return _error(f"the service failed: {type(cause or e).__name__}", status=503,
                          kind="server_error")
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()),
                "model": self.model,
                "object": "chat.completion.chunk" if chat else "text_completion"}
        if body.get("stream"):
            return _ClosingStream(self._events(rid, meta, chat, request),
                                  lambda: self.svc.cancel.remote(rid), media_type="text/event-stream")
        text, out = "", None
        async with _cancel_on_disconnect(request, self.svc, rid), aclosing(self._polls(rid)) as polls:
            async for out in polls:
                text += "".join(out["pieces"])
        if out["state"] == "failed":
            return _error(f"generation failed: {out['error']}", status=500, kind="server_error")
        reason = "stop" if out["finish_reason"] in ("stop", "cancelled", "abandoned") else out["finish_reason"]
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {**meta, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": out["usage"]}

    def _polls(self, rid: int):
        """The request's polls (actors/front/client.py apolls: leaving early cancels the request)."""
        from socllm.actors.front.client import Client
        return Client(self.svc).apolls(rid)

    async def _events(self, rid: int, meta: dict, chat: bool, request: Request):
        def event(delta: str | None, reason=None, usage=None, first=False):
            if chat:
                d = ({"role": "assistant", "content": ""} if first else
                     {"content": delta} if delta is not None else {})
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            chunk = {**meta, "choices": [choice]}
            if usage is not None:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk)}\n\n"

        if chat:
            yield event(None, first=True)
        # aclosing: when Serve closes this stream (the client went away), _polls' `finally`
        # cancels the request now, not whenever the event loop collects the generator
        async with _cancel_on_disconnect(request, self.svc, rid), aclosing(self._polls(rid)) as polls:
            async for out in polls:
                for piece in out["pieces"]:
                    yield event(piece)
                if out["state"] in ENDED:
                    if out["state"] == "failed":
                        err = {"error": {"message": f"generation failed: {out['error']}",
                                         "type": "server_error", "param": None, "code": None}}
                        yield f"data: {json.dumps(err)}\n\n"
                    else:
                        reason = ("stop" if out["finish_reason"] in ("stop", "cancelled", "abandoned")
                                  else out["finish_reason"])
                        yield event(None, reason, out["usage"])
        yield "data: [DONE]\n\n"


@app.exception_handler(Exception)
async def _unexpected(request, exc):      # never a bare 500 page: an OpenAI-style error object
    return _error(f"internal error: {type(exc).__name__}", status=500, kind="server_error")


def deploy(host: str, port: int) -> str:
    """Start Serve's HTTP proxy on host:port (if Serve is not running yet) and the ingress."""
    url = f"http://{host}:{port}"
    serve.start(http_options={"host": host, "port": port})
    serve.run(OpenAIServer.bind(url), name=APP, route_prefix="/")
    return url


def undeploy():
    """Remove the ingress; shut Serve down too when socllm's was its only application."""
    try:
        apps = serve.status().applications
    except Exception:
        return
    if APP in apps:
        serve.delete(APP)
    if not set(apps) - {APP}:
        serve.shutdown()
