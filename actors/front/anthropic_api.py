"""Anthropic's Messages API (`POST /v1/messages`, what the Anthropic SDKs and Claude Code speak, as
llama.cpp's server and Ollama offer it) on the chat path: the system prompt, messages with text,
`tool_use` and `tool_result` blocks, custom tools and `tool_choice` become a chat request
(`to_chat`), and the chat reply, or its stream of chunks, becomes a message (`reply`) or the API's
events (`events`). Pure: no Ray.

What is not done is a 400 naming the field: server tools (web search, code execution, computer
use), image and document blocks, extended thinking, MCP servers, containers. `cache_control`
marks are accepted: the prefix cache keeps every prompt's blocks anyway (`usage` says what it
found: `cache_read_input_tokens`)."""
from __future__ import annotations

import json
import secrets
from contextlib import aclosing

from socllm.actors.front.responses import Refused, chat_chunks   # noqa: F401 (Refused: this route's too)


PASSED = ("temperature", "top_p", "top_k", "seed", "priority", "min_p", "repetition_penalty", "speculate")
HONOURED = {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "tools",
            "tool_choice", "metadata", "thinking", "output_config", "context_management", *PASSED}
NEUTRAL = {"service_tier": ("auto", "standard_only")}
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error"}


def error_body(openai_error: dict, status: int) -> dict:
    """An OpenAI-style error object -> Anthropic's {"type": "error", "error": {type, message}}."""
    err = openai_error.get("error", {})
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.get("message", ""),
                                       "param": err.get("param")}}


def _text(blocks, field: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                        isinstance(b.get("text"), str) for b in blocks):
        return "".join(b["text"] for b in blocks)
    raise Refused(f"'{field}' must be a string or a list of text blocks", field)


def _turn(role: str, content) -> list:
    """One message -> chat messages: a user turn's tool results as tool messages (first), its
    text as a user message (a system turn's as a system message: the API's mid-conversation
    system messages); an assistant turn's text and tool uses as one assistant message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise Refused("a message's 'content' must be a string or a list of content blocks", "messages")
    text, calls, results = [], [], []
    for b in content:
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            out = b.get("content", "")
            out = _text(out, "messages") if out else ""
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": f"Error: {out}" if b.get("is_error") else out})
        else:
            raise Refused(f"'messages': content blocks of type {kind!r} are not supported in a "
                          f"{role} message (text; tool_use from the assistant; tool_result from the "
                          "user)", "messages")
    if role == "assistant":
        msg = {"role": "assistant", "content": "".join(text) or None}
        return [msg | {"tool_calls": calls}] if calls else [msg]
    return results + ([{"role": role, "content": "".join(text)}] if text or not results else [])


def _settings(body: dict, chat: dict):
    """thinking, output_config and context_management, for models that do not think: thinking
    disabled, or adaptive (the model decides: no thinking); effort high (the API's default: the
    model's usual reply); format: a JSON schema, as the chat route's strict response_format;
    context edits that clear thinking (there is none). Anything else is a 400 naming it."""
    think = body.get("thinking")
    if think is not None and (not isinstance(think, dict) or think.get("type") not in ("disabled", "adaptive")):
        raise Refused("'thinking' is not supported by this service: its models do not think (it "
                      "takes {type: disabled} or {type: adaptive})", "thinking")
    out = body.get("output_config")
    if out is not None:
        if not isinstance(out, dict) or set(out) - {"effort", "format"} or out.get("effort") not in (None, "high"):
            raise Refused("'output_config' takes effort high (the model's usual reply) and a JSON "
                          "schema format here", "output_config")
        fmt = out.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise Refused("'output_config.format' must be {type: json_schema, schema}", "output_config")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt["schema"], "strict": True}}
    edits = (body.get("context_management") or {}).get("edits") \
        if isinstance(body.get("context_management"), dict) else None
    if body.get("context_management") is not None and (not isinstance(edits, list) or not all(
            isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking_") for e in edits)):
        raise Refused("'context_management' takes only edits that clear thinking (there is none) "
                      "here", "context_management")


def _prefill(chat: dict):
    """A final assistant message: the reply continues its text (the API's prefill; the chat
    route's continue_final_message)."""
    last = chat["messages"][-1]
    if last.get("tool_calls") or not last["content"]:
        raise Refused("'messages': a final assistant message (a prefill) must be text", "messages")
    if last["content"] != last["content"].rstrip():
        raise Refused("'messages': final assistant content cannot end with trailing whitespace",
                      "messages")
    if chat.get("tools"):
        raise Refused("'messages': a final assistant message (a prefill) cannot be combined with "
                      "tools here (their rule holds for a whole reply)", "messages")
    chat["continue_final_message"] = True


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise Refused("'tools' must be a list", "tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else t
            raise Refused(f"only custom tools ({{name, description, input_schema}}) are supported; "
                          f"got {kind!r}", "tools")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict, chat: dict):
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or kind == "tool" and not isinstance(choice.get("name"), str):
        raise Refused("'tool_choice' must be {type: auto | any | none} or {type: tool, name}", "tool_choice")
    chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def to_chat(body, count: bool = False) -> dict:
    """A Messages request -> the chat route's body (Refused if it asks for what is not done);
    count: count_tokens' request (no max_tokens)."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    for name, value in body.items():
        if name not in HONOURED and value is not None and value not in NEUTRAL.get(name, ()):
            raise Refused(f"'{name}' is not supported by this service (/v1/messages honours "
                          f"{', '.join(sorted(HONOURED - {'model'}))})", name)
    if count and body.get("max_tokens") is not None:
        raise Refused("'max_tokens' is not a field of count_tokens", "max_tokens")
    if not count and (not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool)
                      or body["max_tokens"] < 1):
        raise Refused("'max_tokens' is required: an integer >= 1", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant", "system") for m in msgs):
        raise Refused("'messages' must be a non-empty list of user and assistant (and system) "
                      "messages", "messages")
    chat = {"messages": ([{"role": "system", "content": _text(body["system"], "system")}]
                         if body.get("system") is not None else [])
            + [t for m in msgs for t in _turn(m["role"], m.get("content"))],
            **{k: body[k] for k in PASSED if body.get(k) is not None}}
    if not count:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences"):
        stop = body["stop_sequences"]
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise Refused("'stop_sequences' must be a list of at most 4 non-empty strings here", "stop_sequences")
        chat["stop"] = stop
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            _tool_choice(body["tool_choice"], chat)
    elif body.get("tool_choice") is not None:
        tc = body["tool_choice"]
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "none"):
            raise Refused("'tool_choice' needs 'tools' (without them: {type: auto} or {type: none})",
                          "tool_choice")
    if msgs[-1]["role"] == "assistant":
        _prefill(chat)
    _settings(body, chat)
    if body.get("stream"):
        chat.update(stream=True, stream_options={"include_usage": True,
                                                 "continuous_usage_stats": True})
    return chat


def _usage(u: dict | None) -> dict:
    u = u or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(finish: str | None, matched: str | None) -> tuple:
    """(stop_reason, stop_sequence) of a chat finish_reason and the stop string that ended it."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    return ("stop_sequence", matched) if matched else ("end_turn", None)


def _use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args}


def message(model: str, mid: str, content: list, usage=None, stop=(None, None)) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(usage)}


