"""The service as users meet it: `socllm serve` into the test session's Ray cluster, the Python
client (sync, streaming, asyncio), a `ray job`, the OpenAI HTTP endpoint through the official
`openai` package, bad input, cancellation, and `socllm stop` leaving nothing behind."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from testlib import free_port

SOCLLM = [sys.executable, "-m", "socllm.actors.front.cli"]
FRANCE = "The capital of France is"
COUNT = "1, 2, 3, 4, 5, 6, 7, 8,"          # greedy: counts on for hundreds of tokens
ABANDON_S = 3.0                             # the served fixture's --abandon-s
STORY = "Once upon a time"
SAMPLED = dict(max_tokens=24, temperature=1.3, top_p=0.95)   # sampled text varies with the seed


def _segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("socllm-")}


@pytest.fixture(scope="module")
def served(ray_session):
    """`socllm serve` (f32: the oracle's greedy path; the default policy, agent, which serves
    requests of one class as FCFS does; prompts' chunks on the NPU's static graphs, decode on
    the GPU, one paged KV cache: Agent.xpu §4.3. The agent policy's proactive chunks run on the
    GPU in the second buffer, stopping between layers) -> (env for CLI subprocesses, base URL)."""
    env = {**os.environ, "RAY_ADDRESS": ray_session[0]}
    port = free_port()
    r = subprocess.run(SOCLLM + ["serve", "--http-port", str(port), "--context", "512",
                                 "--max-seqs", "8", "--kv-mb", "64", "--precision", "f32",
                                 "--plan", "hetero", "--abandon-s", str(ABANDON_S),
                                 "--prefix-cache-mb", "32"],
                       env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    yield env, f"http://127.0.0.1:{port}"
    subprocess.run(SOCLLM + ["stop"], env=env, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def client(served):
    import socllm
    return socllm.connect()


def _cli(env, *args, timeout=120):
    return subprocess.run(SOCLLM + list(args), env=env, capture_output=True, text=True, timeout=timeout)


def _want(oracle, tokenizer, prompt, n, chat_ids=None):
    """The oracle's greedy text for `prompt` (n tokens, cut at a stop token)."""
    ids = chat_ids or tokenizer.encode(prompt)
    toks = oracle.greedy(ids, n)
    stops = set(tokenizer.stop_ids())
    cut = next((i for i, t in enumerate(toks) if t in stops), len(toks))
    return tokenizer.decode(toks[:cut])


def _chat_want(oracle, tokenizer, gguf_reader, messages, n):
    """The oracle's greedy reply to a chat (the model's own template, as the service renders it)."""
    from socllm.models.chat import render_chat
    ids = tokenizer.encode(render_chat(gguf_reader, messages), bos=tokenizer.add_bos)
    return _want(oracle, tokenizer, None, n, chat_ids=ids)


def _pid(client, processor):
    return next(p["pid"] for p in client.status()["processors"] if p["processor"] == processor)


@contextlib.contextmanager
def _paused(pid):
    """The process stopped (SIGSTOP) inside the block and continued after it: the service's loop
    waits in its step for as long as the test holds it, whatever the machine's speed. (Ask the
    service nothing that needs this process meanwhile: `status` asks every actor.)"""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_serve_again_says_it_runs_and_exits_0(served):
    r = _cli(served[0], "serve")
    assert r.returncode == 0 and "already running" in r.stdout


