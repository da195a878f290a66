"""socllm.LLM: a batch of prompts on the service's paged engine, owned by this process."""
from __future__ import annotations

import pytest

from testlib import PROMPTS

IDLE_S = 3.0          # the engine's prefix_cache_idle_s: idle this long, it lets its cache go


def _greedy_text(oracle, tokenizer, prompt: str, n: int) -> tuple[str, str]:
    """The oracle's greedy text of n tokens (cut at a stop token) and its finish reason."""
    ids = oracle.greedy(tokenizer.encode(prompt), n)
    stops = set(tokenizer.stop_ids())
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    return tokenizer.decode(ids[:cut]), ("stop" if cut is not None else "length")


@pytest.fixture(scope="module")
def llm(ray_session):
    import socllm
    with socllm.LLM(precision="f32", context=256, max_seqs=4, kv_mb=16, plan="gpu",
                    prefix_cache_idle_s=IDLE_S) as llm:
        yield llm


def test_a_batch_gives_the_oracles_greedy_text_in_order(llm, oracle, tokenizer):
    """Three different prompts (their greedy texts differ) decode together, each the oracle's."""
    outs = llm.generate(list(PROMPTS), max_tokens=16)
    assert [o.text for o in outs] == [_greedy_text(oracle, tokenizer, p, 16)[0] for p in PROMPTS]
    assert len({o.text for o in outs}) == len(PROMPTS)
    for o, p in zip(outs, PROMPTS):
        assert o.finish_reason == _greedy_text(oracle, tokenizer, p, 16)[1]
        assert o.usage["prompt_tokens"] == len(tokenizer.encode(p))


