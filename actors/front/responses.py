"""OpenAI's Responses API (`POST /v1/responses`, what the OpenAI Agents SDK and Codex speak) on
the chat path: a request's instructions, input items, function tools and text format become a
chat request (messages, tools, response_format: `to_chat`), and the chat reply, or its stream of
chunks, becomes a response object (`reply`) or the API's typed events (`events`). Pure: no Ray.

Stateless: nothing is stored, so `previous_response_id`, `store: true`, `background: true` and
`conversation` are a 400 that names them, as are tools other than functions, inputs other than
text, and any field not honoured. An agent resends its history as input items (messages,
`function_call`, `function_call_output`): the prefix cache finds what it sent before."""
from __future__ import annotations

import json
import secrets
import time
from contextlib import aclosing


class Refused(ValueError):
    """A request this route does not take: the message, the field it names, and OpenAI's code
    (unsupported_parameter: a field or value this service does not do; None: a bad value)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# fields taken as the chat route takes them (socllm's extensions too), under the same name
PASSED = ("temperature", "top_p", "seed", "priority", "top_k", "min_p", "repetition_penalty",
          "frequency_penalty", "presence_penalty", "speculate", "parallel_tool_calls", "user")
# metadata, client_metadata (Codex's) and safety_identifier label a request: kept nowhere
HONOURED = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "stream",
            "text", "metadata", "client_metadata", "safety_identifier", "prompt_cache_key",
            "top_logprobs", "include", "reasoning", *PASSED}
LOGPROBS = "message.output_text.logprobs"       # the `include` this service answers
# ... and the one it answers with nothing: these models do not reason, so there is no reasoning
ENCRYPTED = "reasoning.encrypted_content"
# fields taken only at the value that asks for nothing this service does not do
NEUTRAL = {"store": (False,), "background": (False,), "truncation": ("disabled",),
           "previous_response_id": (None,), "conversation": (None,),
           "service_tier": ("auto", "default")}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _check_fields(body: dict):
    for name, value in body.items():
        if name in HONOURED or value is None or value in NEUTRAL.get(name, ()):
            continue
        why = {"store": "this service keeps no responses (send the history as input)",
               "previous_response_id": "this service keeps no responses (send the history as input)",
               "conversation": "this service keeps no conversations (send the history as input)"}
        raise Refused(f"'{name}' is not supported by this service"
                      + (f": {why[name]}" if name in why else
                         f" (/v1/responses honours {', '.join(sorted(HONOURED - {'model', 'user'}))})"),
                      name, "unsupported_parameter")


def _reasoning(body: dict):
    """reasoning and include, for models that do not reason: effort none or left to the model
    (none here); a summary of the reasoning asked for (Codex asks for "auto"): there is none to
    summarize, so no reasoning item; include: the logprobs, or reasoning's encrypted content
    (none). Anything else is a 400 naming it."""
    r = body.get("reasoning")
    if r is not None:
        if not isinstance(r, dict):
            raise Refused("'reasoning' must be an object", "reasoning")
        for k, v in r.items():
            ok = {"effort": (None, "none"), "summary": (None, "auto", "concise", "detailed"),
                  "generate_summary": (None, "auto", "concise", "detailed")}.get(k, ())
            if v not in ok:
                raise Refused(f"'reasoning.{k}' {v!r} is not supported by this service: its models "
                              "do not reason (it takes effort none, and a summary, of nothing)",
                              f"reasoning.{k}", "unsupported_parameter")
    inc = body.get("include")
    if inc is not None and (not isinstance(inc, list) or any(i not in (LOGPROBS, ENCRYPTED) for i in inc)):
        raise Refused(f"'include' takes {LOGPROBS!r} and {ENCRYPTED!r} (nothing: these models do "
                      "not reason) here", "include", "unsupported_parameter")


def _text(content, field: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for p in content:
            if p.get("type") not in TEXT_PARTS or not isinstance(p.get("text"), str):
                raise Refused(f"'{field}' content parts must be text ({', '.join(TEXT_PARTS[:2])}); "
                              f"got {p.get('type')!r}", field)
        return "".join(p["text"] for p in content)
    raise Refused(f"'{field}' content must be a string or a list of text parts", field)


def _messages(body: dict) -> list:
    """instructions and input -> chat messages (function calls and their outputs as the chat
    route's assistant tool_calls and tool messages)."""
    msgs = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise Refused("'instructions' must be a string", "instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise Refused("'input' must be a non-empty string or a list of input items", "input")
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise Refused(f"an input message's 'role' must be one of {', '.join(ROLES)}", "input")
            msgs.append({"role": ROLES[item["role"]], "content": _text(item.get("content"), "input")})
        elif kind == "function_call":
            name = item.get("name")
            if item.get("namespace") is not None:        # a namespace tool's: as _tools names it
                name = f"{item['namespace']}.{name}"
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)           # parallel calls: one turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else _text(out, "input")})
        else:
            raise Refused(f"input items of type {kind!r} are not supported (message, "
                          "function_call, function_call_output)", "input")
    return msgs


# the chat route's fields -> the Responses API's, for the errors the chat route finds
FIELD_OF = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input",
            "logprobs": "include"}
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")


