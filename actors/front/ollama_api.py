"""Ollama's native API (`/api/chat`, `/api/generate`; what Ollama's own clients, LangChain's
ChatOllama and the tools that speak only Ollama send) on the chat and completion routes: a
request becomes the chat route's body (`to_chat`), the chat reply a response object (`reply`)
and its stream of chunks Ollama's newline-delimited JSON objects (`events`). Pure: no Ray.

As Ollama: streams by default (`stream: false` for one object), `options` for sampling,
`format` "json" or a JSON schema, tool calls with their arguments as objects, tool results
named by `tool_name` (or `tool_call_id`), durations in nanoseconds. `/api/generate` templates
its prompt as one user turn (after `system`), unless `raw`. What this service does not do is a
400 naming it: images, `think` for these models that do not think, `suffix`, `template`,
`context`, `keep_alive` 0 (the model stays loaded), options it does not take (`num_ctx`: the
context is the service's `--context`)."""
from __future__ import annotations

import json
import re
import time
from contextlib import aclosing

from socllm.actors.front.responses import Refused, chat_chunks

# options -> the chat route's fields
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "seed": "seed", "num_predict": "max_tokens", "stop": "stop",
           "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
# the chat route's fields -> Ollama's, for the errors the chat route finds
FIELD_OF = {v: f"options.{k}" for k, v in OPTIONS.items()} | {"response_format": "format"}
CHAT = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think",
        "logprobs", "top_logprobs", "truncate", "shift"}
GENERATE = {"model", "prompt", "system", "raw", "format", "options", "stream", "keep_alive",
            "think", "logprobs", "top_logprobs", "suffix", "images", "template", "context",
            "truncate", "shift"}
# taken only at the value that asks for nothing this service does not do
NEUTRAL = {"think": (False,), "truncate": (False,), "shift": (False,), "suffix": ("",),
           "images": ([],), "template": ("",), "context": ([],)}


