"""Ghidorah's hetero-core model parallelism in the one engine (`--plan hcmp`, graph/hcmp.py): a
decode batch's attention split into its dense part (the KV cache, on the GPU's kernels) and its
sparse part (the drafted rows' keys, on the CPU actor), merged by online softmax, with the
verifying steps of speculative decoding on it: the same tokens as plain decoding and as the
oracle at f32, drafted chains and trees, several sequences in a step."""
from __future__ import annotations

import pytest

from testlib import PROMPTS
from test_speculative import COPY, LIST, _spec


@pytest.fixture(scope="module")
def llm(ray_session):
    import socllm
    with socllm.LLM(precision="f32", context=512, max_seqs=8, kv_mb=24, plan="hcmp",
                    policy="fcfs", speculate="lookup", draft_max=6) as llm:
        yield llm


def _ran(llm, before: dict) -> dict:
    after = llm.status()["steps_by_program"]
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def test_the_plan_runs_decode_batches_on_the_gpu_and_the_cpu_and_prefill_on_the_gpu(llm):
    pl = llm.describe["placement"]
    assert llm.describe["plan"] == "hcmp" and pl["decode"] == "hcmp" and pl["prefill"] == "gpu"
    assert {p["processor"] for p in llm.status()["processors"]} == {"gpu", "cpu"}


def _cpu_steps(llm) -> int:
    return next(p["steps"] for p in llm.status()["processors"] if p["processor"] == "cpu")


def test_verifying_steps_split_across_processors_give_the_oracles_tokens(llm, oracle, tokenizer):
    ids = tokenizer.encode(COPY)
    want = oracle.greedy(ids, 24)
    before, cpu = llm.status()["steps_by_program"], _cpu_steps(llm)
    [out] = llm.generate(COPY, max_tokens=24)
    assert _spec(out)["accepted_prediction_tokens"] >= 10       # drafted rows decided tokens
    assert out.text == tokenizer.decode(want)
    ran = _ran(llm, before)
    assert ran.get("hcmp batch", 0) > 0 and ran.get("gpu chunk", 0) > 0, ran
    assert _cpu_steps(llm) - cpu == ran["hcmp batch"]          # the sparse parts: every batch


def test_several_sequences_drafting_in_one_split_step_keep_plain_decodings_tokens(llm):
    prompts = [COPY, LIST, *PROMPTS]
    plain = llm.generate(prompts, max_tokens=32, speculate="off")
    drafted = llm.generate(prompts, max_tokens=32)
    assert [o.text for o in drafted] == [o.text for o in plain]
    assert len({o.text for o in plain}) == len(prompts)
    assert sum(_spec(o)["accepted_prediction_tokens"] for o in drafted) >= 20


def test_draft_trees_off_their_chains_keep_plain_decodings_tokens(llm):
    """The heads' trees: an off-chain node's sparse part is its ancestors' keys (its tree entry),
    a chain row's its sequence's drafted keys; accepted paths off the chain are fed again."""
    convs = [[{"role": "user", "content": c}] for c in
             ("Write a short poem about the sea.", "Explain what a volcano is.")]
    plain = llm.chat(convs, max_tokens=40, speculate="off")
    tree = llm.status()["speculation"]["tree"]
    drafted = llm.chat(convs, max_tokens=40, speculate="heads")
    assert [o.text for o in drafted] == [o.text for o in plain]
    after = llm.status()["speculation"]["tree"]
    assert after["ranks"] == 2 and after["steps"] > tree["steps"]
    assert sum(_spec(o)["accepted_prediction_tokens"] for o in drafted) >= 5