def _tools(tools, namespace: str | None = None) -> list:
    """Function tools -> the chat route's; a namespace's function tools (Codex's) as functions
    named namespace.name (a function's own name holds no dot, as OpenAI's rule has it), its
    description before each's."""
    if not isinstance(tools, list):
        raise Refused("'tools' must be a list", "tools")
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "namespace" and namespace is None \
                and isinstance(t.get("name"), str) and "." not in t["name"]:
            if set(t) - {"type", "name", "description", "tools"} or not isinstance(t.get("description") or "", str):
                raise Refused("a namespace tool takes name, description (a string) and tools",
                              "tools", "unsupported_parameter")
            inner = _tools(t.get("tools"), t["name"])
            for f in inner:
                said = (t.get("description") or "", f["function"].get("description") or "")
                f["function"]["description"] = " ".join(d for d in said if d)
            out += inner
            continue
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str) \
                or "." in t["name"]:
            kind = t.get("type") if isinstance(t, dict) else t
            raise Refused(f"only function tools ({{type: function, name, parameters}}; a name without "
                          f"dots) and namespaces of them are supported; got {kind!r}"
                          + (f" in namespace {namespace!r}" if namespace else ""), "tools",
                          "unsupported_parameter")
        if not isinstance(t.get("description") or "", str):
            raise Refused(f"function {t['name']!r}: description must be a string", "tools")
        extra = [k for k, v in t.items() if k not in TOOL_FIELDS and v is not None]
        if extra:            # defer_loading, allowed_callers, output_schema: not done here
            raise Refused(f"function tools' {', '.join(map(repr, extra))} is not supported by "
                          f"this service (it takes {', '.join(TOOL_FIELDS)})", "tools", "unsupported_parameter")
        out.append({"type": "function", "function": {k: t[k] for k in (
            "name", "description", "parameters", "strict") if t.get(k) is not None}})
        if namespace:
            out[-1]["function"]["name"] = f"{namespace}.{t['name']}"
    return out


def _tool_choice(choice, names: list = ()):
    """tool_choice -> the chat route's; a function's bare name picks the one namespace's
    function of that name where no plain function has it."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = choice["name"]
        inside = [n for n in names if n.endswith("." + name)]
        if name not in names and len(inside) == 1:
            name = inside[0]
        return {"type": "function", "function": {"name": name}}
    raise Refused("'tool_choice' must be auto, none, required or {type: function, name}", "tool_choice")


def _format(text) -> dict | None:
    """text.format -> the chat route's response_format (None: plain text)."""
    if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
        raise Refused(f"'text.verbosity' {text['verbosity']!r} is not supported by this service (a "
                      "reasoning model's setting; the Agents SDK sends it for gpt-5 model names: "
                      "give the Agent this service's model name)", "text", "unsupported_parameter")
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise Refused("'text' takes only 'format' ({type: text | json_object | json_schema})", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in (
            "name", "schema", "strict", "description") if k in fmt}}
    raise Refused("'text.format.type' must be text, json_object or json_schema", "text")


def to_chat(body) -> dict:
    """A Responses request -> the chat route's body (Refused if it asks for what is not done)."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    _check_fields(body)
    _reasoning(body)
    chat = {"messages": _messages(body), **{k: body[k] for k in PASSED if body.get(k) is not None}}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"], [t["function"]["name"] for t in chat["tools"]])
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise Refused("'tool_choice' needs 'tools'", "tool_choice")
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("text") is not None and (fmt := _format(body["text"])) is not None:
        chat["response_format"] = fmt
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise Refused("'metadata' must be an object", "metadata")
    top = body.get("top_logprobs")
    if LOGPROBS in (body.get("include") or []) or top:
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
            raise Refused("'top_logprobs' must be an integer in [0, 20]", "top_logprobs")
        chat.update(logprobs=True, top_logprobs=top or 0)
    if body.get("stream"):
        chat.update(stream=True, stream_options={"include_usage": True})
    return chat


def _usage(u: dict | None) -> dict | None:
    if not u:
        return None
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


async def chat_chunks(chunks):
    """The chat route's server-sent chunks as objects (its `[DONE]` left out), closing them when
    this ends: the requests of a stream a client left are cancelled."""
    async with aclosing(chunks):
        async for chunk in chunks:
            data = chunk.partition("data: ")[2].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message_item(text: str, status: str, item_id: str | None = None, logprobs=None) -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _lps(choice: dict) -> list:
    """A chat choice's token logprobs (entries of token, logprob, bytes, top_logprobs: the
    Responses API's shape too)."""
    return ((choice.get("logprobs") or {}).get("content")) or []