def to_chat(body, generate: bool = False) -> dict:
    """An /api/chat (or /api/generate) request -> the chat route's body (the completion route's:
    a raw generate, with "prompt"); Refused if it asks for what is not done."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    for name, value in body.items():
        if name not in (GENERATE if generate else CHAT) or (
                name in NEUTRAL and value is not None and value not in NEUTRAL[name]):
            raise Refused(f"'{name}' is not supported by this service"
                          + (": its models do not think" if name == "think" else ""), name)
    _keep_alive(body.get("keep_alive"))
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise Refused("'stream' must be a boolean", "stream")
    if (body.get("prompt") in (None, "") and not body.get("images")) if generate else body.get("messages") == []:
        return {"load": True}                     # Ollama's "load a model": it is loaded
    out = _generate(body) if generate else {"messages": _messages(body.get("messages"))}
    if body.get("tools"):
        out["tools"] = body["tools"]              # OpenAI's shape: {type: function, function}
    out.update(_options(body.get("options")))
    if body.get("format") not in (None, ""):    # "": none, as Ollama takes it
        out["response_format"] = _format(body["format"])
    if body.get("logprobs"):
        if "messages" not in out:
            raise Refused("'logprobs' is taken with a templated prompt here (not raw)", "logprobs")
        out.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    if body.get("stream", True) is not False:
        out.update(stream=True, stream_options={"include_usage": True})
    return out


DURATION = re.compile(r"-?(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))+|-?\d+(\.\d*)?")


def _keep_alive(v):
    """keep_alive (seconds, or a duration as Go writes it, "5m", "1h30m"; negative: forever):
    how long the model stays loaded after the request; here it always is, so any duration holds
    but zero (unload now)."""
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float, str)) or \
            isinstance(v, str) and not DURATION.fullmatch(v.strip()):
        raise Refused("'keep_alive' must be a number of seconds or a duration such as \"5m\"", "keep_alive")
    if not any(float(x) for x in re.findall(r"\d+(?:\.\d*)?", str(v))):
        raise Refused("'keep_alive' 0 asks to unload the model: this service keeps it loaded "
                      "(`socllm stop` removes the service)", "keep_alive")


def _generate(body: dict) -> dict:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise Refused("'prompt' must be a string", "prompt")
    if body.get("raw"):
        if body.get("system"):
            raise Refused("'system' is not applied to a raw prompt", "system")
        return {"prompt": prompt}
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise Refused("'system' must be a string", "system")
    return {"messages": ([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": prompt}]}


def _messages(msgs) -> list:
    """Ollama's messages -> the chat route's: tool calls given ids where they have none (tool
    results name their call by tool_call_id, or by tool_name: the earliest unanswered call of
    that tool), arguments as JSON text."""
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise Refused("'messages' must be a non-empty list of messages", "messages")
    out, pending = [], []          # [(call id, tool name)] of the latest calls, not answered yet
    for i, m in enumerate(msgs):
        role = str(m.get("role", "")).lower()
        if m.get("images") or m.get("thinking"):
            raise Refused(f"'messages' message {i}: {'images' if m.get('images') else 'thinking'} are not "
                          "supported by this service", "messages")
        if role not in ("system", "user", "assistant", "tool"):
            raise Refused(f"'messages' message {i}: role must be system, user, assistant or tool", "messages")
        msg = {"role": role, "content": m.get("content") or ""}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, i, k) for k, c in enumerate(m["tool_calls"])]
            msg["content"] = msg["content"] or None
            pending = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        elif role == "tool":
            msg["tool_call_id"] = _answered(m, pending, i)
        out.append(msg)
    return out


def _call(c, i: int, k: int) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise Refused(f"'messages' message {i}: tool_calls must each be {{function: {{name, arguments}}}}", "messages")
    args = f.get("arguments", {})
    return {"id": c.get("id") or f"call_{i}_{k}", "type": "function",
            "function": {"name": f["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _answered(m: dict, pending: list, i: int) -> str:
    """The call a tool result answers: its tool_call_id, else the earliest unanswered call of its
    tool_name (or of any tool, without one)."""
    for k, (cid, name) in enumerate(pending):
        by_id = m.get("tool_call_id")
        if (by_id == cid) if by_id else m.get("tool_name") in (None, name):
            del pending[k]
            return cid
    raise Refused(f"'messages' message {i}: a tool result must answer a tool call of an earlier assistant "
                  "message (by tool_call_id or tool_name)", "messages")


def _options(opts) -> dict:
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise Refused("'options' must be an object", "options")
    bad = [k for k, v in opts.items() if k not in OPTIONS and v is not None]
    if bad:
        raise Refused(f"'options.{bad[0]}' is not supported by this service (it takes "
                      f"{', '.join(OPTIONS)}" + ("; the context is the service's --context"
                                                   if bad[0] == "num_ctx" else "") + ")",
                      f"options.{bad[0]}")
    out = {OPTIONS[k]: v for k, v in opts.items() if v is not None}
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:
        del out["max_tokens"]                    # -1: as long as the context allows
    return out


def _format(fmt) -> dict:
    """Ollama's format: "json", or a schema read as llama.cpp's converter reads it (Ollama's
    grammar): an object takes no keys beyond those it names unless additionalProperties says so,
    the chat route's strict schema."""
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt, "strict": True}}
    raise Refused("'format' must be \"json\" or a JSON schema", "format")


def _now() -> str:
    ns = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def _metrics(usage: dict | None, timings: dict | None) -> dict:
    """Ollama's counts and durations (ns): the prompt's tokens evaluated (those the prefix cache
    did not hold) and the reply's, from the chat route's usage and timings."""
    u, t = usage or {}, timings or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    first, rest = t.get("ttft_ms", 0.0), t.get("predicted_ms", 0.0)
    return {"total_duration": int(1e6 * (first + rest)), "load_duration": 0,
            "prompt_eval_count": u.get("prompt_tokens", 0) - cached,
            "prompt_eval_duration": int(1e6 * t.get("prompt_ms", 0.0)),
            "eval_count": u.get("completion_tokens", 0), "eval_duration": int(1e6 * rest)}