def test_status_reports_model_requests_kv_processors_memory(served):
    r = _cli(served[0], "status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["model"].endswith(".gguf") and st["precision"] == "f32" and st["context"] == 512 \
        and st["kv_dtype"] == "f32" and st["policy"] == "agent"
    assert {"waiting", "finished", "cancelled", "failed"} <= set(st["requests"])
    assert st["kv"]["blocks"] >= 64 * 2**20 // (30 * 2 * 16 * 192 * 4) and st["memory_pss_mb"] > 100
    assert {p["processor"] for p in st["processors"]} == {"gpu", "npu"}    # hetero's only
    # every socllm process by name; the planner among them only where a program had to be
    # compiled (the NPU's static buckets are compiled as requests need them, unless a run
    # before this one in the same checkout left them in the program cache)
    assert {"service", "gpu", "npu", "http"} <= set(st["memory_pss_mb_by_process"]) \
        <= {"service", "gpu", "npu", "http", "planner"}
    assert st["frontends"]["http"] == served[1]
    assert st["placement"] == {"asked": "hetero", "plan": "hetero", "from": "asked", "decode": "gpu",
                               "prefill": "npu", "else": "gpu", "chunk_ms": {}, "npu_from": 0,
                               "npu_later": True, "batch_ms": {}, "npu_batches": []} \
        and st["plan"] == "hetero"
    # no proactive work runs where a reactive arrival could not stop it within the bound
    pre = st["preemption"]
    assert pre == {"bound_ms": 50.0, "proactive": "gpu spans of ~20 ms", "npu_chunk_ms": None,
                   "npu_runs": "reactive chunks, and proactive prompts' first chunks where they "
                   "take at most the bound", "npu_first_ms": pre["npu_first_ms"]}
    # a prompt's first chunk in the NPU's whole-model graph: timed where one ran (the warm-up's)
    assert pre["npu_first_ms"] is None or pre["npu_first_ms"] > 0
    r = _cli(served[0], "status")
    assert "plan       hetero (as asked): chunks of 128 rows on the npu (chunks it cannot take: " \
        "the gpu), decode on the gpu" in r.stdout
    assert "preemption proactive chunks stop between gpu spans of ~20 ms (bound 50 ms" in r.stdout \
        and "the npu runs reactive chunks, and proactive prompts' first chunks where they take at " \
        "most the bound); reactive ones run whole" in r.stdout
    # speculation is on by default, its step costs measured at start (policies/drafting.py)
    assert st["speculation"]["mode"] == "auto" and len(st["speculation"]["step_ms"]) == st["max_seqs"]
    assert "speculate  auto (at most 8 drafted a step): " in r.stdout and "step ms by rows 1:" in r.stdout


def test_status_counts_the_loops_steps(client):
    before = client.status()["loop"]
    client.generate(FRANCE, max_tokens=6, ignore_eos=True, speculate="off")   # a token a step
    after = client.status()["loop"]
    assert after["prefill_chunks"] >= before["prefill_chunks"] + 1
    assert after["decode_steps"] >= before["decode_steps"] + 5           # the first token: prefill's
    assert after["decode_rows"] - before["decode_rows"] >= after["decode_steps"] - before["decode_steps"]
    assert after["decode_s"] > before["decode_s"] and after["decode_kernels_s"] <= after["decode_s"]


def test_client_text_equals_the_oracle_stream_and_not(client, oracle, tokenizer):
    want = _want(oracle, tokenizer, FRANCE, 12)
    assert client.generate(FRANCE, max_tokens=12) == want
    pieces = list(client.generate(FRANCE, max_tokens=12, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == want


def test_cli_generate_uses_the_service(served, oracle, tokenizer):
    r = _cli(served[0], "generate", FRANCE, "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == _want(oracle, tokenizer, FRANCE, 8) and out["precision"] == "f32"
    r = _cli(served[0], "generate", FRANCE, "--plan", "npu")
    assert r.returncode == 2 and "--local" in r.stderr
    # --local: the same paged engine, private to the command (its own actors, stopped after):
    # the same text and the same plan as the service's
    r = _cli(served[0], "generate", FRANCE, "--max-tokens", "8", "--json", "--local",
             "--precision", "f32", "--plan", "hetero", timeout=240)
    assert r.returncode == 0, r.stderr
    local = json.loads(r.stdout)
    assert (local["text"], local["plan"], local["placement"]) == (out["text"], "hetero", out["placement"])


def _no_ray(folder) -> str:
    """A folder whose `ray` fails to import: first on PYTHONPATH, a command importing Ray fails."""
    (folder / "ray").mkdir()
    (folder / "ray" / "__init__.py").write_text("raise ImportError('this command imported ray')\n")
    return str(folder)


def test_cli_generate_streams_from_the_services_http_without_ray(served, oracle, tokenizer,
                                                                 gguf_reader, tmp_path):
    """With a service running, `socllm generate` streams from its HTTP endpoint, found through
    the record `serve` wrote (actors/front/direct.py), and never imports Ray: the oracle's text,
    plain and as a chat. A record another user could have written, or one whose process has
    ended, is passed over: Ray's path serves the same text."""
    from socllm.actors.front.direct import record_path
    env = {**served[0], "PYTHONPATH": _no_ray(tmp_path)}
    want = _want(oracle, tokenizer, FRANCE, 8)
    r = _cli(env, "generate", FRANCE, "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert "[service over HTTP: hetero (prefill npu+decode gpu), f32: ttft " in r.stderr
    msgs = [{"role": "user", "content": FRANCE}]
    r = _cli(env, "generate", FRANCE, "--max-tokens", "8", "--chat")
    assert r.returncode == 0 and r.stdout == _chat_want(oracle, tokenizer, gguf_reader, msgs, 8) + "\n"
    r = _cli(env, "generate", FRANCE, "--precision", "q8")        # checked against the record
    assert r.returncode == 2 and "--local" in r.stderr and "f32" in r.stderr
    path = record_path(served[0]["RAY_ADDRESS"])
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    saved = json.load(open(path))
    assert saved["url"] == served[1] and saved["api_key"] is False and saved["pid"] == _pid_of_service(served)
    ended = subprocess.Popen(["true"])
    ended.wait()
    try:
        for spoil in (lambda: os.chmod(path, 0o622),
                      lambda: json.dump(saved | {"pid": ended.pid}, open(path, "w"))):
            spoil()
            r = _cli(env, "generate", FRANCE, "--max-tokens", "8")
            assert r.returncode != 0 and "this command imported ray" in r.stderr   # Ray's path
            r = _cli(served[0], "generate", FRANCE, "--max-tokens", "8")
            assert r.returncode == 0 and r.stdout == want + "\n" and "[service: hetero" in r.stderr
    finally:
        json.dump(saved, open(path, "w"))
        os.chmod(path, 0o600)


def _pid_of_service(served) -> int:
    return json.loads(_cli(served[0], "status", "--json").stdout)["pid"]


def test_mixed_requests_at_once_each_get_their_oracle_text(client, oracle, tokenizer):
    prompts = ["def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "The weather today",
               "Paris is", "import numpy as np", "My favourite colour is", "word " * 60]
    out = {}

    def one(p):
        out[p] = client.generate(p, max_tokens=6)
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for p in prompts:
        assert out[p] == _want(oracle, tokenizer, p, 6), p


def test_a_reactive_request_overtakes_a_long_proactive_prefill(client, oracle, tokenizer, model_config):
    """Agent.xpu §4.4: a reactive request arriving while a 3-chunk proactive prefill runs stops
    that chunk between two layers, prefills and gets its first token first; the proactive chunk
    resumes at the layer where it stopped and its text is still the oracle's (preemption changes
    no result). The GPU actor, which runs the proactive chunks' spans, is held stopped while the
    reactive request arrives, so it arrives inside the first chunk's first span on any machine.
    (A prompt's first chunk runs whole on the NPU where such chunks took at most the bound, on a
    fast machine: so its first 128 tokens are cached first, and its prefill starts past them.)"""
    import ray
    long = " ".join(f"item {i}," for i in range(70))            # ~350 tokens: 3 chunks of 128
    ids = tokenizer.encode(long)
    assert len(ids) > 256
    assert "".join(client.pieces(client.submit(ids=ids[:128], max_tokens=1)))
    stages = model_config.n_layers + 2                          # actors/runner.py Runner.stages
    gpu, stops = _pid(client, "gpu"), client.status()["loop"]["prefill_stops"]
    texts = {}                    # p's text is read as it comes (a request nobody polls ends)
    with _paused(gpu):
        p = client.submit(prompt=long, max_tokens=4, priority="proactive")
        reader = threading.Thread(target=lambda: texts.update({p: "".join(client.pieces(p))}))
        reader.start()
        _until(lambda: ray.get(client.service.request.remote(p))["prefill_start"] is not None, 60)
        r = client.submit(prompt=FRANCE, max_tokens=4, priority="reactive")
    texts[r] = "".join(client.pieces(r))
    reader.join(120)
    info = {rid: ray.get(client.service.request.remote(rid)) for rid in (r, p)}
    assert info[r]["priority"] == "reactive" and info[p]["priority"] == "proactive"
    span = re.fullmatch(r"span proactive \d+ 0-(\d+)", info[r]["arrived_during"])
    assert span, f"the reactive request arrived during {info[r]['arrived_during']!r}, not p's first span"
    assert info[r]["first_token"] < info[p]["first_token"]
    # preemption latency: the reactive prefill waited at most for the proactive span running
    assert info[p]["prefill_start"] < info[r]["prefill_start"] < info[p]["first_token"]
    assert texts[r] == _want(oracle, tokenizer, FRANCE, 4)
    assert texts[p] == _want(oracle, tokenizer, long, 4)
    if int(span[1]) < stages:     # the span held fewer than all of the chunk's stages: it stopped
        assert client.status()["loop"]["prefill_stops"] > stops      # mid-chunk, between spans


def test_asyncio_stream_and_task_cancellation(client, oracle, tokenizer):
    async def main():
        got = [p async for p in client.agenerate(FRANCE, max_tokens=8)]
        pieces = []

        async def long():
            async for p in client.agenerate(COUNT, max_tokens=400):
                pieces.append(p)
        task = asyncio.create_task(long())
        while len(pieces) < 3 and not task.done():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return "".join(got)
    before = client.status()["requests"]["cancelled"]
    assert asyncio.run(main()) == _want(oracle, tokenizer, FRANCE, 8)
    _until(lambda: client.status()["requests"]["cancelled"] == before + 1)
    st = client.status()
    assert st["kv"]["blocks_used"] == 0 and st["kv"]["sequences_used"] == 0


def test_asyncio_streams_at_once_each_get_their_oracle_text(client, oracle, tokenizer):
    """Streams of one event loop are polled together (client.py PollHub: one call for all):
    each still gets its own text, whole and in order, and one that joins while the others'
    call waits is answered."""
    prompts = [FRANCE, STORY, COUNT]

    async def one(prompt, delay):
        await asyncio.sleep(delay)
        return "".join([p async for p in client.agenerate(prompt, max_tokens=10)])

    async def main():
        return await asyncio.gather(*(one(p, 0.05 * i) for i, p in enumerate(prompts)))
    assert asyncio.run(main()) == [_want(oracle, tokenizer, p, 10) for p in prompts]


def test_poll_many_answers_news_a_poke_and_missing_ids(client):
    """poll_many (PollHub's call): it waits while none of its requests has anything new, and
    returns at once when its hub is poked (a new stream of the hub is not in the call), even
    while no step can run (the GPU actor held stopped); an id the service does not know answers
    "missing"; a poke before the call makes it return at once."""
    import ray
    svc = client.service
    rid = ray.get(svc.submit.remote(prompt=COUNT, max_tokens=400, ignore_eos=True))
    try:
        first = ray.get(svc.poll_many.remote("h1", {rid: (0, 0)}, 60.0), timeout=60)
        assert first[rid]["seen"] >= 1 and first[rid]["pieces"]
        with _paused(_pid(client, "gpu")):
            call = svc.poll_many.remote("h1", {rid: (10 ** 6, 0)}, 600.0)   # nothing new can come
            ready, _ = ray.wait([call], timeout=0.5)
            assert not ready
            ray.get(svc.poke.remote("h1"))
            assert ray.get(call, timeout=60) == {}
            ray.get(svc.poke.remote("h2"))
            assert ray.get(svc.poll_many.remote("h2", {rid: (10 ** 6, 0)}, 600.0), timeout=60) == {}
        assert ray.get(svc.poll_many.remote("h3", {"guess": (0, 0)}, 1.0)) == {"guess": {"missing": True}}
    finally:
        client.cancel(rid)


def test_breaking_out_of_a_stream_cancels_and_the_next_request_runs(client, oracle, tokenizer):
    before = client.status()["requests"]["cancelled"]
    for i, _ in enumerate(client.generate(COUNT, max_tokens=400, stream=True)):
        if i == 2:
            break
    _until(lambda: client.status()["requests"]["cancelled"] == before + 1)
    assert client.generate(FRANCE, max_tokens=4) == _want(oracle, tokenizer, FRANCE, 4)


def test_stop_strings_and_stop_tokens_never_reach_the_text(client, oracle, tokenizer, gguf_reader):
    full = client.generate(FRANCE, max_tokens=12)
    assert " Paris" in full
    assert client.generate(FRANCE, max_tokens=12, stop=[" Paris"]) == full[:full.index(" Paris")]
    msgs = [{"role": "user", "content": "Say hello."}]
    reply = client.chat(msgs, max_tokens=40)
    assert reply == _chat_want(oracle, tokenizer, gguf_reader, msgs, 40)
    assert reply and "<|im_end|>" not in reply and "<|im_start|>" not in reply


def test_seed_temperature_and_top_p_reach_the_sampler(client, oracle, tokenizer):
    """Sampled text (T 1.3, top_p 0.95, 24 tokens): the same seed twice gives the same text,
    other seeds other texts; temperature 0 is the oracle's greedy text whatever the seed and
    top_p, and so is a nucleus of one token (top_p 1e-6) at T 1.5, where top_p 1 is not."""
    greedy = _want(oracle, tokenizer, STORY, 24)
    a = client.generate(STORY, seed=1, ignore_eos=True, **SAMPLED)
    assert client.generate(STORY, seed=1, ignore_eos=True, **SAMPLED) == a
    others = {client.generate(STORY, seed=seed, ignore_eos=True, **SAMPLED) for seed in (2, 3)}
    assert a not in others and len(others) == 2
    assert a != greedy
    assert client.generate(STORY, max_tokens=24, temperature=0, top_p=0.5, seed=9) == greedy
    assert client.generate(STORY, max_tokens=24, temperature=1.5, top_p=1e-6, seed=9) == greedy
    assert client.generate(STORY, max_tokens=24, temperature=1.5, seed=9) != greedy


@pytest.mark.parametrize("kw, needle", [
    ({"priority": "urgent"}, "priority"), ({"max_tokens": 600}, "context holds 512"),
    ({"temperature": -1}, "temperature"), ({"stop": [""]}, "stop"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "x"}, "temperature"), ({"max_tokens": "5"}, "max_tokens"), ({"seed": "a"}, "seed"),
    ({"top_p": "1"}, "top_p"),
])
def test_bad_requests_raise_value_error_at_once(client, kw, needle):
    """A wrong value or a wrong type: a one-line ValueError naming it, not a remote traceback."""
    with pytest.raises(ValueError, match=needle) as e:
        client.generate(FRANCE, **kw)
    assert "--" not in str(e.value)            # a Python caller's names, not the CLI's flags
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_a_ray_job_gets_tokens(served, ray_session, oracle, tokenizer):
    code = ("import socllm; c = socllm.connect(); "
            f"print('TEXT=' + repr(c.generate({FRANCE!r}, max_tokens=4)))")
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit",
                        "--address", ray_session[1], "--", sys.executable, "-c", code],
                       env=served[0], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"TEXT={_want(oracle, tokenizer, FRANCE, 4)!r}" in r.stdout


# -- HTTP ----------------------------------------------------------------------------------------
def test_openai_package_completions_and_chat_stream_and_not(served, oracle, tokenizer, gguf_reader):
    import openai
    oa = openai.OpenAI(base_url=served[1] + "/v1", api_key="none")
    model = oa.models.list().data[0].id
    c = oa.completions.create(model=model, prompt=FRANCE, max_tokens=8, temperature=0)
    assert c.choices[0].text == _want(oracle, tokenizer, FRANCE, 8)
    assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens == 5
    # llama.cpp's server's `timings`: the first token came from the prefill, 7 from decoding
    t = c.model_extra["timings"]
    assert t["predicted_n"] == 7 and 0 <= t["prompt_n"] <= 5 and 0 < t["prompt_ms"] <= t["ttft_ms"] \
        and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = oa.chat.completions.create(model=model, messages=msgs, max_tokens=20)
    text = whole.choices[0].message.content
    assert text == _chat_want(oracle, tokenizer, gguf_reader, msgs, 20)
    assert text and "<|im_end|>" not in text
    chunks = oa.chat.completions.create(model=model, messages=msgs, max_tokens=20, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text


def test_a_prompt_sharing_a_cached_prefix_gets_the_cold_text_and_says_so(served, client, oracle,
                                                                         tokenizer):
    """The prefix cache (memory/blocks.py): a prompt longer than a prefill chunk, then the same
    with a suffix, then that again. Each text is the oracle's (the cached K/V are the cold
    ones'); usage says how many prompt tokens came from the cache, and status counts them."""
    import openai
    oa = openai.OpenAI(base_url=served[1] + "/v1", api_key="none")
    base = " ".join(f"Step {i}: put {i * 7 % 11} red apples in basket {i % 4}." for i in range(18))
    n = len(tokenizer.encode(base))
    assert n > 160
    before = client.status()["kv"]
    cached = []
    for p in (base, base + " Now count the apples in basket 2:", base + " Now count the apples in basket 2:"):
        r = oa.completions.create(model="socllm", prompt=p, max_tokens=8, temperature=0)
        assert r.choices[0].text == _want(oracle, tokenizer, p, 8), p[-40:]
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        last = r.usage.prompt_tokens
    # whole blocks, then the rows of the next block that match (a take-over): all but the last row
    assert cached[0] == 0 and cached[1] == n and cached[2] == last - 1
    after = client.status()["kv"]
    assert after["hits"] - before["hits"] == cached[1] + cached[2]
    assert after["queries"] - before["queries"] == n + 2 * last


def test_the_cache_keeps_its_bound_and_pages_given_back_are_written_anew(served, client, oracle,
                                                                         tokenizer):
    """--prefix-cache-mb 32 (45 blocks of 16 rows at f32, of 91): distinct prompts push the
    cache past its bound (the least recently released go) and the free blocks' pages go back to
    the OS between steps (memory/blocks.py trim); prompts that run on those blocks, zeros again,
    and one whose prefix is still cached, each give the oracle's text."""
    texts = [" ".join(f"Item {i}-{j}: {j * 13 % 7} blue pens in drawer {j % 5}." for j in range(12))
             for i in range(8)]
    before = client.status()["kv"]
    for p in texts:
        assert client.generate(p, max_tokens=4, temperature=0) == _want(oracle, tokenizer, p, 4)
    mid = client.status()["kv"]
    assert mid["cached_blocks_max"] == 45 and mid["cached_blocks"] <= 45
    assert mid["evicted_blocks"] > before["evicted_blocks"]
    deadline = time.time() + 10                   # the idle loop trims every half second
    while client.status()["kv"]["trimmed_blocks"] == before["trimmed_blocks"] and time.time() < deadline:
        time.sleep(0.2)
    assert client.status()["kv"]["trimmed_blocks"] > before["trimmed_blocks"]
    for p in (texts[0], texts[-1] + " And then?"):        # cold again; its prefix cached
        assert client.generate(p, max_tokens=12, temperature=0) == _want(oracle, tokenizer, p, 12)


def test_openai_package_seed_temperature_and_top_p(served, client, oracle, tokenizer):
    """The same over HTTP: a seed repeats its text and equals the Python client's with the same
    seed, temperature and top_p (all three reach the sampler); other seeds differ; temperature 0
    and a one-token nucleus give the oracle's greedy text."""
    import openai
    oa = openai.OpenAI(base_url=served[1] + "/v1", api_key="none")
    model = oa.models.list().data[0].id
    http = lambda **kw: oa.completions.create(model=model, prompt=STORY, **kw).choices[0].text
    sampled = dict(SAMPLED, extra_body={"ignore_eos": True})
    a = http(seed=1, **sampled)
    assert http(seed=1, **sampled) == a
    assert a == client.generate(STORY, seed=1, ignore_eos=True, **SAMPLED)
    assert http(seed=2, **sampled) != a
    greedy = _want(oracle, tokenizer, STORY, 24)
    assert http(max_tokens=24, temperature=0, top_p=0.5, seed=9) == greedy
    assert http(max_tokens=24, temperature=1.5, top_p=1e-6, seed=9) == greedy


@pytest.mark.parametrize("body, status", [
    ("{not json", 400), ('{"prompt": 7}', 400), ('{"prompt": "hi", "max_tokens": "ten"}', 400),
    ('{"prompt": "hi", "temperature": 9}', 400), ('{"prompt": "hi", "priority": "now"}', 400),
    ('{"prompt": "hi", "max_tokens": 100000}', 400), ('[1, 2]', 400),
    ('{"prompt": "hi", "stream": "yes"}', 400), ('{"prompt": "hi", "n": 99}', 400),
    ('{"prompt": "hi", "logprobs": 9}', 400), ('{"prompt": "hi", "frequency_penalty": 3}', 400),
    ('{"prompt": "hi", "logit_bias": {"x": 1}}', 400),
    ('{"prompt": "hi", "stream_options": {"include_usage": true}}', 400),
    ('{"prompt": "hi", "stream": true, "stream_options": {"include_usage": 1}}', 400),
    ('{"prompt": "hi", "stream": true, "stream_options": {"include_obfuscation": true}}', 400),
])
def test_bad_http_bodies_get_4xx_with_an_error_object(served, body, status):
    import requests
    r = requests.post(served[1] + "/v1/completions", data=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("best_of", 2), ("typical_p", 0.9), ("suffix", "x"), ("mirostat", 2), ("functions", [{"name": "f"}]),
    ("modalities", ["audio"]), ("store", True)])
def test_a_parameter_the_service_does_not_honour_is_a_400_that_names_it(served, client, field, value):
    """Never a silent 200: a field asked for and not done is refused, by HTTP and by the Python
    client; the same field at the value that asks for nothing (OpenAI's defaults) is taken."""
    import requests
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})):
        r = requests.post(served[1] + path, json={**body, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert field in r.json()["error"]["message"]
    ok = requests.post(served[1] + "/v1/completions", timeout=120, json={
        "prompt": "hi", "max_tokens": 2, "logprobs": None, "frequency_penalty": 0, "tools": [],
        "response_format": {"type": "text"}, "stream_options": None, "user": "me", "best_of": 1,
        "suffix": "", "store": False, "metadata": {"run": "a"}})
    assert ok.status_code == 200, ok.text
    bad = requests.post(served[1] + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 2, "metadata": {"run": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metadata", bad.text
    with pytest.raises(ValueError, match=field):
        client.generate(FRANCE, max_tokens=2, **{field: value})


def test_the_other_routes_input_is_refused_not_ignored(served):
    """A chat request's `prompt` and a completion's `messages` were silently dropped: each is a
    400 naming it, whose message lists what that route honours."""
    import requests
    hi = [{"role": "user", "content": "hi"}]
    for path, body, field in (("/v1/chat/completions", {"messages": hi, "prompt": "zzz"}, "prompt"),
                              ("/v1/completions", {"prompt": "hi", "messages": hi}, "messages")):
        r = requests.post(served[1] + path, json={**body, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        honoured = set(r.json()["error"]["message"].split("honour ")[1].rstrip(")").split(", "))
        assert field not in honoured and "max_tokens" in honoured


def _penalised_greedy(oracle, tokenizer, prompt: str, n: int, penalty: float) -> str:
    """The oracle's greedy text under vLLM's repetition penalty over the prompt and the text."""
    ids = tokenizer.encode(prompt)
    kv = oracle.new_cache(len(ids) + n)
    logits, pos, out, seen = oracle.forward(ids, 0, kv), len(ids), [], set(ids)
    for _ in range(n):
        z = np.array(logits, np.float32)
        idx = np.array(sorted(seen))
        z[idx] = np.where(z[idx] > 0, z[idx] / penalty, z[idx] * penalty)
        out.append(int(np.argmax(z)))
        seen.add(out[-1])
        logits, pos = oracle.forward(out[-1:], pos, kv), pos + 1
    stops = set(tokenizer.stop_ids())
    return tokenizer.decode(out[:next((i for i, t in enumerate(out) if t in stops), n)])


def test_top_k_min_p_and_the_repetition_penalty_reach_the_sampler(served, client, oracle, tokenizer):
    """vLLM's and llama.cpp's sampling extensions, over HTTP and from Python: greedy under a
    repetition penalty is the oracle's greedy under vLLM's formula (and not the plain greedy
    text, so the penalty acted); llama.cpp's name for it gives the same; top_k 1 and min_p 1 at
    temperature 1.5 leave only the likeliest token, so the text is the oracle's greedy one."""
    import requests
    url = served[1] + "/v1/completions"

    def http(**kw):
        r = requests.post(url, json={"prompt": COUNT, "max_tokens": 16, **kw}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    plain = _want(oracle, tokenizer, COUNT, 16)
    penalised = _penalised_greedy(oracle, tokenizer, COUNT, 16, 1.3)
    assert penalised != plain
    assert http(temperature=0, repetition_penalty=1.3) == penalised
    assert http(temperature=0, repeat_penalty=1.3) == penalised
    assert client.generate(COUNT, max_tokens=16, repetition_penalty=1.3) == penalised
    for kw in ({"top_k": 1}, {"min_p": 1.0}):
        assert http(temperature=1.5, seed=3, **kw) == plain, kw
    assert http(temperature=1.5, seed=3) != plain          # without them, this seed samples
    r = requests.post(url, json={"prompt": "hi", "repeat_penalty": 1.1, "repetition_penalty": 1.2},
                      timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repeat_penalty"
    for field, value in (("top_k", -3), ("min_p", 2), ("repetition_penalty", 0)):
        r = requests.post(url, json={"prompt": "hi", field: value}, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_tokenize_and_detokenize_count_what_a_request_starts_from(served, client, tokenizer, gguf_reader):
    """llama.cpp's and vLLM's /tokenize and /detokenize: a prompt's ids are the ones its request
    starts from (the usage's prompt_tokens count them), a chat's go through the model's template,
    detokenize gives the text back; bad input is a 400 naming what is wrong, as in Python."""
    import requests

    from socllm.models.chat import render_chat
    base = served[1]
    post = lambda path, body: requests.post(base + path, json=body, timeout=60)
    r = post("/tokenize", {"content": STORY})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == tokenizer.encode(STORY, bos=tokenizer.add_bos) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == client.status()["context"]
    assert post("/tokenize", {"prompt": STORY}).json()["tokens"] == got["tokens"]      # vLLM's name
    usage = post("/v1/completions", {"prompt": STORY, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == got["count"]
    bare = post("/tokenize", {"content": STORY, "add_special": False}).json()["tokens"]
    assert bare == tokenizer.encode(STORY, bos=False)
    msgs = [{"role": "user", "content": "Name three colours."}]
    chat = post("/tokenize", {"messages": msgs}).json()["tokens"]
    assert chat == tokenizer.encode(render_chat(gguf_reader, msgs), bos=tokenizer.add_bos)
    assert client.tokenize(messages=msgs) == chat and client.tokenize(STORY) == got["tokens"]
    back = post("/detokenize", {"tokens": bare}).json()
    assert back["content"] == back["prompt"] == STORY == client.detokenize(bare)
    for path, body, param in (("/tokenize", {"content": STORY, "messages": msgs}, None),
                              ("/tokenize", {"content": 7}, None),
                              ("/tokenize", {"content": STORY, "with_pieces": True}, "with_pieces"),
                              ("/tokenize", {"text": STORY}, "text"),
                              ("/detokenize", {"tokens": [1, -2]}, None),
                              ("/detokenize", {"tokens": "abc"}, None)):
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, body, r.text)
        assert "JSON" not in r.json()["error"]["message"], r.text      # the fault, not another
        assert param is None or r.json()["error"]["param"] == param
    with pytest.raises(ValueError, match="token ids"):
        client.detokenize([10 ** 9])
    r = requests.post(base + "/tokenize", data="{not json", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_min_tokens_and_stop_token_ids(served, client, oracle, tokenizer, gguf_reader):
    """vLLM's extensions: stop_token_ids end the text at the first of them, as EOS does (its text
    left out, finish_reason stop); min_tokens holds EOS back, so a reply that ends early goes on
    past it (its greedy text until there unchanged); max_tokens below min_tokens is a 400."""
    import requests
    ids = tokenizer.encode(FRANCE, bos=tokenizer.add_bos)
    toks = oracle.greedy(ids, 8)
    k = next(i for i in range(2, 8) if toks[i] not in toks[:i])
    r = requests.post(served[1] + "/v1/completions", timeout=120, json={
        "prompt": FRANCE, "max_tokens": 8, "stop_token_ids": [toks[k]]}).json()
    assert r["choices"][0]["text"] == tokenizer.decode(toks[:k]) and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == k + 1
    hi = [{"role": "user", "content": "Hi"}]
    short = client.chat(hi, max_tokens=48)
    n = len(tokenizer.encode(short))
    assert n < 40, short                            # the reply ends with EOS before max_tokens
    r = requests.post(served[1] + "/v1/chat/completions", timeout=120, json={
        "messages": hi, "max_tokens": 48, "min_tokens": n + 6}).json()
    assert r["usage"]["completion_tokens"] >= n + 6, r
    assert r["choices"][0]["message"]["content"].startswith(short.rstrip()), r
    bad = requests.post(served[1] + "/v1/completions", timeout=60,
                        json={"prompt": FRANCE, "max_tokens": 4, "min_tokens": 9})
    assert bad.status_code == 400 and "min_tokens" in bad.json()["error"]["message"]


def test_a_tokenized_prompt_is_the_prompt_whose_ids_it_is(served, oracle, tokenizer):
    """OpenAI's `prompt` as token ids (one list, or a batch of one) runs those ids as they are:
    the greedy text of FRANCE's ids is the oracle's; echo gives their text; ids outside the
    vocabulary, an empty list and a list mixing text and ids are 400s that name `prompt`."""
    import requests
    url = served[1] + "/v1/completions"
    ids = tokenizer.encode(FRANCE, bos=tokenizer.add_bos)
    want = _want(oracle, tokenizer, FRANCE, 8)
    for prompt in (ids, [ids]):
        r = requests.post(url, json={"prompt": prompt, "max_tokens": 8}, timeout=120).json()
        assert r["choices"][0]["text"] == want and r["usage"]["prompt_tokens"] == len(ids), r
    r = requests.post(url, json={"prompt": ids, "max_tokens": 8, "echo": True}, timeout=120).json()
    assert r["choices"][0]["text"] == tokenizer.decode(ids) + want
    for bad in ([1, -4], [10 ** 9], ["a", 5], [[]], [], [True], [ids, [10 ** 9]], ["a", ""]):
        r = requests.post(url, json={"prompt": bad, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "prompt" or "token ids" in r.json()["error"]["message"], r.text


def test_a_batch_of_prompts_gets_a_choice_per_prompt_in_order(served, client, oracle, tokenizer):
    """OpenAI's and vLLM's batch: `prompt` as a list of prompts (texts or token ids) runs each,
    choice p n + j the j-th of prompt p, each prompt's greedy text the oracle's, streamed or not;
    usage counts every prompt once and every choice's tokens; echo gives each prompt's own text;
    more prompts than the service takes in one request is a 400; a batch refused at its second
    prompt leaves nothing running."""
    import requests
    url = served[1] + "/v1/completions"
    ids = tokenizer.encode(COUNT, bos=tokenizer.add_bos)
    want = [_want(oracle, tokenizer, FRANCE, 8), _want(oracle, tokenizer, COUNT, 8),
            _want(oracle, tokenizer, STORY, 8)]
    assert len(set(want)) == 3
    body = {"prompt": [FRANCE, ids, STORY], "max_tokens": 8, "n": 2, "echo": True}
    r = requests.post(url, json=body, timeout=180).json()
    assert [c["index"] for c in r["choices"]] == list(range(6)), r
    texts = [FRANCE, tokenizer.decode(ids), STORY]
    assert [c["text"] for c in r["choices"]] == [texts[i // 2] + want[i // 2] for i in range(6)]
    prompt_tokens = len(tokenizer.encode(FRANCE)) + len(ids) + len(tokenizer.encode(STORY))
    assert r["usage"]["prompt_tokens"] == prompt_tokens, r["usage"]
    stops = set(tokenizer.stop_ids())
    made = [next((i + 1 for i, t in enumerate(oracle.greedy(p, 8)) if t in stops), 8)
            for p in (tokenizer.encode(FRANCE), ids, tokenizer.encode(STORY))]
    assert r["usage"]["completion_tokens"] == 2 * sum(made), (r["usage"], made)
    got, usage = {}, None
    with requests.post(url, stream=True, timeout=180, json={
            "prompt": [STORY, FRANCE], "max_tokens": 8, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    got[c["index"]] = got.get(c["index"], "") + c["text"]
                usage = chunk.get("usage") or usage
    assert got == {0: want[2], 1: want[2], 2: want[0], 3: want[0]}, got
    assert usage["prompt_tokens"] == len(tokenizer.encode(STORY)) + len(tokenizer.encode(FRANCE))
    assert usage["completion_tokens"] == 2 * (made[0] + made[2]), (usage, made)
    r = requests.post(url, json={"prompt": ["hi"] * 65, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "65 prompts" in r.json()["error"]["message"], r.text
    r = requests.post(url, json={"prompt": ["hi"] * 20, "n": 7, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    import ray
    before = ray.get(client.service.status.remote())["requests"]
    r = requests.post(url, json={"prompt": [COUNT, [10 ** 9]], "max_tokens": 300}, timeout=60)
    assert r.status_code == 400, r.text
    time.sleep(1)
    after = ray.get(client.service.status.remote())["requests"]
    live = ("waiting", "prefilling", "decoding")
    assert [after[k] for k in live] == [before[k] for k in live], (before, after)


def test_echo_with_logprobs_gives_every_prompt_token_its_logprob(served, oracle, tokenizer):
    """OpenAI's completions with echo and logprobs (what evaluation harnesses send to score a
    text): the prompt's tokens come first, the first with no logprob, each other's the oracle's
    teacher-forced log-softmax at the row before it (f32) and its top alternative the oracle's
    likeliest there; then the reply's tokens, whose text is the plain greedy reply. The prompt
    runs in several chunks (longer than the service's decode rows) across a block boundary, and
    the same again once its blocks are in the prefix cache. Streamed, it is a 400."""
    import requests
    url = served[1] + "/v1/completions"
    text = STORY + (" there was a little girl who lived in a village near the forest. Whenever "
                    "she went out, she wore a red riding cloak, so everyone called her Red.")
    ids = tokenizer.encode(text, bos=tokenizer.add_bos)
    assert len(ids) > 32
    z = oracle.logits_for(ids).astype(np.float64)
    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    want = [z[j - 1, ids[j]] - lse[j - 1] for j in range(1, len(ids))]
    reply = _want(oracle, tokenizer, text, 3)
    for k in (1, 2):                                 # the second: n 2, the prompt's blocks cached
        r = requests.post(url, json={"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 2,
                                     "n": k}, timeout=180)
        assert r.status_code == 200, r.text
        c, *more = r.json()["choices"]
        lp, n = c["logprobs"], len(ids)
        assert [m["logprobs"]["token_logprobs"][:n] for m in more] == [lp["token_logprobs"][:n]] * (k - 1)
        assert c["text"] == text + reply
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
        np.testing.assert_allclose(lp["token_logprobs"][1:n], want, atol=5e-3)
        for j in range(n - 1):
            top2 = np.sort(z[j])[-2:]
            if top2[1] - top2[0] > 0.05:              # no near-tie at the top
                assert next(iter(lp["top_logprobs"][j + 1])) == tokenizer.decode([int(np.argmax(z[j]))])
        assert len(lp["tokens"]) > n and all(v is not None for v in lp["token_logprobs"][n:])
        assert lp["text_offset"][n] == len(text)
    r = requests.post(url, json={"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 1,
                                 "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text


def test_streamed_logprobs_keep_counting_their_text_offsets(served):
    """A streamed completion's logprobs: each chunk's text_offset goes on from the text the
    chunks before it sent, so the stream's offsets are the whole reply's."""
    import requests
    body = {"prompt": STORY, "max_tokens": 12, "logprobs": 1, "ignore_eos": True}
    whole = requests.post(served[1] + "/v1/completions", json=body, timeout=120).json()
    offsets, tokens = [], []
    with requests.post(served[1] + "/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp:
                    offsets += lp["text_offset"]
                    tokens += lp["tokens"]
    want = whole["choices"][0]["logprobs"]
    assert tokens == want["tokens"] and offsets == want["text_offset"] and offsets[-1] > 0


def test_vllms_prompt_logprobs_field_gives_each_prompt_tokens_id_logprob_and_rank(served, oracle, tokenizer):
    """vLLM's prompt_logprobs over HTTP: per prompt token None (the first), else {id: {logprob,
    rank, decoded_token}} of the token itself (the oracle's teacher-forced logprob at f32) and
    of the k likeliest (ranks 1 .. k, the oracle's likeliest first); in a completion's choice,
    in chat the response's. Beside echo with logprobs 1, each keeps its own k. Streamed, or a
    value out of [0, 20], it is a 400 that names it."""
    import requests
    text = STORY + " there was a little girl who lived in a village near the forest."
    ids = tokenizer.encode(text, bos=tokenizer.add_bos)
    z = oracle.logits_for(ids).astype(np.float64)
    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    body = {"prompt": text, "max_tokens": 2, "prompt_logprobs": 3, "echo": True, "logprobs": 1}
    r = requests.post(served[1] + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    got = c["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        d = got[j]
        assert 3 <= len(d) <= 4 and str(ids[j]) in d, d
        mine = d[str(ids[j])]
        assert mine["logprob"] == pytest.approx(z[j - 1, ids[j]] - lse[j - 1], abs=5e-3)
        assert mine["decoded_token"] == tokenizer.decode([ids[j]])
        near = np.abs(z[j - 1] - z[j - 1, ids[j]]) < 0.02        # ranks within a near-tie may swap
        assert abs(mine["rank"] - (1 + int((z[j - 1] > z[j - 1, ids[j]]).sum()))) <= near.sum() - 1
        top = sorted((v["rank"], int(t)) for t, v in d.items() if v["rank"] <= 3)[:3]
        assert [rk for rk, _ in top] == [1, 2, 3]
        top2 = np.sort(z[j - 1])[-2:]
        if top2[1] - top2[0] > 0.05:
            assert top[0][1] == int(np.argmax(z[j - 1]))
    lp = c["logprobs"]                                 # echo's own k: 1
    assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:len(ids)])
    r = requests.post(served[1] + "/v1/chat/completions", timeout=180, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"]
    assert out["prompt_logprobs"][0] is None
    assert all(len(d) == 1 and next(iter(d.values()))["rank"] >= 1 for d in out["prompt_logprobs"][1:])
    for bad in ({"stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": True}):
        r = requests.post(served[1] + "/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", (bad, r.text)


def test_bad_requests_do_not_disturb_a_concurrent_stream(served, client):
    import requests
    want = client.generate("Once upon a time", max_tokens=48)
    got = []

    def stream():
        with requests.post(served[1] + "/v1/completions", stream=True, timeout=120,
                           json={"prompt": "Once upon a time", "max_tokens": 48, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    got.append(json.loads(line[6:])["choices"][0]["text"])
    t = threading.Thread(target=stream)
    t.start()
    for body in ("{oops", '{"prompt": ""}', '{"messages": 3}'):
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert requests.post(served[1] + path, data=body, timeout=60).status_code == 400
    t.join(120)
    assert "".join(got) == want
    assert requests.get(served[1] + "/health", timeout=10).json()["status"] == "ok"


def test_a_client_that_disconnects_does_not_end_the_next_clients_stream(served, client):
    """The HTTP replica polls all its streams in one call, from a task the stream that found none
    running started. Streams that start as the one before them disconnects: that one's request
    is cancelled, and Ray cancelled with it the poll call the next stream was waiting on, which
    then ended at once as "generation failed: Task ... was cancelled" (3 of 45 streams by hand).
    Every stream here starts with its text, and one started beside them comes whole."""
    import requests
    url = served[1] + "/v1/completions"
    want = client.generate(STORY, max_tokens=32)
    got = []

    def beside():
        with requests.post(url, stream=True, timeout=120,
                           json={"prompt": STORY, "max_tokens": 32, "stream": True}) as r:
            got.extend(json.loads(line[6:]) for line in r.iter_lines()
                       if line.startswith(b"data: ") and line != b"data: [DONE]")
    import ray
    t = threading.Thread(target=beside)
    t.start()
    rids = []
    for _ in range(12):
        with requests.post(url, stream=True, timeout=60,
                           json={"prompt": COUNT, "max_tokens": 60, "stream": True}) as r:
            it = r.iter_lines()
            lines = [line for line in (next(it) for _ in range(3)) if line]
        first = json.loads(lines[0][6:])
        assert "id" in first, lines
        rids.append(first["id"].split("-", 1)[1])
    t.join(120)
    assert not [c for c in got if "error" in c], got
    assert "".join(c["choices"][0]["text"] for c in got) == want
    # every one ended (cancelled; one whose disconnect Serve's proxy missed, abandoned or
    # finished) before the next test counts abandoned requests
    state = lambda r: ray.get(client.service.request.remote(r))["state"]
    _until(lambda: all(state(r) in ("finished", "cancelled", "failed") for r in rids), 120)


def test_an_http_client_that_disconnects_cancels_its_request(served, client):
    """Streaming clients that close their connection after the first token: their requests are
    cancelled, not run to their 400 tokens (f32: ~25 s each). Serve's proxy now and then does not
    pass a disconnect on to the replica (measured: 1 of 20, 1 of 50, 0 of 30 in three runs of
    streams closed after their first token; see actors/front/http.py), and such a request runs on while
    the replica still polls; so two of the three must be cancelled, and all three must end."""
    import ray
    import requests
    rids = []
    for _ in range(3):
        with requests.post(served[1] + "/v1/completions", stream=True, timeout=60,
                           json={"prompt": COUNT, "max_tokens": 400, "stream": True}) as r:
            it = r.iter_lines()
            lines = [line for line in (next(it) for _ in range(3)) if line]
        rids.append(json.loads(lines[0][6:])["id"].split("-", 1)[1])
    state = lambda rid: ray.get(client.service.request.remote(rid))
    _until(lambda: all(state(rid)["state"] in ("finished", "cancelled", "failed") for rid in rids), 60)
    outs = [state(rid) for rid in rids]
    cancelled = [o for o in outs if o["state"] == "cancelled" and len(o["tokens"]) < 400]
    assert len(cancelled) >= 2, outs
    assert all(o["state"] in ("cancelled", "finished") for o in outs), outs
    metrics = requests.get(served[1] + "/metrics", timeout=10).text
    assert 'socllm_requests_ended_total{state="cancelled"}' in metrics
    assert "socllm_time_to_first_token_seconds_bucket" in metrics
    assert 'socllm_pending_seconds_count{priority="proactive"}' in metrics


def test_a_request_nobody_polls_is_cancelled_as_abandoned(client):
    """A client that submits and then never asks for its text (its process died): the request is
    cancelled once --abandon-s (3 s) pass with no poll, and its blocks are free; a poll after
    that says so. The GPU actor (every decode step) is held stopped from before the submission
    until the window has passed, so the request cannot finish inside it however fast the
    machine: a service that did not abandon it would run it to its 400 tokens."""
    import ray
    gpu = _pid(client, "gpu")
    before = ray.get(client.service.status.remote())["abandoned_total"]
    with _paused(gpu):
        rid = ray.get(client.service.submit.remote(prompt=COUNT, max_tokens=400, ignore_eos=True))
        end = time.monotonic() + ABANDON_S + 0.5       # the window, from after its submission
        while time.monotonic() < end:
            time.sleep(0.1)
        assert ray.get(client.service.request.remote(rid))["state"] not in ("finished", "cancelled")
    _until(lambda: ray.get(client.service.request.remote(rid))["state"] in ("cancelled", "finished"), 120)
    out = ray.get(client.service.request.remote(rid))
    assert out["state"] == "cancelled" and out["finish_reason"] == "abandoned", out
    assert len(out["tokens"]) < 400
    with pytest.raises(RuntimeError, match="abandoned"):
        "".join(client.pieces(rid))
    st = ray.get(client.service.status.remote())
    assert st["abandoned_total"] == before + 1 and st["kv"]["blocks_used"] == 0


def test_a_killed_gpu_actor_comes_back_and_its_generations_equal_the_oracle(client, oracle, tokenizer):
    """DESIGN.md §5: Ray restarts a processor actor whose process dies, the service installs its
    programs in it again and redoes the step it lost; the KV in the pool outlives the process.
    Nothing is lost and greedy text does not change."""
    st = client.status()
    gpu = next(p["pid"] for p in st["processors"] if p["processor"] == "gpu")
    before, failed = st["recoveries_total"], st["requests"]["failed"]
    prompts = [COUNT, "Once upon a time, there was a little robot who"]
    texts, started = {}, threading.Semaphore(0)

    def one(p):
        texts[p] = ""
        for k, piece in enumerate(client.generate(p, max_tokens=96, ignore_eos=True, stream=True)):
            texts[p] += piece
            if k == 2:
                started.release()
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for _ in prompts:
        assert started.acquire(timeout=120)
    os.kill(gpu, signal.SIGKILL)               # both generations are mid-way
    for t in threads:
        t.join(120)
    for p in prompts:
        assert texts[p] == _want(oracle, tokenizer, p, 96), p
    st = client.status()
    assert st["recoveries_total"] == before + 1 and st["recoveries"][-1]["processors"] == ["gpu"]
    assert next(p["pid"] for p in st["processors"] if p["processor"] == "gpu") not in (gpu, None)
    assert st["requests"]["failed"] == failed
    assert client.generate(FRANCE, max_tokens=4) == _want(oracle, tokenizer, FRANCE, 4)


def test_stop_removes_the_service_and_its_pool(served, client):
    """`socllm stop` removes socllm and nothing else: another application on the same Serve
    (deployed here) keeps running and answering; `socllm serve` beside it refuses a port other
    than Serve's; with socllm's the only one, Serve goes too."""
    import requests
    from ray import serve
    from socllm.actors.front.direct import record_path
    env, pid = served[0], client.status()["pid"]
    assert any(s.startswith(f"socllm-{pid}-") for s in _segments())
    assert os.path.exists(record_path(env["RAY_ADDRESS"]))

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Other:
        def __call__(self, request):
            return "other"
    serve.run(Other.bind(), name="other", route_prefix="/other")
    r = _cli(env, "stop", timeout=300)
    assert r.returncode == 0 and "stopped" in r.stdout
    assert set(serve.status().applications) == {"other"}
    assert requests.get(served[1] + "/other", timeout=30).text == "other"
    # Serve has one HTTP address: a `socllm serve` that asks for another says where it is and
    # starts nothing (Serve would have put socllm's front end on its own port all the same)
    port = int(served[1].rsplit(":", 1)[1])
    r = _cli(env, "serve", "--http-port", str(port + 1))
    assert r.returncode == 2 and f"--http-port {port}" in r.stderr and "other" in r.stderr, r.stderr
    assert _cli(env, "status").returncode == 1, "it started a service"
    assert set(serve.status().applications) == {"other"}
    serve.shutdown()
    assert not os.path.exists(record_path(env["RAY_ADDRESS"])), "`generate` would look for it"
    assert not any(s.startswith(f"socllm-{pid}-") for s in _segments()), "the pool outlived stop"
    assert not os.path.exists(f"/proc/{pid}"), "the service's process outlived stop"
    r = _cli(env, "status")
    assert r.returncode == 1 and "no service" in r.stderr
    r = _cli(env, "stop")
    assert r.returncode == 0 and "no service" in r.stdout


def _until(cond, timeout=20.0):
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.1)


def test_a_service_that_fails_to_start_leaves_no_http_front_end(served, tmp_path):
    """`socllm serve` starts its HTTP front end while the service loads the model: a model the
    service then refuses (a GGUF magic over foreign bytes) gives one error line and a non-zero
    exit, and takes the front end down with it: no Serve application, no service actor, the port
    free, no pool segment (after the stop test: nothing else runs)."""
    import ray
    from ray import serve
    from socllm.actors.front.serve import _port_free
    from socllm.actors.service import NAME, NAMESPACE
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    env, port = served[0], free_port()
    before = _segments()
    r = _cli(env, "serve", "--model", str(bad), "--http-port", str(port), "--no-warmup",
             timeout=300)
    assert r.returncode != 0 and "not a GGUF file" in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("socllm: error")] == \
        [r.stderr.splitlines()[-1]], r.stderr
    assert _port_free("127.0.0.1", port)
    try:
        apps = serve.status().applications
    except Exception:
        apps = {}
    assert "socllm" not in apps, apps
    with pytest.raises(ValueError):
        ray.get_actor(NAME, namespace=NAMESPACE)
    assert _segments() <= before


def test_a_replys_usage_sums_details_that_only_some_choices_have():
    """n choices: a choice that drafted nothing has no completion_tokens_details; the reply's
    usage still sums the others' (it had taken the first choice's keys only)."""
    from socllm.actors.front.http import _usage
    plain = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 2}}
    drafted = {**plain, "completion_tokens": 5, "total_tokens": 8,
               "completion_tokens_details": {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 1}}
    u = _usage([plain, drafted], 2)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (3, 6, 9)
    assert u["prompt_tokens_details"] == {"cached_tokens": 2}
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 1}
    assert "completion_tokens_details" not in _usage([plain, plain], 2)


def test_status_counts_every_ended_request_not_only_those_the_table_keeps():
    """status()["requests"]'s ended states are totals since start (metrics.ended_total), as
    /metrics' socllm_requests_ended_total; the table keeps only the last KEEP_ENDED."""
    from types import SimpleNamespace

    from socllm.actors.engine import KEEP_ENDED
    from socllm.actors.metrics import ServiceMetrics
    m = ServiceMetrics()
    for i in range(KEEP_ENDED + 10):
        m.ended(SimpleNamespace(id=str(i), state="failed" if i % 50 == 0 else "finished"))
    assert m.ended_total == {"finished": KEEP_ENDED + 4, "cancelled": 0, "failed": 6}
    assert f'socllm_requests_ended_total{{state="finished"}} {KEEP_ENDED + 4}.0' in m.text([], SimpleNamespace(
        n_used=0, n_blocks=1, n_cached=0, queries=0, hits=0))