def test_an_idle_engine_lets_its_prefix_cache_go_and_computes_the_same_text(llm, oracle, tokenizer):
    """Idle for prefix_cache_idle_s, the engine lets its prefix cache go, every
    free block's pages back to the OS, and the mask library: the same prompt is then computed
    whole, with the same (the oracle's) text; before that, its blocks are found in the cache; a
    JSON-constrained reply parses before and after (the library built again)."""
    import json
    import time
    prompt = " ".join(PROMPTS * 2)
    asked = [{"role": "user", "content": "A JSON object with a name, please."}]
    named = {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"], "additionalProperties": False}}}
    assert set(json.loads(llm.chat(asked, max_tokens=40, response_format=named)[0].text)) == {"name"}
    [a] = llm.generate(prompt, max_tokens=8)
    [b] = llm.generate(prompt, max_tokens=8)
    assert b.usage["prompt_tokens_details"]["cached_tokens"] >= 16
    before = llm.status()["kv"]
    assert before["idle_s"] == IDLE_S and before["cached_blocks"] > 0 and before["mask_library_loaded"]
    end = time.monotonic() + 120
    while llm.status()["kv"]["drops"] == before["drops"] and time.monotonic() < end:
        time.sleep(0.2)
    kv = llm.status()["kv"]
    assert kv["drops"] == before["drops"] + 1 and kv["cached_blocks"] == 0
    assert kv["written_free_blocks"] == 0, "pages of free blocks were kept"
    assert kv["dropped_blocks"] > before["dropped_blocks"] and not kv["mask_library_loaded"]
    [c] = llm.generate(prompt, max_tokens=8)
    assert c.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert a.text == b.text == c.text == _greedy_text(oracle, tokenizer, prompt, 8)[0]
    assert set(json.loads(llm.chat(asked, max_tokens=40, response_format=named)[0].text)) == {"name"}


def test_one_prompt_a_chat_and_sampling_params(llm, oracle, tokenizer):
    [one] = llm.generate(PROMPTS[0], max_tokens=8)
    assert one.text == _greedy_text(oracle, tokenizer, PROMPTS[0], 8)[0]
    [reply] = llm.chat([{"role": "user", "content": "Name three colours."}], max_tokens=12)
    assert reply.text and reply.usage["completion_tokens"] <= 12
    a, b = llm.generate([PROMPTS[2]] * 2, max_tokens=16, temperature=1.3, seed=7)
    assert a.text == b.text                          # one seed, one draw, batched or not


def test_a_batch_gives_each_prompts_logprobs_and_its_replys(llm, oracle, tokenizer):
    """logprobs and prompt_logprobs, as vLLM's LLM gives them: each prompt token's (after the
    first) the oracle's teacher-forced log-softmax at f32, with its rank; each reply token's the
    greedy token's, its top alternative the token itself."""
    import numpy as np
    outs = llm.generate(list(PROMPTS[:2]), max_tokens=6, logprobs=1, prompt_logprobs=2)
    for o, p in zip(outs, PROMPTS):
        ids = tokenizer.encode(p)
        z = oracle.logits_for(ids).astype(np.float64)
        lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
        assert len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[0]["logprob"] is None
        got = [e["logprob"] for e in o.prompt_logprobs[1:]]
        np.testing.assert_allclose(got, [z[j - 1, ids[j]] - lse[j - 1] for j in range(1, len(ids))], atol=5e-3)
        assert [e["id"] for e in o.prompt_logprobs] == ids
        assert all(e["rank"] >= 1 and len(e["top_logprobs"]) == 2 for e in o.prompt_logprobs[1:])
        assert "".join(e["token"] for e in o.logprobs) == o.text
        assert all(e["top_logprobs"][0]["token"] == e["token"] for e in o.logprobs)


def test_a_warm_gpu_engine_runs_without_its_planner(llm, oracle, tokenizer):
    """Once a plan on the GPU alone has every program compiled (warmed at start), its planner
    actor is stopped: status counts no planner process, and requests still get the oracle's text,
    also after the GPU actor is killed (the runner holds the programs)."""
    import os
    import signal
    st = llm.status()
    assert "planner" not in st["memory_pss_mb_by_process"] and "gpu" in st["memory_pss_mb_by_process"]
    [one] = llm.generate(PROMPTS[1], max_tokens=8)
    assert one.text == _greedy_text(oracle, tokenizer, PROMPTS[1], 8)[0]
    # a GPU actor killed: Ray restarts it and the programs are installed from the runner's copy
    gpu = next(p["pid"] for p in st["processors"] if p["processor"] == "gpu")
    os.kill(gpu, signal.SIGKILL)
    [two] = llm.generate(PROMPTS[2], max_tokens=8)
    assert two.text == _greedy_text(oracle, tokenizer, PROMPTS[2], 8)[0]
    st = llm.status()
    assert st["recoveries_total"] == 1 and "planner" not in st["memory_pss_mb_by_process"]
    assert next(p["pid"] for p in st["processors"] if p["processor"] == "gpu") not in (gpu, None)


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
    with pytest.raises(ValueError, match="no setting bogus"):        # not ServeConfig's TypeError
        socllm.LLM(bogus=1)
    for bad in ("hi", []):
        with pytest.raises(ValueError, match="conversation"):
            llm.chat(bad)
    [same] = llm.generate(PROMPTS[0], max_tokens=4, priority=None)     # the default, as null over HTTP
    assert same.text == llm.generate(PROMPTS[0], max_tokens=4)[0].text


def test_an_llm_left_open_is_closed_when_the_program_ends(ray_session):
    """A script that never closes its socllm.LLM: at its exit the engine stops as close() stops
    it, and its pool's shared memory goes with it (Ray killed the service before it could)."""
    import glob
    import subprocess
    import sys
    code = ("import socllm; llm = socllm.LLM(context=256, max_seqs=2, kv_mb=8); "
            "print(llm.generate('Hi', max_tokens=2)[0].text)")
    before = set(glob.glob("/dev/shm/socllm-*"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(glob.glob("/dev/shm/socllm-*")) <= before, "the pool's segment was left behind"


def _thread_env(pid: int) -> dict:
    env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    return {k: env.get(k) for k in ("OMP_NUM_THREADS", "POCL_MAX_PTHREAD_COUNT")}


def test_every_actor_gets_the_thread_budget_joined_or_private(llm, short_tmp):
    """The service and its processor actors size their libraries' thread pools from the budget
    (policies/threads.py): in a Ray that socllm joins, through a runtime_env; in a private Ray
    that it starts, from the environment Ray started with (no runtime_env: each actor starts
    sooner), which the process gets back unchanged when that Ray stops. That Ray runs no API
    server."""
    import json
    import os
    import subprocess
    import sys
    st = llm.status()
    threads = str(st["processors"][0]["threads"])
    for pid in [st["pid"]] + [p["pid"] for p in st["processors"]]:
        assert _thread_env(pid) == {"OMP_NUM_THREADS": threads, "POCL_MAX_PTHREAD_COUNT": threads}
    script = f"""
import json, os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_llm import _thread_env
import socllm
import psutil
with socllm.LLM(context=64, max_seqs=1, kv_mb=1, threads=1, plan="gpu") as llm:
    st = llm.status()
    cmds = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    print(json.dumps(cmds))
    print(json.dumps([_thread_env(p) for p in [st["pid"]] + [q["pid"] for q in st["processors"]]]))
    dash = "aiohttp" in sys.modules
print(json.dumps({{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "SOCLLM_RAY_ENV")}} | {{"aiohttp": dash}}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS")}
    env["RAY_TMPDIR"] = short_tmp
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    cmds, actors, after = [json.loads(line) for line in r.stdout.strip().splitlines()[-3:]]
    # the private Ray runs without Ray's API server (actors/front/cluster.py _no_api_server), and the
    # daemons stopped as they appeared are reaped (a zombie's cmdline() would have raised)
    # nor its dashboard libraries imported in this process only to learn they are installed:
    # the dashboard agent still runs in its full form, as Ray starts it where they are
    assert any("raylet" in c for c in cmds) and not any("dashboard/dashboard.py" in c for c in cmds), cmds
    assert any("dashboard/agent.py" in c and "--minimal" not in c for c in cmds), cmds
    assert len(actors) == 2 and all(e == {"OMP_NUM_THREADS": "1", "POCL_MAX_PTHREAD_COUNT": "1"}
                                    for e in actors)
    assert after == {"OMP_NUM_THREADS": None, "SOCLLM_RAY_ENV": None, "aiohttp": False}


def _oracle_embedding(oracle, ids: list, pooling: str):
    import numpy as np
    h = oracle._hidden(ids, 0, oracle.new_cache(len(ids))).astype(np.float64)
    v = h.mean(0) if pooling == "mean" else h[-1]
    return v / np.linalg.norm(v)


def test_embeddings_are_the_oracles_pooled_hidden_states(llm, oracle, tokenizer):
    """An embedding: the prompt rows' final-normed hidden states (the LM head's input), their
    mean or the last, L2-normalized, as the oracle computes them, in order; a prompt longer than
    one chunk (128 rows), pooled over both; a prompt whose blocks an earlier request left in the
    prefix cache is computed whole (every row's state is needed)."""
    import numpy as np
    texts = [PROMPTS[0], " ".join([PROMPTS[2], PROMPTS[1], PROMPTS[0]] * 6)]
    assert 128 < len(tokenizer.encode(texts[1])) < 250
    rows, chunk = sum(len(tokenizer.encode(t)) for t in texts), llm.status()["prefill_chunk"]
    for pooling in ("mean", "last"):
        llm.generate(texts[1], max_tokens=2)      # its blocks cached (the engine's IDLE_S is short)
        before = llm.status()["loop"]["prefill_chunks"]
        got = np.array(llm.embed(texts, pooling))
        want = [_oracle_embedding(oracle, tokenizer.encode(t), pooling) for t in texts]
        np.testing.assert_allclose(got, want, atol=2e-5)
        assert abs(float(got[0] @ got[1])) < 0.999          # different texts, different vectors
        # queued at once, the inputs' rows share chunks: the short one and the long one's first
        # rows in one, the long one's rest in the next
        assert llm.status()["loop"]["prefill_chunks"] - before == -(-rows // chunk) < len(texts) + 1
    [one] = llm.embed(tokenizer.encode(PROMPTS[1]))          # token ids
    np.testing.assert_allclose(one, _oracle_embedding(oracle, tokenizer.encode(PROMPTS[1]), "mean"), atol=2e-5)
    counts = llm.status()["requests"]
    for bad, name in ((dict(pooling="max"), "pooling"), (dict(inputs=""), "empty"),
                      (dict(inputs=[PROMPTS[0], ""]), "empty")):
        with pytest.raises(ValueError, match=name):
            llm.embed(**{"inputs": PROMPTS[0], **bad})
    assert llm.status()["requests"] == counts        # all or none: the good input did not queue
    assert llm.status()["kv"]["sequences_used"] == 0
