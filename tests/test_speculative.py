"""Speculative decoding in the one engine (policies/drafting.py, actors/engine.py): drafts verified
as more rows of a decode step give exactly the tokens plain decoding gives (greedy at f32, and
seeded sampling), with several sequences drafting in one step, and the oracle's greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest

from testlib import PROMPTS

PASSAGE = (Path(__file__).parents[1] / "scripts" / "data" / "pride_and_prejudice_ch1-2.txt").read_text()[:900]
# text that the model copies (the passage again), and prompts that it does not
COPY = PASSAGE + "\n\n" + PASSAGE[:PASSAGE.index(" that a single")]
LIST = "Fruits: apple, banana, cherry, apple, banana, cherry, apple, banana,"


@pytest.fixture(scope="module")
def llm(ray_session):
    import socllm
    # lookup: drafts wherever the lookup finds some (auto may decide they do not pay here)
    with socllm.LLM(precision="f32", context=512, max_seqs=8, kv_mb=24, plan="gpu", policy="fcfs",
                    speculate="lookup", draft_max=6) as llm:
        yield llm


def _spec(out) -> dict:
    return out.usage.get("completion_tokens_details") or {"accepted_prediction_tokens": 0,
                                                          "rejected_prediction_tokens": 0}


def test_greedy_tokens_equal_plain_decoding_with_several_sequences_drafting(llm):
    prompts = [COPY, LIST, *PROMPTS]
    plain = llm.generate(prompts, max_tokens=40, speculate="off")
    drafted = llm.generate(prompts, max_tokens=40)                 # together: one step, many drafts
    alone = [llm.generate(p, max_tokens=40)[0] for p in prompts[:2]]
    assert [o.text for o in drafted] == [o.text for o in plain]
    assert [o.text for o in alone] == [o.text for o in plain[:2]]
    assert len({o.text for o in plain}) == len(prompts)             # references that vary
    assert all(_spec(o) == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
               for o in plain)
    # the copying prompt's drafts were accepted (so the verified rows did decide its tokens)
    assert _spec(alone[0])["accepted_prediction_tokens"] >= 20
    assert _spec(drafted[1])["accepted_prediction_tokens"] >= 5
    assert sum(_spec(o)["rejected_prediction_tokens"] for o in drafted) > 0
    assert all(o.usage["completion_tokens"] == p.usage["completion_tokens"] for o, p in zip(drafted, plain))


def test_a_prediction_drafts_the_reply_and_keeps_plain_decodings_tokens(llm):
    """OpenAI's Predicted Outputs: the predicted text drafts the reply (in step with it, then by
    n-grams once they differ); the tokens stay plain decoding's, with the prediction exact, edited,
    or wrong, and its accepted tokens counted; a request that drafts nothing refuses one."""
    prompt = PROMPTS[1]
    [plain] = llm.generate(prompt, max_tokens=40, speculate="off")
    words = plain.text.split(" ")
    edited = " ".join(words[:4] + ["purple"] + words[5:])            # one word changed
    for pred, least in ((plain.text, 30), (edited, 15), ("Nothing like it at all.", 0)):
        [got] = llm.generate(prompt, max_tokens=40, prediction=pred)
        assert got.text == plain.text and got.usage["completion_tokens"] == plain.usage["completion_tokens"]
        assert _spec(got)["accepted_prediction_tokens"] >= least, (pred, _spec(got))
    assert len(set(words)) > 5                                        # a reference that varies
    for mode in ("off", "heads"):                                     # drafts none from text
        with pytest.raises(ValueError, match="prediction"):
            llm.generate(prompt, max_tokens=4, prediction="x", speculate=mode)


def test_verified_rows_give_the_oracles_greedy_tokens(llm, oracle, tokenizer):
    ids = tokenizer.encode(COPY)
    want = oracle.greedy(ids, 24)
    [out] = llm.generate(COPY, max_tokens=24)
    assert _spec(out)["accepted_prediction_tokens"] >= 10
    assert out.text == tokenizer.decode(want)


def test_seeded_sampling_is_the_same_with_drafts(llm):
    """The verification samples each row with the request's own sampler, in order: the same
    draws, the same tokens (penalties too: they see the tokens accepted so far)."""
    for params in (dict(temperature=0.7, seed=11), dict(temperature=0.9, top_p=0.9, seed=3,
                                                        frequency_penalty=0.3)):
        plain = llm.generate([COPY, LIST], max_tokens=32, speculate="off", **params)
        drafted = llm.generate([COPY, LIST], max_tokens=32, **params)
        assert [o.text for o in drafted] == [o.text for o in plain], params
        assert sum(_spec(o)["accepted_prediction_tokens"] for o in drafted) > 0


def test_max_tokens_and_stop_text_hold_within_a_verified_run(llm):
    [full] = llm.generate(COPY, max_tokens=30, speculate="off")
    for n in (1, 2, 7):
        [out] = llm.generate(COPY, max_tokens=n)
        assert out.usage["completion_tokens"] == n and out.finish_reason == "length"
    word = full.text.split()[5]
    [cut] = llm.generate(COPY, max_tokens=30, stop=[word])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(word)]


def test_status_shows_drafting_and_bad_values_are_refused(llm):
    s = llm.status()["speculation"]
    assert s["mode"] == "lookup" and s["drafted"] > s["accepted"] > 0
    assert len(s["step_ms"]) == 8 and all(t > 0 for t in s["step_ms"])
    with pytest.raises(ValueError, match="speculate"):
        llm.generate(PROMPTS[0], max_tokens=2, speculate="medusa")


def test_a_service_with_speculation_off_refuses_a_request_that_asks_for_it(ray_session):
    import socllm
    with socllm.LLM(precision="f32", context=128, max_seqs=2, kv_mb=4, plan="gpu", policy="fcfs",
                    speculate="off", warm=False) as llm:
        assert llm.status()["speculation"] == {"mode": "off"}
        with pytest.raises(ValueError, match="speculate"):
            llm.generate(PROMPTS[0], max_tokens=2, speculate="lookup")
        [out] = llm.generate(PROMPTS[0], max_tokens=2, speculate="off")
        assert "completion_tokens_details" not in out.usage


def test_constrained_replies_draft_what_the_grammar_forces_and_match_plain_decoding(llm):
    """A schema's keys are forced tokens: drafted, verified under each row's own mask (the
    grammar's state after the drafted tokens before it), and the reply is plain decoding's."""
    import json
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Invent a person. Reply in JSON with name, age and city."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    [plain] = llm.chat(msgs, max_tokens=60, response_format=fmt, speculate="off")
    [drafted] = llm.chat(msgs, max_tokens=60, response_format=fmt)
    assert drafted.text == plain.text
    assert set(json.loads(drafted.text)) == {"name", "age", "city"}
    assert _spec(drafted)["accepted_prediction_tokens"] >= 2        # {" name, at least


def test_an_agents_second_turn_drafts_its_own_call_to_the_end_and_matches_plain_decoding(llm):
    """The history holds the call the reply makes again: the lookup drafts it from there to its
    end and on through the end token. The reply is plain decoding's; it was a failed request
    (the grammar's roll-back after the end token took back one token too many)."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Vienna"}'}}
    msgs = [{"role": "user", "content": "Weather in Vienna?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    [plain] = llm.chat(msgs, tools=[weather], max_tokens=32, speculate="off")
    [drafted] = llm.chat(msgs, tools=[weather], max_tokens=32)
    assert drafted.text == plain.text and "Vienna" in plain.text
    assert _spec(drafted)["accepted_prediction_tokens"] >= 4


def test_draft_heads_give_plain_decodings_tokens_on_open_prompts(llm):
    """The default model's trained draft heads (models/heads/) draft from the last row's hidden
    state on prompts whose text the lookup cannot find, as trees; their accepted drafts keep the
    tokens, alone or three sequences in one step."""
    assert llm.status()["speculation"]["heads"]
    convs = [[{"role": "user", "content": c}] for c in
             ("Write a short poem about the sea.", "Give three tips for sleeping well.",
              "Explain what a volcano is.")]
    plain = llm.chat(convs, max_tokens=48, speculate="off")
    tree = llm.status()["speculation"]["tree"]
    drafted = llm.chat(convs, max_tokens=48, speculate="heads")
    alone = [llm.chat([c], max_tokens=48, speculate="heads")[0] for c in convs]
    assert [o.text for o in drafted] == [o.text for o in plain] == [o.text for o in alone]
    assert len({o.text for o in plain}) == 3
    assert sum(_spec(o)["accepted_prediction_tokens"] for o in drafted) >= 10
    # the drafts were trees (each head's two likeliest tokens), and paths off their chains were
    # accepted: those rows were fed again at the next step (Request.lag)
    after = llm.status()["speculation"]["tree"]
    assert after["ranks"] == 2 and after["steps"] > tree["steps"]
    assert after["side_accepted"] > tree["side_accepted"]
