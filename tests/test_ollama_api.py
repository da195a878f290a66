"""Ollama's native API as a translation of the chat and completion routes
(actors/front/ollama_api.py), without a service: a request's messages, options, format and tool
history become the chat route's body; what it does not do is a 400 naming the field; a chat
reply becomes Ollama's response object and a chat stream its lines of JSON. Through HTTP and the
`ollama` client: tests/test_agent_api.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from socllm.actors.front.ollama_api import Refused, events, reply, to_chat

HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}
TIMINGS = {"timings": {"prompt_ms": 2.0, "predicted_ms": 30.0, "ttft_ms": 5.0}}


def test_a_chat_with_options_format_and_a_tool_history_becomes_the_chat_routes_body():
    body = {"model": "m", "stream": False, "keep_alive": "5m", "think": False, "tools": [TOOL],
            "format": {"type": "object"}, "options": {"temperature": 0.2, "num_predict": 30, "top_k": 5,
                                                       "repeat_penalty": 1.1, "stop": ["END"], "seed": 3},
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "USER", "content": "Time?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"function": {"name": "get_time", "arguments": {"zone": "UTC"}}},
                             {"function": {"name": "get_date", "arguments": {}}}]},
                         {"role": "tool", "content": "Monday", "tool_name": "get_date"},
                         {"role": "tool", "content": "12:00"}]}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2_0", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
            {"id": "call_2_1", "type": "function", "function": {"name": "get_date", "arguments": "{}"}}]},
        {"role": "tool", "content": "Monday", "tool_call_id": "call_2_1"},      # by its tool_name
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2_0"}]       # the one left
    assert (chat["temperature"], chat["max_tokens"], chat["top_k"], chat["repetition_penalty"],
            chat["stop"], chat["seed"]) == (0.2, 30, 5, 1.1, ["END"], 3)
    assert chat["tools"] == [TOOL] and "stream" not in chat
    # a schema as llama.cpp's converter (Ollama's grammar) reads it: no keys it does not name
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "format", "schema": {"type": "object"}, "strict": True}}
    streamed = to_chat({"messages": HI, "format": "json", "options": {"num_predict": -1}})   # streams by default
    assert streamed["stream"] and streamed["response_format"] == {"type": "json_object"} and "max_tokens" not in streamed
    assert "response_format" not in to_chat({"messages": HI, "format": ""})      # "": none, as Ollama's
    # a result without a name or an id answers the latest turn's call, not an older one left open
    turns = [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
             {"role": "user", "content": "Never mind."},
             {"role": "assistant", "tool_calls": [{"function": {"name": "b", "arguments": {}}}]},
             {"role": "tool", "content": "done"}]
    assert to_chat({"messages": HI + turns})["messages"][-1]["tool_call_id"] == "call_3_0"
    # Ollama's "load a model" and its durations
    assert to_chat({"model": "m"}, generate=True) == {"load": True} == to_chat({"model": "m", "messages": []})
    for ok in ("5m", "1h30m", -1, 300, "24h"):
        to_chat({"messages": HI, "keep_alive": ok})


def test_generate_templates_its_prompt_unless_raw():
    assert to_chat({"prompt": "Hi", "system": "Be brief."}, generate=True)["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    raw = to_chat({"prompt": "Once upon", "raw": True, "stream": False}, generate=True)
    assert raw == {"prompt": "Once upon"}


@pytest.mark.parametrize("body, param, generate", [
    ({"messages": HI, "think": True}, "think", False),
    ({"messages": HI, "keep_alive": 0}, "keep_alive", False),
    ({"messages": HI, "keep_alive": "0s"}, "keep_alive", False),
    ({"messages": HI, "keep_alive": "0m0s"}, "keep_alive", False),
    ({"messages": HI, "keep_alive": "soon"}, "keep_alive", False),
    ({"messages": HI, "stream": "false"}, "stream", False),
    ({"prompt": "Hi", "truncate": True}, "truncate", True),
    ({"messages": HI, "options": {"num_ctx": 8192}}, "options.num_ctx", False),
    ({"messages": HI, "options": {"num_gpu": 1}}, "options.num_gpu", False),
    ({"messages": HI, "format": "yaml"}, "format", False),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages", False),
    ({"messages": HI + [{"role": "tool", "content": "x"}]}, "messages", False),
    ({"messages": HI, "prompt": "x"}, "prompt", False),
    ({"prompt": "Hi", "suffix": "end"}, "suffix", True),
    ({"prompt": "Hi", "raw": True, "logprobs": True}, "logprobs", True),
    ({"prompt": 3}, "prompt", True),
])
def test_what_the_route_does_not_do_is_refused_naming_the_field(body, param, generate):
    with pytest.raises(Refused) as e:
        to_chat(body, generate=generate)
    assert e.value.param == param and param.split(".")[-1] in str(e.value)


def test_a_reply_becomes_ollamas_object_with_its_counts_in_nanoseconds():
    call = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "A"}'}}
    out = reply("m", {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [call]}}], "usage": USAGE, **TIMINGS})
    assert out["message"] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "function": {"index": 0, "name": "get_time", "arguments": {"zone": "A"}}}]}
    assert (out["done"], out["done_reason"], out["prompt_eval_count"], out["eval_count"]) == (True, "stop", 3, 4)
    assert (out["total_duration"], out["eval_duration"], out["prompt_eval_duration"]) == (35_000_000, 30_000_000, 2_000_000)
    text = reply("m", {"choices": [{"index": 0, "finish_reason": "length", "text": "upon a time"}], "usage": USAGE},
                 generate=True)
    assert (text["response"], text["done_reason"]) == ("upon a time", "length") and "message" not in text


def _lines(chunks: list, chat: bool = True, generate: bool = False) -> list:
    async def gen():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def run():
        return [e async for e in events("m", gen(), chat, generate)]
    out = asyncio.run(run())
    assert all(e.endswith("\n") and e.count("\n") == 1 for e in out)
    return [json.loads(e) for e in out]


def _choice(delta, finish=None):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_stream_becomes_lines_of_json_ending_done_and_a_failure_an_error_line():
    lines = _lines([_choice({"role": "assistant", "content": ""}), _choice({"content": "Hel"}), _choice({"content": "lo"}),
                    _choice({}, "stop") | TIMINGS, {"choices": [], "usage": USAGE}])
    assert [(x["message"]["content"], x["done"]) for x in lines] == [("Hel", False), ("lo", False), ("", True)]
    assert lines[-1]["done_reason"] == "stop" and lines[-1]["eval_count"] == 4 and lines[-1]["eval_duration"] == 30_000_000
    raw = _lines([{"choices": [{"index": 0, "text": "up", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, {"choices": [], "usage": USAGE}],
                 chat=False, generate=True)
    assert [(x["response"], x["done"]) for x in raw] == [("up", False), ("", True)] and raw[-1]["done_reason"] == "length"
    assert _lines([_choice({"content": "a"}), {"error": {"message": "generation failed: boom"}}])[-1] == {
        "error": "generation failed: boom"}
    assert "ended before" in _lines([_choice({"content": "a"})])[-1]["error"]


@pytest.mark.parametrize("path, shape", [("/api/chat", {"error"}), ("/v1/messages", {"type", "error"}),
                                         ("/v1/chat/completions", {"error"})])
def test_an_unexpected_error_takes_the_shape_of_the_routes_api(path, shape):
    """A route's unexpected exception is a 500, and a path no route takes a 404, in its API's
    error shape (Ollama's {"error": text}, Anthropic's typed error, else OpenAI's object), never a
    bare page or FastAPI's {"detail"}."""
    import asyncio
    import json
    from types import SimpleNamespace

    from starlette.exceptions import HTTPException

    from socllm.actors.front.http import _no_route, _unexpected
    request = SimpleNamespace(url=SimpleNamespace(path=path), method="POST")
    for answer, status, said in ((_unexpected(request, KeyError("x")), 500, "KeyError"),
                                 (_no_route(request, HTTPException(404)), 404, f"no route: POST {path}")):
        out = asyncio.run(answer)
        body = json.loads(out.body)
        assert out.status_code == status and set(body) == shape
        text = body["error"] if path.startswith("/api/") else body["error"]["message"]
        assert said in text
