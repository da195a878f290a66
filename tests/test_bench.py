"""`socllm bench` reports what it promises (a tiny run; the real bench is not a test)."""
from __future__ import annotations

from socllm.scripts.bench import run_bench, table


def test_bench_report_has_its_fields(engine, oracle):
    rep = run_bench(engine, [8], 4, 1, ["gpu"], ["llama.cpp"], oracle, log=lambda s: None)
    assert set(rep) >= {"device", "threads", "decode_tokens", "reps", "prompts", "results",
                        "missing_peers", "memory_pss_mb"}
    r = rep["results"]["socllm:gpu/q16"]["8"]
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert set(r[key]) == {"min", "median", "max"} and r[key]["median"] > 0
    assert r["oracle_match"] is True                  # the default q16 keeps the oracle's first tokens
    # a peer is either measured or reported missing, never silently skipped
    assert "llama.cpp" in rep["results"] or "llama.cpp" in rep["missing_peers"]
    assert "socllm:gpu/q16" in table(rep)
