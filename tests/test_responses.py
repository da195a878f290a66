"""OpenAI's Responses API as a translation of the chat route (actors/front/responses.py), without
a service: a request's items become the chat route's messages, tools and format; what it does
not do is a 400 naming the field; a chat stream's chunks become the API's events in order, and a
chat reply its response object. Through HTTP and the `openai` client: tests/test_agent_api.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from socllm.actors.front.responses import Refused, events, reply, to_chat
from testlib import sse_events

FN = {"type": "function", "name": "get_time", "description": "The time in a zone",
      "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


def test_an_agents_history_becomes_the_chat_routes_messages():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5,
            "seed": 3, "tools": [FN], "tool_choice": {"type": "function", "name": "get_time"},
            "input": [{"role": "developer", "content": "Zones are IANA names."},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Time in "},
                                                                      {"type": "input_text", "text": "Oslo?"}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"zone": "A"}'},
                      {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "B"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "14:05"},
                      {"type": "function_call_output", "call_id": "c2",
                       "output": [{"type": "input_text", "text": "15:05"}]}]}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Zones are IANA names."},
        {"role": "user", "content": "Time in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "A"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "B"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "14:05"},
        {"role": "tool", "tool_call_id": "c2", "content": "15:05"}]
    assert chat["tools"] == [{"type": "function", "function": {k: FN[k] for k in ("name", "description", "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert (chat["max_tokens"], chat["temperature"], chat["seed"]) == (9, 0.5, 3) and "stream" not in chat
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat({"input": "Hi", "stream": True, "store": False, "truncation": "disabled",
                    "text": {"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}}})
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                              "strict": True}}
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert "response_format" not in to_chat({"input": "Hi", "text": {"format": {"type": "text"}}})
    # what the Agents SDK sends by default or for ModelSettings(top_logprobs=3)
    chat = to_chat({"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3,
                    "reasoning": {"effort": "none"}, "prompt_cache_key": "agent-1"})
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 3)


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "Hi", "store": True}, "store"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "top_logprobs": 50}, "top_logprobs"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, "include"),
    ({"input": "Hi", "tools": [dict(FN, defer_loading=True)]}, "tools"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "Hi", "reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"input": "Hi", "tools": [dict(FN, name="a.b")]}, "tools"),
    ({"input": "Hi", "tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": [
        {"type": "custom", "name": "apply_patch"}]}]}, "tools"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "text"),
])
def test_what_the_route_does_not_do_is_refused_naming_the_field(body, param):
    with pytest.raises(Refused) as e:
        to_chat(body)
    assert e.value.param == param and param in str(e.value)


def _chunks(deltas: list, finish: str, usage: dict):
    async def gen():
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n"
        for d in deltas:
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': d, 'finish_reason': None}]})}\n\n"
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': finish}]})}\n\n"
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    return gen()


def _events(body, chunks) -> list:
    async def run():
        return [e async for e in events(body, "m", chunks)]
    out = sse_events(asyncio.run(run()))
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 4}}


def test_a_streamed_text_becomes_the_apis_events_and_its_response():
    evs = _events({"input": "Hi", "max_output_tokens": 3}, _chunks([{"content": "Hel"}, {"content": "lo"}],
                                                                   "length", USAGE))
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert "".join(e["delta"] for e in evs if e["type"].endswith(".delta")) == "Hello"
    item_id = evs[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in evs[3:8])
    last = evs[-1]["response"]
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["output"][0]["content"][0]["text"] == "Hello" and last["output"][0]["id"] == item_id
    assert last["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 10}
    assert last["id"] == evs[0]["response"]["id"] and evs[0]["response"]["status"] == "in_progress"


def test_streamed_tool_calls_become_function_call_items():
    calls = [{"index": k, "id": f"call_{k}", "type": "function",
              "function": {"name": "get_time", "arguments": json.dumps({"zone": z})}}
             for k, z in enumerate(("Europe/Oslo", "Asia/Tokyo"))]
    evs = _events({"input": "Hi", "tools": [FN]}, _chunks([{"tool_calls": calls}], "tool_calls", USAGE))
    kinds = [e["type"] for e in evs]
    assert kinds == ["response.created", "response.in_progress"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * 2 + ["response.completed"]
    out = evs[-1]["response"]["output"]
    assert [(o["type"], o["call_id"], json.loads(o["arguments"])["zone"], o["status"]) for o in out] == [
        ("function_call", "call_0", "Europe/Oslo", "completed"), ("function_call", "call_1", "Asia/Tokyo", "completed")]
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1]


def test_a_failed_generation_ends_the_stream_failed():
    async def gen():
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'a'}}]})}\n\n"
        yield f"data: {json.dumps({'error': {'message': 'generation failed: boom'}})}\n\n"
    evs = _events({"input": "Hi"}, gen())
    assert evs[-1]["type"] == "response.failed" and "boom" in evs[-1]["response"]["error"]["message"]


def test_what_codex_sends_is_taken_and_its_namespace_tools_are_functions_named_for_it():
    """Codex CLI's request (0.169): reasoning {summary: auto} and reasoning's encrypted content
    (these models do not reason: there is none), client_metadata, a namespace of function
    tools (called as namespace.name, answered as a function_call item with its namespace)."""
    ns = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
          "tools": [dict(FN, name="spawn", description="Start one.")]}
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                      {"type": "function_call", "call_id": "c1", "namespace": "agents", "name": "spawn",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
            "tools": [FN, ns], "reasoning": {"summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
            "client_metadata": {"session_id": "s"}, "parallel_tool_calls": True, "tool_choice": "auto"}
    chat = to_chat(body)
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_time", "agents.spawn"]
    assert chat["tools"][1]["function"]["description"] == "Sub-agents. Start one."
    assert chat["messages"][1]["tool_calls"][0]["function"]["name"] == "agents.spawn"
    call = {"id": "call_2", "type": "function", "function": {"name": "agents.spawn", "arguments": "{}"}}
    out = reply(body, "m", {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [call]}}], "usage": USAGE})["output"]
    assert [(i["type"], i["namespace"], i["name"]) for i in out] == [("function_call", "agents", "spawn")]
    forced = to_chat(body | {"tool_choice": {"type": "function", "name": "spawn"}})   # no namespace field
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "agents.spawn"}}


def test_a_chat_reply_becomes_a_response_object():
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi!"}}],
            "usage": USAGE}
    r = reply({"input": "Hi", "metadata": {"k": "v"}}, "m", chat)
    assert r["object"] == "response" and r["status"] == "completed" and r["id"].startswith("resp_")
    assert r["output"][0]["content"][0] == {"type": "output_text", "text": "Hi!", "annotations": [], "logprobs": []}
    assert r["metadata"] == {"k": "v"} and r["usage"]["input_tokens_details"]["cached_tokens"] == 4
    call = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    chat["choices"][0].update(finish_reason="tool_calls", message={"role": "assistant", "content": None,
                                                                   "tool_calls": [call]})
    [item] = reply({"input": "Hi"}, "m", chat)["output"]
    assert (item["type"], item["call_id"], item["name"], item["arguments"]) == ("function_call", "call_9", "get_time", "{}")


def test_logprobs_ride_the_deltas_and_a_stream_cut_short_ends_failed():
    lp = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    deltas = [{"content": "Hi"}]

    async def gen():
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': deltas[0], 'logprobs': {'content': lp}}]})}\n\n"
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
        yield f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n"
    evs = _events({"input": "Hi"}, gen())
    assert [e["logprobs"] for e in evs if e["type"] == "response.output_text.delta"] == [lp]
    assert evs[-1]["response"]["output"][0]["content"][0]["logprobs"] == lp

    async def cut():                 # no usage chunk: the chat stream ended early
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'a'}}]})}\n\n"
    evs = _events({"input": "Hi"}, cut())
    assert evs[-1]["type"] == "response.failed"
