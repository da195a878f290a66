"""OpenAI chat messages and tools for a chat template that has no tool syntax (SmolLM2's, Gemma's):
llama.cpp's generic format (its server's fallback for such templates, with minja's polyfills).

The tools are described in a system message; the assistant's reply is one JSON object, which
the serving loop constrains to the tools' schemas (policies/grammar.py), so a call is always
well-formed and its arguments valid for its function's parameters (the calls' ids are the
service's, not the model's: llama.cpp asks the model for them, a free string a small model may
never end):

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}      one call
    {"tool_calls": [{"name": "...", "arguments": {...}}, ...]}                parallel calls
    {"response": "Hello!"}                                                     a reply (auto)

In the history, an assistant turn's tool_calls are rendered as that JSON, and the results of
role "tool" as a user turn {"tool_response": {"tool_call_id", "name", "content"}}: every
template takes user and assistant turns. Message content may be a string or a list of text parts.
"""
from __future__ import annotations

import json
import re
import secrets

from .gguf_file import ModelError

ROLES = ("system", "user", "assistant", "tool", "developer")
SAY_JSON = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with "
            "`response` reply to the user's request")


class BadMessage(ModelError, ValueError):
    """A message or tool the API cannot take: `field` names it (HTTP says it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field

    def __reduce__(self):
        return type(self), (self.field, str(self).removeprefix(self.field + " "))


def check_tools(tools) -> list:
    """OpenAI's `tools` -> [{"name", "parameters", "description"?}] (BadMessage if malformed)."""
    if not isinstance(tools, list) or not tools:
        raise BadMessage("tools", "must be a non-empty list of {type: function, function: {...}}")
    out, names = [], set()
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadMessage("tools", "must each be {type: function, function: {name, parameters}}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadMessage("tools", f"function {f['name']!r}: parameters must be a JSON schema object")
        if f["name"] in names:
            raise BadMessage("tools", f"function {f['name']!r} is given twice")
        names.add(f["name"])
        out.append({"name": f["name"], "parameters": params,
                    **({"description": f["description"]} if isinstance(f.get("description"), str) else {})})
    return out


def check_tool_choice(choice, tools: list):
    """"auto" | "none" | "required" | one function's name (from {type: function, function: {name}})."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in {t["name"] for t in tools}:
        raise BadMessage("tool_choice", "must be auto, none, required or {type: function, "
                         "function: {name}} naming one of the tools")
    return name


def call_schema(tools: list, choice: str, parallel: bool, response: dict | None = None) -> dict | None:
    """The JSON schema every reply must match (None: tool_choice none, the reply is free text).
    response: the schema of a plain reply's `response` (response_format), else a string."""
    if choice == "none":
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t["name"] == choice]
    calls = []
    for t in chosen:
        c = {"type": "object", "properties": {"name": {"type": "string", "const": t["name"]},
                                              "arguments": closed(t["parameters"])},   # strict
             "required": ["name", "arguments"], "additionalProperties": False}
        calls.append(c)
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
             "required": ["tool_calls"], "additionalProperties": False} if parallel else
            {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
             "additionalProperties": False})
    if choice != "auto":
        return call
    reply = {"type": "object", "properties": {"response": response or {"type": "string"}},
             "required": ["response"], "additionalProperties": False}
    return {"anyOf": [call, reply]}


