"""Constrained decoding's pure parts (policies/grammar.py, models/tools.py): no Ray. Masks on the
model's real tokenizer, sampled at temperature from random logits, always give text that parses
and validates; invalid schemas and grammars are refused; the generic tool format round-trips.
The served path (the model's own replies through HTTP) is in test_agent_api.py."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from socllm.models.tools import (BadMessage, call_schema, chat_messages, check_tool_choice,
                                 check_tools, parse_reply)
from socllm.policies.drafting import MAX_DRAFT
from socllm.policies.grammar import Grammars
from socllm.policies.sampling import BadParam, Sampler, SamplingParams

SMALL = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["colour", "n", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer.to_json(), len(tokenizer._tokens), tokenizer.stop_ids())


def _sample(grammars, tokenizer, rule, seed, steps=80, temperature=0.8):
    """Random logits, a sampler at `temperature`, the grammar's mask: the text, and whether an
    end token came."""
    c, rng = grammars.constraint(rule), np.random.default_rng(seed)
    sampler, out = Sampler(SamplingParams(temperature=temperature, seed=seed)), []
    stops = set(tokenizer.stop_ids())
    for _ in range(steps):
        tok = sampler(c.apply((3 * rng.standard_normal(grammars.vocab)).astype(np.float32)))
        c.take(tok)
        if tok in stops:
            return tokenizer.decode(out), True
        out.append(tok)
    return tokenizer.decode(out), False


def test_sampled_text_under_a_schema_always_parses_and_validates(grammars, tokenizer):
    rule = grammars.compile("response_format", "json_schema", SMALL)
    texts = set()
    for seed in range(20):
        text, ended = _sample(grammars, tokenizer, rule, seed)
        assert ended, text
        jsonschema.validate(json.loads(text), SMALL)
        texts.add(text)
    assert len(texts) > 5                         # sampling varies inside the language


def test_a_draft_that_runs_past_the_texts_end_leaves_the_grammar_where_it_was(grammars, tokenizer):
    """A lookup draft copied from a prompt that holds the reply's own JSON runs to its end and
    on, through an end token the complete text takes without keeping. The masks filled for it
    must leave the grammar at the reply's place: the first drafted token then samples and is
    taken (it was refused: the end token's roll-back took back the token before the draft)."""
    rule = grammars.compile("tools", "json_schema", call_schema(
        check_tools([TIME]), check_tool_choice("required", check_tools([TIME])), False, None))
    whole = tokenizer.encode('{"tool_call":{"name":"get_time","arguments":{"zone":"UTC"}}}', bos=False)
    end = tokenizer.stop_ids()[0]
    for cut in range(1, len(whole)):
        c = grammars.constraint(rule)
        for t in whole[:cut]:
            c.take(t)
        want = (whole[cut:] + [end, end])[:MAX_DRAFT]     # the rest, an end token, one more
        draft = c.set_draft(want)
        assert draft == want[:len(whole) - cut + 1], cut  # to the first end token
        logits = np.full(grammars.vocab, -10.0, np.float32)
        logits[whole[cut]] = 10.0
        tok = int(np.argmax(c.apply(logits)))
        assert tok == whole[cut], cut
        c.take(tok)                                       # refused before the fix, where cut ends it


def test_a_gbnf_and_a_lark_grammar_constrain_the_text(grammars, tokenizer):
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    lark = 'start: "x=" /[0-9]{1,3}/ ";"'
    for rule, ok in ((grammars.compile("grammar", "grammar", gbnf), lambda t: t in ("yes", "no", "maybe")),
                     (grammars.compile("grammar", "grammar", lark),
                      lambda t: t.startswith("x=") and t.endswith(";") and t[2:-1].isdigit())):
        for seed in range(5):
            text, ended = _sample(grammars, tokenizer, rule, seed)
            assert ended and ok(text), text


@pytest.mark.parametrize("kind, spec", [
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
    ("json_schema", "not a schema"), ("grammar", "root ::= ( unclosed"), ("grammar", "")])
def test_an_invalid_schema_or_grammar_is_refused_naming_the_field(grammars, kind, spec):
    with pytest.raises(BadParam) as e:
        grammars.compile("response_format", kind, spec)
    assert e.value.field == "response_format"


def test_tool_calls_under_required_are_always_well_formed(grammars, tokenizer):
    tools = check_tools([WEATHER, TIME])
    for parallel in (False, True):
        schema = call_schema(tools, "required", parallel)
        rule = grammars.compile("tools", "json_schema", schema)
        for seed in range(8):
            text, ended = _sample(grammars, tokenizer, rule, seed, steps=120)
            assert ended, text
            jsonschema.validate(json.loads(text), schema)
            content, calls = parse_reply(text)
            assert content is None and calls
            for c in calls:
                params = {t["name"]: t["parameters"] for t in tools}[c["function"]["name"]]
                jsonschema.validate(json.loads(c["function"]["arguments"]), params)


def test_a_named_tool_choice_allows_only_that_function(grammars, tokenizer):
    tools = check_tools([WEATHER, TIME])
    choice = check_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    rule = grammars.compile("tools", "json_schema", call_schema(tools, choice, False))
    for seed in range(5):
        text, _ = _sample(grammars, tokenizer, rule, seed)
        assert parse_reply(text)[1][0]["function"]["name"] == "get_time"


def test_auto_allows_a_plain_response_and_none_constrains_nothing():
    tools = check_tools([WEATHER])
    assert call_schema(tools, "none", False) is None
    assert parse_reply('{"response": "Hello there"}') == ("Hello there", [])
    assert parse_reply('{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}')[0] \
        == '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}'   # cut short: text
    # a reply cut inside its response string: the words so far, escapes decoded, half of one dropped
    assert parse_reply('{"response":"Paris, Fra') == ("Paris, Fra", [])
    assert parse_reply('{ "response" : "a \\"b\\" \\u00e9 c\\u00') == ('a "b" \u00e9 c', [])
    # parallel calls cut short: the calls completed before the cut, not the format as text
    cut = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_we'
    content, calls = parse_reply(cut)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert parse_reply('{"tool_calls":[{"name":"get_we') == ('{"tool_calls":[{"name":"get_we', [])


def test_an_agents_second_turn_renders_its_calls_and_results():
    msgs = chat_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}], check_tools([WEATHER]), "auto")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.") and "get_weather" in msgs[0]["content"]
    assert msgs[1]["content"] == "Weather in Oslo?"
    assert msgs[2]["content"] == '{"tool_call":{"name":"get_weather","arguments":{"city":"Oslo"}}}'  # as generated
    assert json.loads(msgs[3]["content"])["tool_response"]["content"] == "-3 C, snow"


@pytest.mark.parametrize("messages", [[], [{"role": "robot", "content": "x"}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}],
                                      [{"role": "user"}],
                                      [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
                                      [{"role": "assistant", "content": None, "tool_calls": [
                                          {"id": "call_1", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]},
                                       {"role": "tool", "tool_call_id": "call_2", "content": "y"}]])
def test_bad_messages_are_refused(messages):
    with pytest.raises(BadMessage):
        chat_messages(messages)
