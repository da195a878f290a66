"""socllm.LLM: a batch of prompts on the service's paged engine, owned by this process."""
from __future__ import annotations

import pytest

from testlib import PROMPTS


def _greedy_text(oracle, tokenizer, prompt: str, n: int) -> tuple[str, str]:
    """The oracle's greedy text of n tokens (cut at a stop token) and its finish reason."""
    ids = oracle.greedy(tokenizer.encode(prompt), n)
    stops = set(tokenizer.stop_ids())
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    return tokenizer.decode(ids[:cut]), ("stop" if cut is not None else "length")


@pytest.fixture(scope="module")
def llm(ray_session):
    import socllm
    with socllm.LLM(precision="f32", context=256, max_seqs=4, kv_mb=16, plan="gpu") as llm:
        yield llm


def test_a_batch_gives_the_oracles_greedy_text_in_order(llm, oracle, tokenizer):
    """Three different prompts (their greedy texts differ) decode together, each the oracle's."""
    outs = llm.generate(list(PROMPTS), max_tokens=16)
    assert [o.text for o in outs] == [_greedy_text(oracle, tokenizer, p, 16)[0] for p in PROMPTS]
    assert len({o.text for o in outs}) == len(PROMPTS)
    for o, p in zip(outs, PROMPTS):
        assert o.finish_reason == _greedy_text(oracle, tokenizer, p, 16)[1]
        assert o.usage["prompt_tokens"] == len(tokenizer.encode(p))


def test_one_prompt_a_chat_and_sampling_params(llm, oracle, tokenizer):
    [one] = llm.generate(PROMPTS[0], max_tokens=8)
    assert one.text == _greedy_text(oracle, tokenizer, PROMPTS[0], 8)[0]
    [reply] = llm.chat([{"role": "user", "content": "Name three colours."}], max_tokens=12)
    assert reply.text and reply.usage["completion_tokens"] <= 12
    a, b = llm.generate([PROMPTS[2]] * 2, max_tokens=16, temperature=1.3, seed=7)
    assert a.text == b.text                          # one seed, one draw, batched or not


def test_bad_input_is_refused_in_one_line(llm):
    import socllm
    with pytest.raises(ValueError, match="HTTP"):
        socllm.LLM(http_port=8000)
    with pytest.raises(ValueError, match="non-empty"):
        llm.generate([])
    with pytest.raises(ValueError, match="must be a str"):
        llm.generate(["fine", 3])
    with pytest.raises(ValueError):
        llm.generate(PROMPTS[0], max_tokens=0)