def _said(generate: bool, text: str, calls=None) -> dict:
    if generate:
        return {"response": text}
    msg = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [{"id": c["id"], "function": {"index": k, "name": c["function"]["name"],
                                                          "arguments": _args(c["function"]["arguments"])}}
                             for k, c in enumerate(calls)]
    return {"message": msg}


def _args(text: str):
    try:
        return json.loads(text or "{}")
    except ValueError:
        return {}


def _logprobs(lps: list) -> dict:
    return {"logprobs": lps} if lps else {}


def reply(model: str, chat: dict, generate: bool = False) -> dict:
    """A chat (or completion) reply, one choice -> Ollama's response object: /api/chat's
    message, or (generate) /api/generate's response."""
    choice = chat["choices"][0]
    is_chat = "message" in choice
    text = choice["message"].get("content") or "" if is_chat else choice["text"]
    lps = (choice.get("logprobs") or {}).get("content") if is_chat else None
    return {"model": model, "created_at": _now(),
            **_said(generate, text, choice["message"].get("tool_calls") if is_chat else None),
            "done": True, "done_reason": "length" if choice["finish_reason"] == "length" else "stop",
            **_logprobs(lps), **_metrics(chat.get("usage"), chat.get("timings"))}


async def events(model: str, chunks, chat: bool = True, generate: bool = False):
    """The chat (or, chat False, completion) route's server-sent chunks -> Ollama's stream: one
    JSON object a line for each piece (and the tool calls, whole), then one with done,
    done_reason and the counts; a failed generation: an object with its error. generate:
    /api/generate's objects (response, not message)."""
    reason, timings = "stop", None

    def line(**fields) -> str:
        return json.dumps({"model": model, "created_at": _now(), **fields}) + "\n"

    async with aclosing(chat_chunks(chunks)) as objs:
        async for obj in objs:
            if "error" in obj:
                yield json.dumps({"error": obj["error"]["message"]}) + "\n"
                return
            if not obj.get("choices"):                   # the usage chunk: the last
                yield line(**_said(generate, ""), done=True, done_reason=reason,
                           **_metrics(obj.get("usage"), timings))
                return
            choice = obj["choices"][0]
            delta = choice.get("delta") or {} if chat else {"content": choice.get("text")}
            if choice.get("finish_reason"):
                reason = "length" if choice["finish_reason"] == "length" else "stop"
                timings = obj.get("timings")
            lps = (choice.get("logprobs") or {}).get("content") if chat else None
            if delta.get("content") or delta.get("tool_calls") or lps:
                yield line(**_said(generate, delta.get("content") or "", delta.get("tool_calls")),
                           done=False, **_logprobs(lps))
    yield json.dumps({"error": "the stream ended before the reply did"}) + "\n"


def embed_check(body: dict):
    """/api/embed's fields this service does not do: dimensions (an embedding has the model's),
    options, keep_alive 0. (truncate, Ollama's default, is done by the route: an input too long
    for the context is cut; truncate false: such an input is a 400.)"""
    if body.get("dimensions") is not None:
        raise Refused("'dimensions' is not supported by this service (an embedding has the model's "
                      "width)", "dimensions")
    if body.get("options"):
        raise Refused("'options' is not supported by /api/embed here", "options")
    _keep_alive(body.get("keep_alive"))


def loaded(model: str, generate: bool) -> dict:
    """The answer to Ollama's "load a model" (a generate without a prompt, a chat without
    messages): the model is loaded."""
    return {"model": model, "created_at": _now(), **_said(generate, ""), "done": True,
            "done_reason": "load"}


def error_body(message: str) -> dict:
    return {"error": message}
