"""`socllm bench` reports what it promises (a tiny run; the real bench is not a test)."""
from __future__ import annotations

from socllm.scripts.bench import run_bench, table


def test_bench_report_has_its_fields(engine, oracle):
    rep = run_bench(engine, [8], 4, 1, ["gpu"], ["llama.cpp"], oracle, log=lambda s: None)
    assert set(rep) >= {"device", "threads", "kv_dtype", "decode_tokens", "reps", "prompts",
                        "results", "missing_peers", "memory_pss_mb"}
    r = rep["results"]["socllm:gpu/q16"]["8"]
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert set(r[key]) == {"min", "median", "max"} and r[key]["median"] > 0
    assert r["oracle_match"] is True                  # the default q16 keeps the oracle's first tokens
    # a peer is either measured or reported missing, never silently skipped
    assert "llama.cpp" in rep["results"] or "llama.cpp" in rep["missing_peers"]
    assert "socllm:gpu/q16" in table(rep)


def test_bench_prompts_share_no_prefix(tokenizer):
    """Each (length, repetition) has its own prompt, so an engine that caches prompt prefixes
    (OpenVINO GenAI does) gains nothing from the one before."""
    from socllm.scripts.bench import prompt_ids
    a, b, c = (prompt_ids(tokenizer, n, v) for n, v in ((32, 1), (32, 2), (512, 3)))
    assert len(a) == 32 and len(c) == 512
    assert a[:4] != b[:4] and a[:4] != c[:4] and b[:4] != c[:4]


def test_bench_keeps_the_kv_cache_the_service_keeps():
    """The service keeps f16 keys and values at q16 and q8 (actors/service.py KV_DTYPE), and so
    does the bench's engine (its attention reads half the bytes of f32's), f32 only where a plan
    runs at f32."""
    from socllm.scripts.bench import kv_dtype_for
    assert kv_dtype_for(["gpu", "hetero/q16"]) == kv_dtype_for(["gpu/q8"]) == "f16"
    assert kv_dtype_for(["gpu", "gpu/f32"]) == "f32"
    # with an engine of each kind, each plan runs on the one its precision keeps
    from types import SimpleNamespace
    from socllm.scripts.bench import socllm_runners
    f16, f32 = SimpleNamespace(kv_dtype="f16"), SimpleNamespace(kv_dtype="f32")
    runners = socllm_runners(f16, ["gpu", "gpu/f32", "hetero/q8"], {"f16": f16, "f32": f32})
    assert [r.engine for r in runners] == [f16, f32, f16]
    assert [r.engine for r in socllm_runners(f32, ["gpu"], {"f32": f32})] == [f32]