def reply(model: str, chat: dict) -> dict:
    """A chat completion (one choice) -> the message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content = ([{"type": "text", "text": msg["content"]}] if msg.get("content") else []) + \
        [_use(c) for c in msg.get("tool_calls") or []]
    return message(model, f"msg_{secrets.token_hex(12)}", content, chat.get("usage"),
                   _stop(choice["finish_reason"], choice.get("stop_reason")))


async def events(model: str, chunks):
    """The chat route's server-sent chunks -> the Messages API's events: message_start (held
    back from the role's chunk to the next, which tells the usage so far), each content block's
    start, deltas and stop, message_delta (the stop reason and usage), message_stop; a failed
    generation: an error event."""
    mid, blocks, text_open = f"msg_{secrets.token_hex(12)}", 0, False
    finish, matched, started = None, None, False

    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    async with aclosing(chat_chunks(chunks)) as objs:
        async for obj in objs:
            if not started and "role" not in ((obj.get("choices") or [{}])[0].get("delta") or {}):
                yield event("message_start", message=message(model, mid, [], obj.get("usage")))
                started = True
            if "error" in obj:
                yield event("error", error={"type": "api_error", "message": obj["error"]["message"]})
                return
            if not obj.get("choices"):                   # the usage chunk: the last
                if text_open:
                    yield event("content_block_stop", index=blocks - 1)
                yield event("message_delta", delta={"stop_reason": _stop(finish, matched)[0],
                                                    "stop_sequence": _stop(finish, matched)[1]},
                            usage=_usage(obj.get("usage")))
                yield event("message_stop")
                return
            choice = obj["choices"][0]
            delta = choice.get("delta") or {}
            finish = choice.get("finish_reason") or finish
            matched = choice.get("stop_reason") or matched
            if delta.get("content"):
                if not text_open:
                    yield event("content_block_start", index=blocks, content_block={"type": "text", "text": ""})
                    text_open, blocks = True, blocks + 1
                yield event("content_block_delta", index=blocks - 1,
                            delta={"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                if text_open:
                    yield event("content_block_stop", index=blocks - 1)
                    text_open = False
                use = _use(call)
                yield event("content_block_start", index=blocks, content_block=use | {"input": {}})
                yield event("content_block_delta", index=blocks,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(use["input"])})
                yield event("content_block_stop", index=blocks)
                blocks += 1
    yield event("error", error={"type": "api_error", "message": "the stream ended before the reply did"})
