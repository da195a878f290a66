"""scripts/spec_bench.py's pure helpers and its prompt file (no engine runs)."""
from __future__ import annotations

import pytest

from socllm.scripts.spec_bench import (PROMPTS, llama_variants, load_prompts, per_kind, per_prompt,
                                       rotated, socllm_modes, spread, targets)


def test_the_prompt_file_holds_grounded_prompts_of_300_to_800_input_tokens_and_open_ones(tokenizer):
    prompts = load_prompts(PROMPTS)
    grounded = [p for p in prompts if p["kind"] == "grounded"]
    open_ = [p for p in prompts if p["kind"] == "open"]
    assert len(grounded) >= 10 and len(open_) >= 5
    assert {p["task"] for p in grounded} == {"summarise", "extract", "rewrite", "quote"}
    for p in grounded:
        n = p["input_tokens"]
        assert 300 <= n <= 800, p["id"]
        # the user message is the instruction, then the input text the count is of
        assert abs(len(tokenizer.encode(p["messages"][0]["content"])) - n) < 80, p["id"]
    assert load_prompts(PROMPTS, ("open",), limit=2) == open_[:2]
    assert [p["kind"] for p in load_prompts(PROMPTS, limit=1)] == ["grounded", "open"]


def test_variants_modes_and_order():
    assert llama_variants("plain,lookup10,lookup2") == [("llama.cpp", None), ("llama.cpp-lookup10", 10),
                                                         ("llama.cpp-lookup2", 2)]
    assert llama_variants("") == []
    for bad in ("lookup", "lookup0", "spec"):
        with pytest.raises(ValueError):
            llama_variants(bad)
    assert socllm_modes("off,auto") == ["off", "auto"]
    with pytest.raises(ValueError):
        socllm_modes("off,medusa")
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"] and rotated([], 3) == []
    assert spread([3, None, 1, 2]) == {"min": 1, "median": 2, "max": 3, "n": 3} and spread([None]) is None


def _run(prompt, variant, rep, tok_s, e2e, ids=None, **more):
    return {"prompt": prompt, "variant": variant, "rep": rep, "decode_tok_s": tok_s, "e2e_s": e2e,
            "ttft_s": 0.1, "sampled_tokens": 16, "ids": ids, **more}


def test_ratios_take_per_prompt_medians_and_the_faster_llama_variant():
    prompts = [{"id": "g", "kind": "grounded"}, {"id": "o", "kind": "open"}]
    variants = ["socllm-off", "socllm-auto", "llama.cpp", "llama.cpp-lookup10"]
    rows = []
    for rep, (off, auto) in enumerate([(100, 250), (110, 200), (90, 240)]):
        rows += [_run("g", "socllm-off", rep, off, 2.0, [1, 2]),
                 _run("g", "socllm-auto", rep, auto, 1.0, [1, 2], drafted=10, accepted=6, verify_steps=2),
                 _run("g", "llama.cpp", rep, 120, 2.0), _run("g", "llama.cpp-lookup10", rep, 150, 1.5),
                 _run("o", "socllm-off", rep, 100, 2.0, [3]),
                 _run("o", "socllm-auto", rep, 97 + rep, 2.0, [3] if rep else [4]),
                 _run("o", "llama.cpp", rep, 130, 2.0), _run("o", "llama.cpp-lookup10", rep, 110, 2.0)]
    ps = per_prompt(rows, prompts, variants)
    g, o = ps
    assert g["decode_tok_s"]["socllm-off"] == 100 and g["decode_tok_s"]["socllm-auto"] == 240
    assert g["best_llama"] == "llama.cpp-lookup10" and o["best_llama"] == "llama.cpp"
    assert g["ratios"] == {"socllm-auto/socllm-off": 2.4, "socllm-auto/best llama.cpp": 1.6}
    assert g["e2e_speedups"] == {"socllm-off/socllm-auto": 2.0}
    assert g["acceptance"]["socllm-auto"] == {"drafted": 30, "accepted": 18, "verify_steps": 6,
                                              "accepted_per_step": 3.0, "accepted_share": 0.6}
    assert g["identical"] == {"socllm-auto": True} and o["identical"] == {"socllm-auto": False}
    kinds = per_kind(ps, rows, variants)
    assert kinds["grounded"]["ratios"]["socllm-auto/socllm-off"]["median"] == 2.4
    assert kinds["open"]["identical"]["socllm-auto"] == "0/1"
    t = targets(kinds, "q16")
    assert list(t.values()) == [True, True, True, False]