def closed(schema):
    """OpenAI's strict structured outputs: an object schema that does not say otherwise takes no
    properties beyond those it names (additionalProperties false, as xgrammar's strict mode), and
    a number none beyond I-JSON's range; JSON Schema's own defaults would let a small model add
    keys, or digits, without end."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not",
                                  "additionalProperties", "then", "else", "if") else
               {n: closed(s) for n, s in v.items()} if k in ("properties", "$defs", "definitions")
               and isinstance(v, dict) else v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") in ("integer", "number"):
        # I-JSON (RFC 7493): numbers within the exact-integer range of a double. Unbounded, a
        # model that writes digits one token each (SmolLM2) may never stop writing them
        out.setdefault("minimum", -I_JSON_MAX)
        out.setdefault("maximum", I_JSON_MAX)
    return out


I_JSON_MAX = 2 ** 53 - 1


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for p in content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadMessage("messages", f"{where}: only text parts are supported, got a "
                                 f"{p.get('type')!r} part")
            texts.append(p["text"])
        return "".join(texts)
    raise BadMessage("messages", f"{where}: content must be a string or a list of text parts")


def chat_messages(messages, tools: list | None = None, choice: str = "auto") -> list:
    """OpenAI chat messages (and tools) -> [{role, content}] strings that any chat template
    renders: tool calls and results as JSON turns; the tools' description in the system turn."""
    if not isinstance(messages, list) or not messages:
        raise BadMessage("messages", "must be a non-empty list of {role, content}")
    out, call_ids = [], set()           # the ids of the tool calls said so far
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadMessage("messages", f"{where}: role must be one of {', '.join(ROLES)}")
        role, calls = m["role"], m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise BadMessage("messages", f"{where}: tool_calls must be a list")
            said = [_said_call(c, where) for c in calls]
            call_ids.update(c.get("id") for c in calls)
            body = {"tool_calls": said} if len(said) > 1 else {"tool_call": said[0]}
            # as the model wrote it (compact, the schema's key order): the turn's tokens are the
            # ones the prefix cache holds from the reply
            out.append({"role": "assistant", "content": _compact(body)})
        elif role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or m["tool_call_id"] not in call_ids:
                # as OpenAI's API: a tool's result answers a call an assistant message made
                raise BadMessage("messages", f"{where}: a tool message must answer a call of an "
                                 f"earlier assistant message (its tool_call_id one of theirs)")
            result = {"tool_call_id": m.get("tool_call_id"), "name": m.get("name"),
                      "content": _text(m.get("content"), where)}
            out.append({"role": "user", "content": json.dumps(
                {"tool_response": {k: v for k, v in result.items() if v is not None}},
                ensure_ascii=False)})
        else:
            if m.get("content") is None:
                raise BadMessage("messages", f"{where}: content is missing")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(m["content"], where)})
    if tools and choice != "none":
        listed = json.dumps([{"type": "function", "function": t} for t in tools], ensure_ascii=False)
        say = (f"You can call any of the following tools to satisfy the user's requests: "
               f"{listed}\n\n{SAY_JSON}")
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + say}
        else:
            out.insert(0, {"role": "system", "content": say})
    return out


def _said_call(c, where: str) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise BadMessage("messages", f"{where}: each tool call must be {{id, type, function: {{name, arguments}}}}")
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise BadMessage("messages", f"{where}: a tool call's arguments must be JSON") from None
    return {"name": f["name"], "arguments": args}


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_reply(text: str) -> tuple:
    """The constrained reply -> (content or None, [OpenAI tool_calls]). A reply cut by
    max_tokens inside its `response` string gives the string so far (the user's words, not the
    format's); parallel calls cut short give the calls completed before the cut; other text
    that is not the format (a single call cut short) is returned as it is."""
    try:
        body = json.loads(text)
    except ValueError:
        cut = _cut_calls(text)
        if cut:
            body = {"tool_calls": cut}
        else:
            return _cut_response(text), []
    if not isinstance(body, dict):
        return text, []
    calls = body.get("tool_calls") or ([body["tool_call"]] if "tool_call" in body else [])
    if calls:
        return None, [{"id": c.get("id") or "call_" + secrets.token_hex(8), "type": "function",
                       "function": {"name": c["name"],
                                    "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
                      for c in calls]
    if "response" in body:
        r = body["response"]
        return (r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)), []
    return text, []


_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*')


def _cut_calls(text: str) -> list:
    """'{"tool_calls":[{call},{call},{"na' (parallel calls cut by max_tokens) -> the calls it
    completed (none: [])."""
    m = _CALLS.match(text)
    calls, at, dec = [], m.end() if m else len(text), json.JSONDecoder()
    while m is not None and at < len(text):
        try:
            call, at = dec.raw_decode(text, at)
        except ValueError:
            break
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            break
        calls.append(call)
        at = text.find(",", at) + 1 or len(text)
    return calls


def _cut_response(text: str) -> str:
    """'{"response": "Paris, Fra' -> 'Paris, Fra' (the JSON string's escapes decoded, an escape
    cut in half dropped); any other text unchanged."""
    m = _RESPONSE.match(text)
    if m is None:
        return text
    part = text[m.end():]
    for cut in range(len(part), max(-1, len(part) - 7), -1):    # an escape is at most 6 long
        try:
            return json.loads('"' + part[:cut] + '"')
        except ValueError:
            continue
    return text