def _call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    """A chat tool call -> a function_call item (a namespace tool's with its namespace)."""
    ns, _, name = call["function"]["name"].rpartition(".")
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"],
            "name": name, "arguments": call["function"]["arguments"], "status": status,
            **({"namespace": ns} if ns else {})}


def response(body: dict, model: str, rid: str, status: str, output: list, usage=None,
             finish: str | None = None, error: dict | None = None) -> dict:
    """The response object: its request's settings, its output items, its usage."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": output, "parallel_tool_calls": bool(body.get("parallel_tool_calls")),
            "temperature": body.get("temperature", 0.0), "top_p": body.get("top_p", 1.0),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": body.get("metadata") or {}, "store": False, "usage": _usage(usage)}


def reply(body: dict, model: str, chat: dict) -> dict:
    """A chat completion (one choice) -> the response object."""
    choice = chat["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    status = "incomplete" if finish == "length" else "completed"
    output = [_call_item(c) for c in msg.get("tool_calls") or []] or \
        [_message_item(msg.get("content") or "", status, logprobs=_lps(choice))]
    return response(body, model, _id("resp"), status, output, chat.get("usage"), finish)


async def events(body: dict, model: str, chunks):
    """The chat route's server-sent chunks -> the Responses API's events: created, in_progress,
    then each output item added, its text's deltas (or a call's arguments) and done, then
    completed (incomplete: the token limit; failed: the generation failed)."""
    rid, seq, output, said, lps = _id("resp"), 0, [], [], []
    msg_id, finish = None, None

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    def open_message():
        nonlocal msg_id
        msg_id = _id("msg")
        return [event("response.output_item.added", output_index=len(output),
                      item=_message_item("", "in_progress", msg_id) | {"content": []}),
                event("response.content_part.added", item_id=msg_id, output_index=len(output),
                      content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def close_message():
        text = "".join(said)
        item = _message_item(text, "incomplete" if finish == "length" else "completed", msg_id, lps)
        output.append(item)
        at = dict(item_id=msg_id, output_index=len(output) - 1, content_index=0)
        return [event("response.output_text.done", **at, text=text, logprobs=lps),
                event("response.content_part.done", **at, part=item["content"][0]),
                event("response.output_item.done", output_index=len(output) - 1, item=item)]

    def calls(delta: dict):
        for call in delta.get("tool_calls") or []:
            item = _call_item(call, "in_progress")
            at = dict(item_id=item["id"], output_index=len(output))
            yield event("response.output_item.added", output_index=len(output), item=item | {"arguments": ""})
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, arguments=item["arguments"])
            output.append(item | {"status": "completed"})
            yield event("response.output_item.done", output_index=len(output) - 1, item=output[-1])

    yield event("response.created", response=response(body, model, rid, "in_progress", []))
    yield event("response.in_progress", response=response(body, model, rid, "in_progress", []))
    async with aclosing(chat_chunks(chunks)) as objs:
        async for obj in objs:
            if "error" in obj:
                err = {"code": "server_error", "message": obj["error"]["message"]}
                yield event("response.failed", response=response(body, model, rid, "failed", output, error=err))
                return
            if not obj.get("choices"):                   # the usage chunk: the last
                if msg_id is not None or not output:      # (an empty reply: one empty message)
                    for e in (open_message() if msg_id is None else []) + close_message():
                        yield e
                status = "incomplete" if finish == "length" else "completed"
                yield event(f"response.{status}", response=response(
                    body, model, rid, status, output, obj.get("usage"), finish))
                return
            choice = obj["choices"][0]
            delta, finish = choice.get("delta") or {}, choice.get("finish_reason") or finish
            for e in calls(delta):
                yield e
            if delta.get("content"):
                for e in open_message() if msg_id is None else []:
                    yield e
                said.append(delta["content"])
                lps.extend(_lps(choice))
                yield event("response.output_text.delta", item_id=msg_id, output_index=len(output),
                            content_index=0, delta=delta["content"], logprobs=_lps(choice))
    err = {"code": "server_error", "message": "the stream ended before the reply did"}
    yield event("response.failed", response=response(body, model, rid, "failed", output, error=err))
