"""The command line: bad input gets one line, exit 2, and leaves nothing behind; a good run prints
the JSON a user scripts against."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SOCLLM = [sys.executable, "-m", "socllm.actors.front.cli"]
# `socllm generate` joins the cluster RAY_ADDRESS names (the test session's), never one the user runs
pytestmark = pytest.mark.usefixtures("ray_session")


def _segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("socllm-")}


def _run(*args, timeout=240):
    before = _segments()
    r = subprocess.run(SOCLLM + list(args), capture_output=True, text=True, timeout=timeout)
    assert _segments() <= before, "a shared-memory segment was left behind"
    return r


def _one_line_error(r, needle):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("socllm: error:") and needle in lines[0], r.stderr


@pytest.mark.parametrize("args, needle", [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--max-tokens", "0"], "max-tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "1.5"], "top-p"),
    (["generate", "hi", "--top-k", "-5"], "--top-k"),
    (["generate", "hi", "--min-p", "2"], "--min-p"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["generate", "hi", "--plan", "tpu"], "plan"),
    (["generate", "hi", "--precision", "int4"], "precision"),
    (["generate", "hi", "--plan", "hcmp", "--hcmp-share", "1.5"], "--hcmp-share"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "not found"),
    (["bogus"], "invalid choice"),
    (["serve", "--context", "9000"], "--context must be in [16, 8192]"),   # before Ray is asked
    (["generate", "hi", "--context", "9000"], "--context must be in [16, 8192]"),
    (["inspect", os.path.dirname(__file__)], "is a directory"),
    (["plan", "--prompt-len", "64", "--profile", __file__], "is not an op profile"),
])
def test_bad_options_exit_2_with_one_line(args, needle):
    _one_line_error(_run(*args), needle)


def test_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    _one_line_error(_run("generate", "hi", "--model", str(bad)), "GGUF")


def test_an_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(_run("generate", "hi", "--model", str(path)), "architecture")


def test_a_prompt_longer_than_the_context():
    _one_line_error(_run("generate", "word " * 100, "--context", "32"), "context")


def test_generate_json_end_to_end():
    r = _run("generate", "The capital of France is", "--max-tokens", "4", "--plan", "npu",
             "--precision", "f32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"].startswith(" Paris") and out["plan"] == "npu"
    assert out["prompt_tokens"] == [504, 3575, 282, 4649, 314] and len(out["tokens"]) == 4
    t = out["timings"]
    assert set(t) == {"ttft_s", "prefill_s", "prefill_tok_s", "decode_s", "decode_tok_s"}
    assert 0 < t["prefill_s"] <= t["ttft_s"] and t["decode_s"] > 0


def test_a_stream_closed_while_a_step_of_it_runs_closes_after_that_step():
    """Client.polls' cleanup when Ctrl-C lands between submitting a poll step and holding its
    future: the step still runs, and closing the generator then must wait for it (aclose() of a
    running async generator raises, which replaced the KeyboardInterrupt: exit 1, not 130)."""
    import asyncio
    from socllm.actors.front.client import _aclose_after
    closed = []

    async def stream():
        try:
            while True:
                await asyncio.sleep(0.05)
                yield 1
        finally:
            closed.append(True)         # apolls' finally: where the request is cancelled

    async def main():
        agen = stream()
        step = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.01)
        assert agen.ag_running
        with pytest.raises(RuntimeError, match="already running"):
            await agen.aclose()
        await _aclose_after(agen)
        return await step

    assert asyncio.run(main()) == 1 and closed == [True]


def test_ctrl_c_mid_generation_leaves_nothing_behind():
    import signal
    import time
    actors = lambda: set(subprocess.run(["pgrep", "-f", "ControlActor|ProcessorActor|Planner|Service"],
                                        capture_output=True, text=True).stdout.split())
    before, actors_before = _segments(), actors()
    p = subprocess.Popen(SOCLLM + ["generate", "1, 2, 3, 4, 5, 6, 7, 8,", "--max-tokens", "2000",
                                   "--plan", "cpu", "--context", "2048"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # as from a terminal: a suite started in the background (`cmd &` from a
                         # script) hands its children SIGINT ignored, and Python keeps that
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(1)                    # generation has started: the pool and actors exist
    assert first and _segments() - before, "expected a live pool segment while generating"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "interrupted" in err, (p.returncode, err[-3000:])
    end = time.monotonic() + 60                 # the actors' processes exit after the driver
    while not (_segments() <= before and actors() <= actors_before) and time.monotonic() < end:
        time.sleep(0.2)
    assert _segments() <= before
    assert actors() <= actors_before, "actor processes left behind"


def test_generate_against_a_running_service_refuses_knobs_it_does_not_run_with():
    """`generate` sends its request to a running service only where the flags it was given are
    the service's (--model, --plan, --precision, --hcmp-share); another value is one error that
    points to --local, and flags left unset take the service's."""
    import argparse

    from socllm.actors.front.direct import same_service
    served = ("/m.gguf", "hcmp", "q16", 0.0)
    unset = dict(model=None, plan=None, precision=None, hcmp_share=None)
    same_service(argparse.Namespace(**unset), *served)
    same_service(argparse.Namespace(**{**unset, "plan": "hcmp", "hcmp_share": 0.0}), *served)
    for flag, value in (("plan", "gpu"), ("precision", "f32"), ("hcmp_share", 0.25)):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} .*--local"):
            same_service(argparse.Namespace(**{**unset, flag: value}), *served)
    with pytest.raises(ValueError, match="--hcmp-share as timed at its start; add --local"):
        same_service(argparse.Namespace(**{**unset, "hcmp_share": 0.25}), "/m.gguf", "hcmp", "q16", None)


def test_status_says_where_decode_steps_run_where_that_was_timed():
    """`socllm status`: auto's decode batch sizes (the GPU's kernels against the NPU's batch
    graphs) and the hcmp plan's CPU share by band, with what ARCA tried."""
    from socllm.actors.front.serve import _decode_lines
    [line] = _decode_lines({"else": "gpu", "npu_batches": [2],
                            "batch_ms": {"16": {"gpu": 29.7, "npu": 562.8}, "2": {"gpu": 8.2, "npu": 5.0}}})
    assert line.startswith("decode     rows 2 on the npu, the rest on the gpu") and \
        line.endswith("2:8.2/5.0 16:29.7/562.8)")
    [line] = _decode_lines({"hcmp": {"from": "timed", "bands": [[128, 0.125], [1024, 0.0]],
                                     "ms": {"128": {"shares": {"0.0": 27.5, "0.125": 20.1, "0.25": 22.0}}}}})
    assert "0.125 near position 128, 0 near position 1024 (ARCA, timed at start" in line
    assert "0.125:20.1" in line
    assert _decode_lines({"batch_ms": {}, "else": "gpu"}) == []
