"""What agents need from the service, through real HTTP (the official `openai` client) and the
Python client: structured output and tool calls that always parse and validate, an agent's
second turn (tool calls and results in the history), and the door: an API key (401 without it,
/health open), a bounded body (413), a bounded waiting queue (429 with Retry-After, QueueFull),
a text too long for the context refused before it is tokenized, unguessable request handles,
OpenAI's error codes, /health that asks the service, GET /v1/models/{id}, and the usage chunk
that stream_options.include_usage asks for."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from testlib import free_port

SOCLLM = [sys.executable, "-m", "socllm.actors.front.cli"]
KEY = "s3cret-key-for-tests"
COUNT = "1, 2, 3, 4, 5, 6, 7, 8,"


@pytest.fixture(scope="module")
def door(ray_session):
    """`socllm serve` with an API key (from the environment, as the README advises), two
    sequences at a time, one request waiting at most and a 64 KB body limit."""
    env = {**os.environ, "RAY_ADDRESS": ray_session[0], "SOCLLM_API_KEY": KEY}
    port = free_port()
    r = subprocess.run(SOCLLM + ["serve", "--http-port", str(port), "--context", "512",
                                 "--max-seqs", "2", "--kv-mb", "16", "--plan", "gpu", "--precision", "f32",
                                 "--max-waiting", "1", "--max-body-mb", "0.0625"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "an API key" in r.stdout and KEY not in r.stdout + r.stderr
    yield env, f"http://127.0.0.1:{port}"
    subprocess.run(SOCLLM + ["stop"], env=env, capture_output=True, timeout=300)


def _post(url, body, key=KEY, **kw):
    import requests
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + "/v1/completions", json=body, headers=headers, timeout=120, **kw)


def test_without_the_key_nothing_is_served_and_health_stays_open(door):
    import openai
    import requests
    url = door[1]
    body = {"prompt": "Hi", "max_tokens": 2}
    for key in (None, "wrong", KEY + "x"):
        r = _post(url, body, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/models/x", "/metrics"):
        assert requests.get(url + path, timeout=30).status_code == 401
    for path, ask in (("/tokenize", {"content": "Hi"}), ("/detokenize", {"tokens": [1]})):
        assert requests.post(url + path, json=ask, timeout=30).status_code == 401
        r = requests.post(url + path, json=ask, timeout=30, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
    assert requests.get(url + "/health", timeout=30).json()["status"] == "ok"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope").completions.create(
            model="m", prompt="Hi", max_tokens=2)
    oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    assert oa.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_cli_generate_sends_the_key_from_its_environment_and_without_one_takes_ray(door):
    """`socllm generate` to a service with a key: over HTTP with SOCLLM_API_KEY (the record
    `serve` wrote says a key is needed, never which), through Ray without it, and with a wrong
    one through Ray after a warning; one text."""
    from socllm.actors.front.direct import record_path
    rec = open(record_path(door[0]["RAY_ADDRESS"])).read()
    assert json.loads(rec)["api_key"] is True and KEY not in rec
    args = ["generate", COUNT, "--max-tokens", "6"]
    keyed = subprocess.run(SOCLLM + args, env=door[0], capture_output=True, text=True, timeout=120)
    assert keyed.returncode == 0 and "[service over HTTP: gpu" in keyed.stderr, keyed.stderr
    bare = {k: v for k, v in door[0].items() if k != "SOCLLM_API_KEY"}
    r = subprocess.run(SOCLLM + args, env=bare, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "[service: gpu" in r.stderr and r.stdout == keyed.stdout
    wrong = subprocess.run(SOCLLM + args, env={**bare, "SOCLLM_API_KEY": "not-the-key"},
                           capture_output=True, text=True, timeout=120)    # said, then Ray's path
    assert wrong.returncode == 0 and wrong.stdout == keyed.stdout and "[service: gpu" in wrong.stderr
    assert "refused SOCLLM_API_KEY (401)" in wrong.stderr


def test_models_by_id_and_openai_error_codes(door):
    import requests
    url, auth = door[1], {"Authorization": f"Bearer {KEY}"}
    model = requests.get(url + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    assert requests.get(f"{url}/v1/models/{model}", headers=auth, timeout=30).json()["id"] == model
    r = requests.get(url + "/v1/models/nope", headers=auth, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(url, {"prompt": "word " * 600, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = _post(url, {"prompt": "Hi", "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


def test_speculation_over_http_usage_metrics_and_a_bad_value(door):
    """A request's speculate field; the drafts it verified in OpenAI's usage (Predicted
    Outputs' names) and in /metrics."""
    import requests
    url, auth = door[1], {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": COUNT + " 9, 10, 11, 12, 13, 14, 15, 16, 1, 2, 3, 4,", "max_tokens": 24}
    plain = _post(url, {**body, "speculate": "off"}).json()
    drafted = _post(url, {**body, "speculate": "lookup"}).json()
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "completion_tokens_details" not in plain["usage"]
    assert drafted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    text = requests.get(url + "/metrics", headers=auth, timeout=30).text
    assert "socllm_spec_decode_accepted_tokens_total" in text
    r = _post(url, {**body, "speculate": "medusa"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculate", r.text


def test_a_body_over_the_limit_is_413_and_a_text_far_over_the_context_is_refused_untokenized(door):
    import socllm
    r = _post(door[1], {"prompt": "x" * 100_000, "max_tokens": 2})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    client = socllm.connect()
    with pytest.raises(ValueError, match="characters, more than the context"):
        client.generate("word " * 2_000_000, max_tokens=2)      # 10 MB: refused by its length


def test_the_waiting_queue_is_bounded_429_with_retry_after(door):
    import socllm
    client = socllm.connect()
    import ray
    held = []
    for i in range(3):                  # two running (max_seqs 2), then one waiting
        held.append(client.submit(prompt=COUNT, max_tokens=400, ignore_eos=True))
        while i < 2 and ray.get(client.service.request.remote(held[-1]))["state"] == "waiting":
            time.sleep(0.05)
    try:
        r = _post(door[1], {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(socllm.QueueFull):
            client.generate("Hi", max_tokens=2)
    finally:
        for rid in held[::-1]:
            client.cancel(rid)
    assert _post(door[1], {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_handles_are_unguessable_and_a_guessed_one_reads_nothing(door):
    import ray
    import socllm
    client = socllm.connect()
    rid = client.submit(prompt="Hi", max_tokens=4)
    assert isinstance(rid, str) and len(rid) >= 16
    other = client.submit(prompt="Hi", max_tokens=4)
    assert other != rid
    for guess in (1, 2, "1", rid[:-1] + ("A" if rid[-1] != "A" else "B")):
        with pytest.raises(ray.exceptions.RayTaskError, match="no request"):
            ray.get(client.service.poll.remote(guess, 0, 0.1))
        assert ray.get(client.service.cancel.remote(guess)) is False
    assert "".join(client.pieces(rid)) and "".join(client.pieces(other)) is not None


def test_include_usage_sends_a_last_chunk_with_no_choices(door):
    """stream_options.include_usage: a last chunk with the usage and no choices; with vLLM's
    continuous_usage_stats too, every chunk after the role's carries the usage so far."""
    import requests

    def chunks(**opts) -> list:
        r = requests.post(door[1] + "/v1/chat/completions", stream=True, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                "stream": True, "stream_options": opts})
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]
    plain = chunks(include_usage=True, include_obfuscation=False)
    assert plain[-1]["choices"] == [] and plain[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in c for c in plain[:-1]) and plain[-2]["choices"][0]["finish_reason"]
    each = chunks(include_usage=True, continuous_usage_stats=True)
    so_far = [c["usage"] for c in each[1:]]
    assert "usage" not in each[0] and len(so_far) >= 2 and so_far[-1] == each[-1]["usage"]
    made = [u["completion_tokens"] for u in so_far]
    assert made == sorted(made) and made[0] >= 1 and made[-1] == 4
    assert {u["prompt_tokens"] for u in so_far} == {plain[-1]["usage"]["prompt_tokens"]}


def test_a_huge_prompt_being_tokenized_does_not_stop_another_stream(door):
    """A prompt of nearly the longest text the context could take is tokenized beside the loop
    while another request streams: the stream ends with its whole text, the huge one with a 400."""
    import socllm
    client = socllm.connect()
    want = client.generate("Once upon a time", max_tokens=24)
    got, errors = [], []

    def huge():
        try:
            client.generate("ab " * 13_000, max_tokens=2)     # under 512 x 81 characters: tokenized
        except ValueError as e:
            errors.append(str(e))
    t = threading.Thread(target=huge)
    t.start()
    got.append(client.generate("Once upon a time", max_tokens=24))
    t.join(120)
    assert got == [want] and errors and "context holds" in errors[0]


# -- structured output and tool calls, from the model itself --------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer"}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"}},
     "required": ["answer", "confidence"]},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["name", "tags", "ok"]},
    {"type": "object", "properties": {"steps": {"type": "integer", "minimum": 1, "maximum": 9},
                                      "unit": {"enum": ["s", "min", "h"]}}, "required": ["steps", "unit"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def oa(door):
    import openai
    return openai.OpenAI(base_url=door[1] + "/v1", api_key=KEY)


def test_every_reply_under_a_json_schema_parses_and_validates(oa):
    import jsonschema
    ask = [{"role": "user", "content": "Describe a place you like, as JSON."}]
    for i, schema in enumerate(SCHEMAS):
        for temperature in (0, 0.8, 0.8):
            r = oa.chat.completions.create(
                model="m", messages=ask, max_tokens=120, temperature=temperature, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}})
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop", text
            jsonschema.validate(json.loads(text), schema)
    r = oa.completions.create(model="m", prompt="A JSON object about cats:", max_tokens=120,
                              extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_a_grammar_constrains_a_completion(door, oa):
    r = oa.completions.create(model="m", prompt="Is the sky green? Answer:", max_tokens=8,
                              temperature=0.9, seed=3, extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert r.choices[0].text in (" yes", " no")
    r = _post(door[1], {"prompt": "Hi", "grammar": "root ::= ( broken"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
    r = _post(door[1], {"prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_are_well_formed_and_parsed_by_the_openai_client(oa, parallel):
    import jsonschema
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    ask = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
    for seed, temperature in ((1, 0), (2, 0.8), (3, 0.8)):
        r = oa.chat.completions.create(model="m", messages=ask, tools=[WEATHER, CLOCK], seed=seed,
                                       tool_choice="required", parallel_tool_calls=parallel,
                                       max_tokens=160, temperature=temperature)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_a_named_tool_streamed_and_an_agents_second_turn(oa):
    ask = [{"role": "user", "content": "What time is it in Oslo?"}]
    chunks = list(oa.chat.completions.create(
        model="m", messages=ask, tools=[WEATHER, CLOCK], stream=True, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_time"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call = calls[0]
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": [{"type": "text", "text": "14:05"}]}]
    r = oa.chat.completions.create(model="m", messages=history, tools=[WEATHER, CLOCK], max_tokens=60,
                                   tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    r = oa.chat.completions.create(model="m", messages=history, tools=[WEATHER, CLOCK], max_tokens=120)
    msg = r.choices[0].message                 # auto: a call or a reply, well-formed either way
    assert (msg.tool_calls and r.choices[0].finish_reason == "tool_calls") or msg.content
    assert r.usage.prompt_tokens_details.cached_tokens > 0    # the turn before was cached


def _flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


def test_the_responses_api_answers_as_chat_does_streamed_or_not(oa, door):
    """POST /v1/responses through the openai client: the same greedy text and token counts as
    the chat route for the same turn; streamed, the deltas make that text and the last event
    carries the response; what it does not do is a 400 naming the field."""
    import openai
    import requests
    ask = dict(instructions="Answer in one sentence.", input="What is a river?", max_output_tokens=24)
    chat = oa.chat.completions.create(model="m", max_tokens=24, messages=[
        {"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}])
    r = oa.responses.create(model="m", **ask)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.input_tokens_details.cached_tokens > 0          # the chat turn's prompt, cached
    evs = list(oa.responses.create(model="m", stream=True, **ask))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].type == "response.created" and evs[-1].type == f"response.{r.status}"
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == r.output_text
    assert evs[-1].response.output_text == r.output_text and evs[-1].response.usage.output_tokens == r.usage.output_tokens
    for bad, param in (({"previous_response_id": "resp_x"}, "previous_response_id"),
                       ({"store": True}, "store"), ({"tools": [{"type": "web_search"}]}, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(model="m", input="Hi", **bad)
        assert e.value.body["param"] == param
    for many in (0, 5000):                                           # found by the chat path
        with pytest.raises(openai.BadRequestError) as e:           # and the service's scheduler
            oa.responses.create(model="m", input="Hi", max_output_tokens=many)
        assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens" in e.value.body["message"]
        assert "max_tokens" not in e.value.body["message"]
    r = requests.post(door[1] + "/v1/responses", json={"input": "Hi"}, timeout=30)
    assert r.status_code == 401                                     # the door holds here too
    lp = oa.responses.create(model="m", include=["message.output_text.logprobs"], top_logprobs=2, **ask)
    chat = oa.chat.completions.create(model="m", max_tokens=24, logprobs=True, top_logprobs=2, messages=[
        {"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}])
    got, want = lp.output[0].content[0].logprobs, chat.choices[0].logprobs.content
    assert [(g.token, len(g.top_logprobs)) for g in got] == [(c.token, 2) for c in want]
    # the same tokens' logprobs: a prefix found cached or computed whole differs in f32's last bits
    assert max(abs(g.logprob - c.logprob) for g, c in zip(got, want)) < 1e-4


def test_the_responses_api_calls_tools_takes_their_output_and_a_schema(oa):
    import jsonschema
    tools = [_flat(WEATHER), _flat(CLOCK)]
    params = {t["name"]: t["parameters"] for t in tools}
    r = oa.responses.create(model="m", input="What is the weather in Paris?", tools=tools,
                            tool_choice="required", max_output_tokens=120)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), params[call.name])
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": "18 C, sunny"} for c in calls]]
    r = oa.responses.create(model="m", input=history, tools=tools, tool_choice="none", max_output_tokens=40)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage.input_tokens_details.cached_tokens > 0          # the first turn's prompt
    streamed = list(oa.responses.create(model="m", input="Time in Oslo?", tools=tools, stream=True,
                                        tool_choice={"type": "function", "name": "get_time"},
                                        max_output_tokens=80))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [d.name for d in done] == ["get_time"] and streamed[-1].type == "response.completed"
    jsonschema.validate(json.loads(done[0].arguments), params["get_time"])
    r = oa.responses.create(model="m", input="Describe a place you like, as JSON.", max_output_tokens=120,
                            temperature=0.8, text={"format": {"type": "json_schema", "name": "place",
                                                              "schema": SCHEMAS[0], "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMAS[0])
    # what Codex CLI sends: reasoning's summary and encrypted content (none: no reasoning),
    # client metadata, and a namespace of tools, whose call comes back with its namespace
    streamed = list(oa.responses.create(
        model="m", input="Time in Oslo?", stream=True, store=False, reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"], tool_choice="required", max_output_tokens=80,
        tools=[tools[0], {"type": "namespace", "name": "clock", "description": "Clocks.", "tools": [tools[1]]}],
        extra_body={"client_metadata": {"session_id": "s1"}}))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done and {d.type for d in done} == {"function_call"} and streamed[-1].type == "response.completed"
    for d in done:
        assert (d.name, getattr(d, "namespace", None)) in (("get_weather", None), ("get_time", "clock"))
        jsonschema.validate(json.loads(d.arguments), params[d.name])


def _anthropic_tool(tool: dict) -> dict:
    f = tool["function"]
    return {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}


def test_a_reply_continues_the_final_assistant_message_when_asked(oa, door, oracle, tokenizer):
    """vLLM's continue_final_message, and the Messages API's prefill (a final assistant
    message): the prompt ends inside the assistant's turn (the same ids /tokenize and
    count_tokens give), and the reply is the oracle's greedy continuation of it; what cannot be
    continued is a 400 naming the field."""
    import anthropic
    import openai
    import requests
    said = [{"role": "user", "content": "Which city is the capital of France? Say why."},
            {"role": "assistant", "content": "The capital of France is"}]
    head, cont = {"Authorization": f"Bearer {KEY}"}, {"continue_final_message": True}
    ids = requests.post(door[1] + "/tokenize", headers=head, timeout=60,
                        json={"messages": said} | cont).json()["tokens"]
    plain = requests.post(door[1] + "/tokenize", headers=head, timeout=60, json={"messages": said}).json()["tokens"]
    assert len(ids) < len(plain) and plain[:len(ids)] == ids
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    stops, out = set(tokenizer.stop_ids()), oracle.greedy(ids, 12)
    want = tokenizer.decode(out[:next((i for i, t in enumerate(out) if t in stops), 12)])
    r = oa.chat.completions.create(model="m", messages=said, max_tokens=12,
                                   extra_body=cont | {"add_generation_prompt": False})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    echoed = oa.chat.completions.create(model="m", messages=said, max_tokens=12, extra_body=cont | {"echo": True})
    assert echoed.choices[0].message.content == said[-1]["content"] + want     # vLLM's echo
    ac = anthropic.Anthropic(base_url=door[1], api_key=KEY)
    m = ac.messages.create(model="m", max_tokens=12, messages=said)
    assert m.content[0].text == want and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    assert ac.messages.count_tokens(model="m", messages=said).input_tokens == len(ids)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        ac.messages.create(model="m", max_tokens=4, messages=[said[0], {"role": "assistant", "content": "It is "}])
    for body, param in (({"messages": said[:1]} | cont, "continue_final_message"),
                        ({"messages": said, "add_generation_prompt": True} | cont, "add_generation_prompt"),
                        ({"messages": said, "add_generation_prompt": False}, "add_generation_prompt"),
                        ({"messages": said, "response_format": {"type": "json_object"}} | cont,
                         "continue_final_message")):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="m", max_tokens=4, messages=body.pop("messages"), extra_body=body)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="m", prompt="Hi", max_tokens=4, extra_body=cont)
    assert e.value.body["param"] == "continue_final_message"


def test_a_prediction_through_the_openai_client_keeps_the_text(oa):
    """OpenAI's Predicted Outputs (`prediction`): the same greedy text, the drafts it gave
    counted in completion_tokens_details; a prediction that is not {type: content} is a 400."""
    import openai
    ask = [{"role": "user", "content": "Write one sentence about rivers."}]
    plain = oa.chat.completions.create(model="m", messages=ask, max_tokens=30)
    text = plain.choices[0].message.content
    r = oa.chat.completions.create(model="m", messages=ask, max_tokens=30,
                                   prediction={"type": "content", "content": text}, extra_body={"speculate": "lookup"})
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="m", messages=ask, max_tokens=4, extra_body={"prediction": {"type": "file"}})
    assert e.value.body["param"] == "prediction"


def test_the_messages_api_answers_as_chat_does_streamed_or_not(oa, door):
    """POST /v1/messages through the `anthropic` client (its x-api-key header): the chat route's
    greedy text and token counts for the same turn (the cached part as cache_read_input_tokens);
    streamed, the same text and final message; a stop sequence reported as the one that ended
    it; errors in Anthropic's shape."""
    import anthropic
    ac = anthropic.Anthropic(base_url=door[1], api_key=KEY)
    system, ask = "Answer in one sentence.", [{"role": "user", "content": "What is a lake?"}]
    chat = oa.chat.completions.create(model="m", max_tokens=24, messages=[{"role": "system", "content": system}, *ask])
    want = chat.choices[0].message.content
    m = ac.messages.create(model="m", max_tokens=24, system=system, messages=ask)
    assert m.type == "message" and [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.cache_read_input_tokens > 0 and m.usage.output_tokens == chat.usage.completion_tokens
    with ac.messages.stream(model="m", max_tokens=24, system=system, messages=ask) as s:
        evs = list(s)
        final = s.get_final_message()
    streamed = "".join(e.delta.text for e in evs if e.type == "content_block_delta")
    assert streamed == want and final.content[0].text == want and final.stop_reason == m.stop_reason
    start = evs[0].message.usage                       # the prompt's tokens told at the start
    assert start.input_tokens + start.cache_read_input_tokens == chat.usage.prompt_tokens
    word = want.split()[2]                               # a stop sequence the reply holds
    m = ac.messages.create(model="m", max_tokens=24, system=system, messages=ask, stop_sequences=["@@", word])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == want[:want.index(word)]
    for bad in ({"thinking": {"type": "enabled", "budget_tokens": 1024}},
                {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}):
        with pytest.raises(anthropic.BadRequestError) as e:
            ac.messages.create(model="m", max_tokens=8, messages=ask, **bad)
        assert e.value.body["type"] == "error" and e.value.body["error"]["param"] in bad
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=door[1], api_key="nope").messages.create(model="m", max_tokens=2, messages=ask)


def test_the_messages_api_uses_tools_takes_their_results(door):
    import anthropic
    import jsonschema
    ac = anthropic.Anthropic(base_url=door[1], api_key=KEY)
    tools = [_anthropic_tool(WEATHER), _anthropic_tool(CLOCK)]
    schemas = {t["name"]: t["input_schema"] for t in tools}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = ac.messages.create(model="m", max_tokens=120, messages=ask, tools=tools, tool_choice={"type": "any"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    counted = ac.messages.count_tokens(model="m", messages=ask, tools=tools, tool_choice={"type": "any"})
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens   # the same prompt
    for u in uses:
        jsonschema.validate(u.input, schemas[u.name])
    turn = ask + [{"role": "assistant", "content": [u.model_dump(include={"type", "id", "name", "input"}) for u in uses]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "18 C, sunny"}
                                               for u in uses]}]
    m = ac.messages.create(model="m", max_tokens=40, messages=turn, tools=tools, tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.usage.cache_read_input_tokens > 0                   # the first turn's prompt
    oslo = [{"role": "user", "content": "Time in Oslo?"}]
    with ac.messages.stream(model="m", max_tokens=80, tools=tools, tool_choice={"type": "tool", "name": "get_time"},
                            messages=oslo) as s:
        evs = list(s)
        final = s.get_final_message()
    # message_start counts the input although the calls are held to the end
    start, count = evs[0].message.usage, ac.messages.count_tokens(
        model="m", messages=oslo, tools=tools, tool_choice={"type": "tool", "name": "get_time"})
    assert start.input_tokens + start.cache_read_input_tokens == count.input_tokens
    [use] = final.content
    assert (use.type, use.name, final.stop_reason) == ("tool_use", "get_time", "tool_use")
    jsonschema.validate(use.input, schemas["get_time"])
    # what Claude Code sends (adaptive thinking, effort high, context edits that clear thinking),
    # with output_config's schema: the reply is JSON that validates, no thinking block
    m = ac.messages.create(model="m", max_tokens=120, messages=[
        {"role": "user", "content": "Describe a place you like, as JSON."}],
        extra_body={"temperature": 0.8, "thinking": {"type": "adaptive"}, "context_management": {
            "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": SCHEMAS[0]}}})
    assert [b.type for b in m.content] == ["text"]
    jsonschema.validate(json.loads(m.content[0].text), SCHEMAS[0])


def test_ollamas_api_answers_as_chat_does_streamed_or_not(oa, door):
    """/api/chat and /api/generate through the official `ollama` client (the key as a Bearer
    header): the chat route's greedy text and counts, streamed or not; a tool call, then its
    result named by tool_name; the model listed and shown; what it does not do is a 400."""
    import ollama
    import jsonschema
    client = ollama.Client(host=door[1], headers={"Authorization": f"Bearer {KEY}"})
    ask = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is a lake?"}]
    chat = oa.chat.completions.create(model="m", max_tokens=24, messages=ask)
    want = chat.choices[0].message.content
    r = client.chat(model="m", messages=ask, options={"num_predict": 24})
    assert r.message.content == want and r.done and r.done_reason == {"length": "length", "stop": "stop"}[
        chat.choices[0].finish_reason]
    assert r.eval_count == chat.usage.completion_tokens and r.eval_duration > 0 and r.prompt_eval_count >= 0
    assert "".join(p.message.content for p in client.chat(model="m", messages=ask, stream=True,
                                                          options={"num_predict": 24})) == want
    g = client.generate(model="m", system=ask[0]["content"], prompt=ask[1]["content"], options={"num_predict": 24})
    assert g.response == want
    raw = client.generate(model="m", prompt=COUNT, raw=True, options={"num_predict": 6})
    assert raw.response == oa.completions.create(model="m", prompt=COUNT, max_tokens=6).choices[0].text
    r = client.chat(model="m", messages=[{"role": "user", "content": "Call get_time for Europe/Oslo."}],
                    tools=[CLOCK], options={"num_predict": 80})
    [call] = r.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(dict(call.function.arguments), CLOCK["function"]["parameters"])
    after = client.chat(model="m", options={"num_predict": 30}, messages=[
        {"role": "user", "content": "Call get_time for Europe/Oslo."}, r.message,
        {"role": "tool", "content": "14:05", "tool_name": "get_time"}])
    assert after.message.content and not after.message.tool_calls
    [listed] = client.list().models
    assert listed.model == door_model(door) and client.show(listed.model).capabilities == ["completion", "tools"]
    for bad in ({"think": True}, {"options": {"num_ctx": 4096}}):
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="m", messages=ask, **bad)
        assert e.value.status_code == 400 and list(bad)[0] in e.value.error
    for bad in ({"num_predict": 5000}, {"temperature": -1}):      # found by the service: its name
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="m", messages=ask, options=bad)
        assert e.value.status_code == 400 and f"options.{list(bad)[0]}" in e.value.error, e.value.error
    # format: a schema as Ollama's grammar (llama.cpp's converter) reads it, objects closed
    name = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}}, "required": ["name"]}
    r = client.chat(model="m", messages=[{"role": "user", "content": "Name a shelter, as JSON."}],
                    format=name, options={"num_predict": 60})
    assert set(json.loads(r.message.content)) == {"name"} and r.done_reason == "stop", r.message.content


def door_model(door) -> str:
    import requests
    return requests.get(door[1] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["data"][0]["id"]


def test_the_python_client_takes_a_schema(door):
    import jsonschema
    import socllm
    client = socllm.connect()
    text = client.chat([{"role": "user", "content": "Pick one."}], max_tokens=60,
                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[4]}})
    jsonschema.validate(json.loads(text), SCHEMAS[4])
    with pytest.raises(ValueError, match="tools"):
        client.generate("Hi", tools=[WEATHER])
    msg = client.chat_message([{"role": "user", "content": "Time in Oslo?"}], tools=[WEATHER, CLOCK],
                              tool_choice="required", max_tokens=80)
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")
    assert client.chat_message([{"role": "user", "content": "Hi"}], max_tokens=4)["tool_calls"] == []


# -- the rest of the OpenAI surface: logprobs, penalties, logit bias, n, echo ---------------------
def test_logprobs_are_the_oracles_and_top_logprobs_rank_them(oa, oracle, tokenizer, gguf_reader):
    import numpy as np
    r = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name a colour."}],
                                   max_tokens=6, logprobs=True, top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert c.top_logprobs[0].token == c.token and abs(tops[0] - c.logprob) < 1e-6
    # the oracle's log-softmax at each greedy step
    from socllm.models.chat import render_chat
    ids = tokenizer.encode(render_chat(gguf_reader, [{"role": "user", "content": "Name a colour."}]),
                           bos=tokenizer.add_bos)
    toks = oracle.greedy(ids, len(content))
    assert tokenizer.decode(toks) == r.choices[0].message.content
    logits = oracle.logits_for(ids + toks)[len(ids) - 1:]
    for c, row in zip(content, logits):
        z = row.astype(np.float64)
        want = z.max() - (z.max() + np.log(np.exp(z - z.max()).sum()))
        assert abs(c.logprob - want) < 2e-3


def test_completions_logprobs_and_echo(oa):
    """echo with logprobs, read by the official client: the prompt's tokens, then the reply's
    (OpenAI's legacy completions), the first token without a logprob."""
    prompt = "The capital of France is"
    r = oa.completions.create(model="m", prompt=prompt, max_tokens=5, logprobs=2, echo=True, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp, n = c.logprobs, r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text and lp.text_offset[n] == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) <= 2 for t in lp.top_logprobs[1:])


def test_logit_bias_and_penalties_change_the_text(oa, tokenizer):
    base = dict(model="m", prompt=COUNT, max_tokens=12, temperature=0)
    greedy = oa.completions.create(**base).choices[0].text
    first = tokenizer.encode(greedy)[0]
    banned = oa.completions.create(**base, logit_bias={str(first): -100}).choices[0].text
    assert tokenizer.encode(banned)[0] != first
    forced = tokenizer.encode(" cat")[0]
    r = oa.completions.create(**base, logit_bias={str(forced): 100})
    assert r.choices[0].text == tokenizer.decode([forced] * 12)
    penalised = oa.completions.create(**base, frequency_penalty=2.0).choices[0].text
    assert penalised != greedy
    ids = tokenizer.encode(oa.completions.create(**base, presence_penalty=2.0).choices[0].text)
    assert len(set(ids)) > len(set(tokenizer.encode(greedy)))


def test_n_choices_share_the_prompt_and_vary_with_sampling(oa):
    prompt = " ".join(f"Line {i}: the quick brown fox {i}." for i in range(12))
    r = oa.completions.create(model="m", prompt=prompt, max_tokens=12, n=3, temperature=1.2, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1 and r.usage.completion_tokens == 36
    same = oa.completions.create(model="m", prompt=prompt, max_tokens=8, n=2, temperature=0)
    assert same.choices[0].text == same.choices[1].text


def test_n_choices_stream_interleaved_by_index(oa):
    ask = [{"role": "user", "content": "Name a fruit."}]
    whole = oa.chat.completions.create(model="m", messages=ask, max_tokens=10, n=3, temperature=1.0, seed=4)
    chunks = list(oa.chat.completions.create(model="m", messages=ask, max_tokens=10, n=3, temperature=1.0,
                                             seed=4, stream=True, stream_options={"include_usage": True}))
    texts, reasons = {}, {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and sorted(reasons) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]   # seeds 4, 5, 6
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_embeddings_through_the_openai_client_are_the_oracles(oa, door, oracle, tokenizer):
    """/v1/embeddings with the official client (which asks for base64 unless told otherwise)
    and as floats: the mean of the prompt rows' final hidden states, L2-normalized, as the
    oracle computes it, one per input in order; usage counts the inputs' tokens. What the
    service does not honour is a 400 naming it; the key is needed here too."""
    import numpy as np
    import requests
    texts = ["The capital of France is", "def fib(n):\n    return n", "Once upon a time"]
    want = []
    for t in texts:
        ids = tokenizer.encode(t)
        h = oracle._hidden(ids, 0, oracle.new_cache(len(ids))).astype(np.float64).mean(0)
        want.append(h / np.linalg.norm(h))
    for fmt in ({}, {"encoding_format": "float"}):
        r = oa.embeddings.create(model="m", input=texts, **fmt)
        assert [d.index for d in r.data] == [0, 1, 2]
        np.testing.assert_allclose([d.embedding for d in r.data], want, atol=2e-5)
        assert r.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    url, auth = door[1] + "/v1/embeddings", {"Authorization": f"Bearer {KEY}"}
    assert requests.post(url, json={"input": "Hi"}, timeout=60).status_code == 401
    for body, param in (({"input": "Hi", "dimensions": 8}, "dimensions"), ({"input": ""}, "input"),
                        ({"input": []}, "input"), ({"input": "Hi", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "Hi", "pooling": "max"}, "pooling")):
        r = requests.post(url, json=body, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    import ollama                                  # Ollama's /api/embed: the same vectors
    client = ollama.Client(host=door[1], headers=auth)
    r = client.embed(model="m", input=texts)
    np.testing.assert_allclose(r.embeddings, want, atol=2e-5)
    assert r.prompt_eval_count == sum(len(tokenizer.encode(t)) for t in texts)
    with pytest.raises(ollama.ResponseError, match="dimensions"):
        client.embed(model="m", input="Hi", dimensions=8)
    long = " ".join(f"w{i}" for i in range(400))           # over the 512-token context
    ids = tokenizer.encode(long)
    assert len(ids) > 512
    cut = oa.embeddings.create(model="m", input=ids[:511], encoding_format="float")
    r = client.embed(model="m", input=long)                # Ollama's truncate (its default): the end cut
    assert r.prompt_eval_count == 511
    np.testing.assert_allclose(r.embeddings[0], cut.data[0].embedding, atol=1e-6)
    with pytest.raises(ollama.ResponseError, match="context") as e:
        client.embed(model="m", input=long, truncate=False)
    assert e.value.status_code == 400
