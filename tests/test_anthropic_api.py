"""Anthropic's Messages API as a translation of the chat route (actors/front/anthropic_api.py),
without a service: messages with text, tool_use and tool_result blocks become the chat route's
messages; what it does not do is a 400 naming the field; a chat stream's chunks become the API's
events, a chat reply a message, with the stop reason and the cache read. Through HTTP and the
`anthropic` client: tests/test_agent_api.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from socllm.actors.front.anthropic_api import Refused, error_body, events, reply, to_chat
from testlib import sse_events

HI = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "get_time", "description": "The time in a zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


def test_a_conversation_with_tool_use_becomes_the_chat_routes_messages():
    body = {"model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "temperature": 0.3, "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
            "messages": [{"role": "user", "content": "Time in Oslo?"},
                         {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                           {"type": "tool_use", "id": "tu1", "name": "get_time",
                                                            "input": {"zone": "Europe/Oslo"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                                       "content": [{"type": "text", "text": "14:05"}]},
                                                      {"type": "text", "text": "Thanks."}]}]}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "tu1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "Europe/Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "tu1", "content": "14:05"},
        {"role": "user", "content": "Thanks."}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_time", "parameters": TOOL["input_schema"],
                                                               "description": TOOL["description"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["max_tokens"], chat["temperature"], chat["stop"]) == (50, 0.3, ["END"])
    chat = to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                    "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_time"},
                    "thinking": {"type": "disabled"}})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    counted = to_chat({"messages": HI, "system": "Be brief.", "tools": [TOOL]}, count=True)   # count_tokens'
    assert "max_tokens" not in counted and counted["messages"][0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(Refused, match="max_tokens"):
        to_chat({"messages": HI, "max_tokens": 5}, count=True)
    err = to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "boom", "is_error": True}]}]})["messages"]
    assert err == [{"role": "tool", "tool_call_id": "x", "content": "Error: boom"}]
    prefilled = to_chat({"max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "Hello"}]})
    assert prefilled["continue_final_message"] and prefilled["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert "continue_final_message" not in chat


def test_what_claude_code_sends_is_taken():
    """Claude Code's request (2.1.197): adaptive thinking (the model decides: these do not
    think), effort high (the API's default), context edits that clear thinking (there is none),
    a system message amid the messages; output_config's JSON schema becomes the chat route's."""
    body = {"max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Agent types: none."}]}
    chat = to_chat(body)
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "system", "content": "Agent types: none."}]
    assert "response_format" not in chat
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = to_chat({"max_tokens": 5, "messages": HI, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}


@pytest.mark.parametrize("body, param", [
    ({"messages": HI}, "max_tokens"),
    ({"max_tokens": 0, "messages": HI}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"max_tokens": 5, "messages": HI, "output_config": {"effort": "low"}}, "output_config"),
    ({"max_tokens": 5, "messages": HI, "output_config": {"format": {"type": "yaml"}}}, "output_config"),
    ({"max_tokens": 5, "messages": HI, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "context_management"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}]}, "messages"),
    ({"max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 5, "messages": HI, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
    ({"max_tokens": 5, "messages": HI, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 5, "messages": HI, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": HI, "tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": "auto"}, "tool_choice"),
    ({"max_tokens": 5, "messages": HI, "tools": [TOOL], "tool_choice": 1}, "tool_choice"),
    ({"max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "It is "}]}, "messages"),
    ({"max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "It"}], "tools": [TOOL]}, "messages"),
])
def test_what_the_route_does_not_do_is_refused_naming_the_field(body, param):
    with pytest.raises(Refused) as e:
        to_chat(body)
    assert e.value.param == param and param in str(e.value)


USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}


def _events(chunks: list) -> list:
    async def gen():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def run():
        return [e async for e in events("m", gen())]
    out = sse_events(asyncio.run(run()))
    return out


def _choice(delta, finish=None, matched=None):
    c = {"index": 0, "delta": delta, "finish_reason": finish}
    if finish:
        c["stop_reason"] = matched
    return {"choices": [c]}


def test_a_streamed_text_ended_by_a_stop_sequence_becomes_the_apis_events():
    so_far = {"usage": USAGE | {"completion_tokens": 1}}
    evs = _events([_choice({"role": "assistant", "content": ""}), _choice({"content": "Hel"}) | so_far,
                   _choice({"content": "lo"}), _choice({}, "stop", "END"), {"choices": [], "usage": USAGE}])
    assert [e["type"] for e in evs] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta") == "Hello"
    assert evs[0]["message"]["content"] == [] and evs[0]["message"]["id"].startswith("msg_")
    assert evs[0]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 1,   # the first chunk's
                                          "cache_read_input_tokens": 6, "cache_creation_input_tokens": 0}
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert evs[-2]["usage"] == {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 6,
                                "cache_creation_input_tokens": 0}


def test_streamed_tool_calls_become_tool_use_blocks():
    calls = [{"index": k, "id": f"call_{k}", "type": "function",
              "function": {"name": "get_time", "arguments": json.dumps({"zone": z})}} for k, z in enumerate("AB")]
    evs = _events([_choice({"role": "assistant", "content": ""}), _choice({"tool_calls": calls}),
                   _choice({}, "tool_calls"), {"choices": [], "usage": USAGE}])
    starts = [e for e in evs if e["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"], s["content_block"]["id"]) for s in starts] == [
        (0, "tool_use", "call_0"), (1, "tool_use", "call_1")]
    deltas = [json.loads(e["delta"]["partial_json"]) for e in evs if e["type"] == "content_block_delta"]
    assert deltas == [{"zone": "A"}, {"zone": "B"}] and evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_failed_generation_is_an_error_event():
    evs = _events([_choice({"content": "a"}), {"error": {"message": "generation failed: boom"}}])
    assert evs[-1] == {"type": "error", "error": {"type": "api_error", "message": "generation failed: boom"}}
    evs = _events([_choice({"content": "a"})])              # no usage chunk: cut short
    assert evs[-1]["type"] == "error" and "ended before" in evs[-1]["error"]["message"]


def test_a_chat_reply_becomes_a_message_and_errors_take_anthropics_shape():
    chat = {"choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                         "message": {"role": "assistant", "content": "Hi!"}}], "usage": USAGE}
    m = reply("m", chat)
    assert (m["type"], m["role"], m["content"], m["stop_reason"], m["stop_sequence"]) == (
        "message", "assistant", [{"type": "text", "text": "Hi!"}], "max_tokens", None)
    call = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "A"}'}}
    chat["choices"][0].update(finish_reason="tool_calls", message={"role": "assistant", "content": None,
                                                                   "tool_calls": [call]})
    m = reply("m", chat)
    assert m["content"] == [{"type": "tool_use", "id": "call_9", "name": "get_time", "input": {"zone": "A"}}]
    assert m["stop_reason"] == "tool_use"
    err = {"error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}}
    assert error_body(err, 400) == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad", "param": "x"}}
    assert error_body(err, 401)["error"]["type"] == "authentication_error"
    assert error_body(err, 503)["error"]["type"] == "api_error"
