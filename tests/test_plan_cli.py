"""A fresh machine: `socllm plan` measures this machine's op profile when there is none (and says
so), and every command of the README's Use section runs from an empty cache (HOME and
XDG_CACHE_HOME in a new folder), in the README's order, as a new user would type them."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

from socllm.models.gguf_file import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _fresh_env(home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "XDG_CACHE_HOME")}
    env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"),
               RAY_TMPDIR=os.path.join(home, "r"))       # short: Ray's socket paths < 108 chars
    os.makedirs(env["RAY_TMPDIR"])
    return env


def test_plan_from_an_empty_cache_profiles_this_machine_first(short_tmp):
    env = _fresh_env(short_tmp)
    path = os.path.join(short_tmp, ".cache", "socllm", "op-profile.json")
    cmd = [os.path.join(BIN, "socllm"), "plan", "--prompt-len", "300", "--json"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)                      # stdout is the plan only; progress on stderr
    assert out["profile"]["path"] == path and os.path.isfile(path)
    assert out["profile"]["measured_now_s"] > 0 and "measured now" in out["source"]
    assert f"no op profile at {path}" in r.stderr and "profiled in" in r.stderr
    assert not out["simulated"] and out["strategy"] and out["predicted_total_s"] > 0
    # the second run reads the profile the first one measured, and shows the auto plans that
    # `serve` chose with today's kernels, not the table's other timings (a step profile, hcmp's
    # bands) nor a choice made with older kernels
    from socllm.policies.plan_cache import kernels
    key = "m.gguf:ab|host cpu [] []|2|q16|128|2048|16|margin 1.25|npu prefill bf16|whole graphs from 256|"
    table = {key + kernels(): {"plan": "hetero", "chunk_ms": {"gpu": 120.0, "npu": 90.0}},
             key + "kernels 0123456789abcdef": {"plan": "gpu", "chunk_ms": {"gpu": 1.0, "npu": 9.0}},
             key + kernels() + "|steps gpu npu [] hcmp 0": {"profile": {"1": 7.0}},
             key + kernels() + "|hcmp 16": {"rows": [1], "bands": [2], "ms": [3.0]}}
    with open(os.path.join(short_tmp, ".cache", "socllm", "plans.json"), "w") as f:
        json.dump(table, f)
    r = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "profiled" not in r.stderr, r.stderr
    assert f"this machine's op profile {path}, prediction mode" in r.stdout.splitlines()[0]
    chose = [line for line in r.stdout.splitlines() if "serve --plan auto chose" in line]
    assert chose == ["serve --plan auto chose hetero for m.gguf on host cpu at q16, --context 2048 "
                     "--max-seqs 16 (a whole chunk of 128 rows: gpu 120 ms, npu 90 ms)"], r.stdout


def _readme_use() -> list[str]:
    """The command lines of the README's Use section: comments and [optional] parts dropped,
    the placeholder GGUF replaced by the default model's file."""
    text = open(os.path.join(ROOT, "README.md")).read()
    use = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```\n(.*?)```", use, re.S):
        for line in block.splitlines():
            line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).strip()
            if line:
                lines.append(line)
    return lines


USE = _readme_use()
PLAN_LINE = ".venv/bin/socllm plan --prompt-len 300"     # test_plan_from_an_empty_cache's command


@pytest.fixture(scope="module")
def use_env():
    home = tempfile.mkdtemp(prefix="su", dir="/tmp")
    yield _fresh_env(home)
    shutil.rmtree(home, ignore_errors=True)


def test_the_readme_use_section_was_read():
    assert len(USE) >= 9 and PLAN_LINE in USE


def _slow(i: int, line: str) -> bool:
    """The README lines whose run the default suite has elsewhere: the `generate` lines after the
    first (~20 s each; their paths are tested in test_cli.py), and the `plan` line (run from an
    empty cache, with --json, by test_plan_from_an_empty_cache_profiles_this_machine_first)."""
    first = next(j for j, x in enumerate(USE) if x.startswith(".venv/bin/socllm generate"))
    return line.startswith(".venv/bin/socllm generate") and i != first or line == PLAN_LINE


@pytest.mark.parametrize("line", [pytest.param(line, marks=pytest.mark.slow) if _slow(i, line)
                                  else line for i, line in enumerate(USE)])
def test_a_readme_use_command_runs_from_an_empty_cache(line, use_env):
    """Each line of the README's Use section, as a user runs it on a fresh machine."""
    argv = shlex.split(line.replace("~/models/some.gguf", default_model_path()))
    assert argv[0].startswith(".venv/bin/"), line
    argv[0] = os.path.join(BIN, argv[0][len(".venv/bin/"):])
    r = subprocess.run(argv, env=use_env, capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, (line, r.stderr[-3000:])
    assert r.stdout.strip(), line


def test_plan_spec_times_decode_rows_and_reports_the_drafts_that_pay(short_tmp, tmp_path):
    """`socllm plan --spec` (Ghidorah's ARCA): this machine's decode step time for 1 .. 16 rows of
    one sequence, then at each acceptance rate the drafts a step policies/drafting.choose takes
    from that curve, with the expected tokens a step and the speed-up they give (none: 1.00x;
    some: more than 1, or choose would not have added them). A bad precision is one line, exit 2."""
    from tiny_gguf import write_tiny

    from socllm.policies.drafting import MAX_DRAFT, choose, expected
    path = write_tiny(tmp_path / "t.gguf", dim=64, ffn=128, head_dim=32, matrix="Q4_1", layers=2,
                      vocab=300)
    env = _fresh_env(short_tmp)
    cmd = [os.path.join(BIN, "socllm"), "plan", "--spec", "--model", str(path)]
    r = subprocess.run(cmd + ["--precision", "f32", "--json"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["precision"] == "f32" and "timing decode steps" in r.stderr
    cost = [0.0] + [out["step_ms"][str(n)] / 1e3 for n in range(1, MAX_DRAFT + 2)]
    assert all(c > 0 for c in cost[1:])
    assert set(out["best_by_acceptance"]) == {"0.3", "0.5", "0.7", "0.8", "0.9", "0.95"}
    for rate, best in out["best_by_acceptance"].items():
        k = best["drafts"]
        assert k == choose(cost, [float(rate)], [MAX_DRAFT], MAX_DRAFT + 1)[0], rate
        assert best["tokens_per_step"] == pytest.approx(expected(float(rate), k), abs=1e-3)
        assert best["speedup"] == pytest.approx(expected(float(rate), k) * cost[1] / cost[1 + k], rel=1e-2)
        assert best["speedup"] == 1.0 if k == 0 else best["speedup"] > 0.999
    # draft trees (this model has no heads: the default model's 3), nodes best first while they pay
    import numpy as np

    from socllm.policies.drafting import SIDE_PRIOR, choose_rows, tree_candidates
    trees = out["trees"]
    assert trees["heads"] == 3 and trees["second_rate"] == SIDE_PRIOR
    for rate, best in trees["best_by_acceptance"].items():
        chances = tree_candidates(np.zeros((3, 2), np.int64), [float(rate), SIDE_PRIOR], 3, MAX_DRAFT)[3]
        k = best["nodes"]
        assert k == choose_rows(cost, [chances], MAX_DRAFT + 1)[0], rate
        assert best["tokens_per_step"] == pytest.approx(1 + sum(chances[:k]), abs=1e-3)
        assert best["speedup"] == pytest.approx((1 + sum(chances[:k])) * cost[1] / cost[1 + k], rel=1e-2)
    r = subprocess.run(cmd + ["--precision", "q3"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
