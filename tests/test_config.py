"""One configuration (policies/config.py): every default written once, each bad value refused once
in one line that names it, the environment read in one place, and a knob set where `socllm serve`
runs reaching the actors of a cluster whose processes never saw it."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from socllm.policies.config import ENV, ConfigError, EngineConfig, ServeConfig

SOCLLM = [sys.executable, "-m", "socllm.actors.front.cli"]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cli_defaults_are_the_config_fields():
    from socllm.actors.front.cli import _parser
    serve, gen = _parser().parse_args(["serve"]), _parser().parse_args(["generate", "hi"])
    flagged = {k: v for k, v in vars(serve).items() if k in {f.name for f in dataclasses.fields(ServeConfig)}}
    assert set(flagged) == {"model", "context", "max_seqs", "kv_mb", "precision", "policy", "plan",
                            "prefix_cache", "prefix_cache_mb", "prefix_cache_idle_s", "abandon_s", "http_host", "http_port", "api_key",
                            "max_body_mb", "max_waiting", "speculate", "draft_max", "draft_ranks", "warm",
                            "hcmp_share"}
    assert flagged == {k: getattr(ServeConfig(), k) for k in flagged}
    assert gen.context == EngineConfig().context and gen.model is None


def test_engine_and_service_share_one_default_precision():
    from socllm.actors import pool, service
    assert EngineConfig().precision == ServeConfig().precision == pool.DEFAULT_PRECISION \
        == service.DEFAULT_PRECISION == "q16"


@pytest.mark.parametrize("cls, field, value", [
    (EngineConfig, "context", 8), (EngineConfig, "max_seqs", 0), (ServeConfig, "max_seqs", 257),
    (EngineConfig, "threads", -1), (ServeConfig, "http_port", 70000), (ServeConfig, "prefill_chunk", 0),
    (EngineConfig, "kv_mb", -1.0), (ServeConfig, "kv_mb", 0), (ServeConfig, "abandon_s", 0.0),
    (ServeConfig, "prefix_cache_idle_s", -1.0),
    (EngineConfig, "sleep_fraction", 1.5), (EngineConfig, "precision", "int4"),
    (ServeConfig, "precision", "f16"), (ServeConfig, "policy", "lifo"), (ServeConfig, "plan", "tpu"),
    (EngineConfig, "fuse", "no"), (EngineConfig, "model", ""), (EngineConfig, "pocl_cpu", ""),
    (ServeConfig, "http_host", ""), (ServeConfig, "draft_ranks", 0), (ServeConfig, "draft_ranks", 5),
    (ServeConfig, "hcmp_share", 1.5),
])
def test_a_bad_value_is_refused_in_one_line_naming_its_field(cls, field, value):
    with pytest.raises(ConfigError) as e:
        cls(**{field: value})
    assert e.value.field == field and str(e.value).startswith(field + " must be ")
    assert len(str(e.value).splitlines()) == 1 and repr(value) in str(e.value)


@pytest.mark.parametrize("field, text, value", [
    ("threads", "3", 3), ("fuse", "0", False), ("whole_graph", "0", False),
    ("sleep_fraction", "0.8", 0.8), ("cl_discrete", "1", True), ("pocl_cpu", "znver3", "znver3"),
    ("pocl_as_is", "1", True),
])
def test_from_env_reads_each_variable(field, text, value):
    var = ENV[field][0]
    assert getattr(ServeConfig.from_env(env={var: text}), field) == value
    assert getattr(EngineConfig.from_env(env={var: ""}), field) == getattr(EngineConfig(), field)
    # a field given explicitly wins over the environment
    given = getattr(EngineConfig(), field) if field != "threads" else 5
    assert getattr(EngineConfig.from_env(env={var: text}, **{field: given}), field) == given


@pytest.mark.parametrize("var, text", [
    ("SOCLLM_THREADS", "two"), ("SOCLLM_THREADS", "0"), ("SOCLLM_FUSE", "yes"),
    ("SOCLLM_WHOLE_GRAPH", "off"), ("SOCLLM_SLEEP_FRACTION", "x"), ("SOCLLM_SLEEP_FRACTION", "1.5"),
    ("SOCLLM_CL_DISCRETE", "true"), ("SOCLLM_POCL_AS_IS", "yes"),
])
def test_from_env_refuses_a_bad_value_in_one_line_naming_the_variable(var, text):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_env(env={var: text})
    assert e.value.field == var and str(e.value).startswith(var + " must be ")
    assert len(str(e.value).splitlines()) == 1 and repr(text) in str(e.value)


@pytest.mark.parametrize("args, line", [
    (["serve", "--max-seqs", "0"], "--max-seqs must be in [1, 256], got 0"),
    (["serve", "--abandon-s", "0"], "--abandon-s must be > 0, got 0.0"),
    (["generate", "hi", "--context", "8"], "--context must be at least 16, got 8"),
])
def test_the_cli_says_a_field_as_its_flag(args, line, capsys):
    from socllm.actors.front.cli import main
    assert main(args) == 2                      # refused before any Ray cluster is looked for
    assert capsys.readouterr().err.strip().splitlines() == [f"socllm: error: {line}"]


def test_only_the_config_reads_socllm_variables():
    """No SOCLLM_* read from the environment below the config; memory/ reads none at all."""
    for layer in ("actors", "graph", "memory", "policies", "models"):
        for path in (ROOT / layer).rglob("*.py"):
            if path.name == "config.py" and layer == "policies":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                reads = "os.environ" in line or "getenv(" in line
                assert not (reads and "SOCLLM_" in line), f"{path}:{n}: {line.strip()}"
                assert not (reads and layer == "memory"), f"{path}:{n}: {line.strip()}"


def test_knobs_set_where_serve_runs_reach_a_cluster_started_before(ray_session):
    """The test session's Ray cluster began without these variables (as one `ray start` began);
    `socllm serve` runs with them: each processor actor applies them (its status), because the
    config travels as the service's argument, not through the cluster's environment."""
    knobs = {"SOCLLM_FUSE": "0", "SOCLLM_WHOLE_GRAPH": "0", "SOCLLM_SLEEP_FRACTION": "0.5"}
    assert not set(knobs) & set(os.environ), "the cluster's processes must not have them already"
    env = {**os.environ, "RAY_ADDRESS": ray_session[0]}
    r = subprocess.run(SOCLLM + ["serve", "--http-port", "0", "--context", "256", "--max-seqs", "2",
                                 "--kv-mb", "8", "--plan", "hetero", "--no-warmup"],
                       env={**env, **knobs}, capture_output=True, text=True, timeout=600)
    try:
        assert r.returncode == 0, r.stderr
        st = subprocess.run(SOCLLM + ["status", "--json"], env=env, capture_output=True, text=True,
                            timeout=120)
        assert st.returncode == 0, st.stderr
        procs = {p["processor"]: p for p in json.loads(st.stdout)["processors"]}
    finally:
        subprocess.run(SOCLLM + ["stop"], env=env, capture_output=True, timeout=300)
    assert set(procs) == {"gpu", "npu"}          # the plan's processors only
    assert procs["gpu"].get("fuse") is False and procs["npu"].get("whole_graph") is False
    assert all(p.get("sleep_fraction") == 0.5 for p in procs.values()), procs


def test_the_cpus_llvm_14_cannot_name_get_a_target_and_the_rest_keep_theirs():
    """actors/gpu/device.py named_cpu: Zen 5, Emerald Rapids and Granite Rapids get the best target
    whose features the host has, and so does a Zen 4 (LLVM 14 names it znver3, without AVX-512); a
    CPU LLVM 14 names as what it is (Zen 3, Sapphire Rapids, Ice Lake) keeps that name."""
    from socllm.actors.gpu.device import TARGETS, named_cpu
    avx512 = " ".join(TARGETS["icelake-server"])
    avx2 = " ".join(TARGETS["znver3"])

    def cpu(vendor, family, model, flags):
        return {"vendor_id": vendor, "cpu family": str(family), "model": str(model), "flags": flags}
    assert named_cpu(cpu("AuthenticAMD", 26, 2, avx512)) == "icelake-server"        # Zen 5
    assert named_cpu(cpu("AuthenticAMD", 26, 2, avx2)) == "znver3"
    assert named_cpu(cpu("AuthenticAMD", 25, 17, avx512)) == "icelake-server"       # Zen 4: LLVM says znver3
    assert named_cpu(cpu("AuthenticAMD", 25, 33, avx2)) is None                     # Zen 3: LLVM's znver3
    assert named_cpu(cpu("GenuineIntel", 6, 0xcf, avx512)) == "icelake-server"      # Emerald Rapids
    assert named_cpu(cpu("GenuineIntel", 6, 0xad, avx512)) == "icelake-server"      # Granite Rapids
    assert named_cpu(cpu("GenuineIntel", 6, 0x8f, avx512)) is None                  # Sapphire Rapids
    assert named_cpu(cpu("GenuineIntel", 6, 0x6a, avx512)) is None                  # Ice Lake server
    assert named_cpu(cpu("GenuineIntel", 6, 0x97, avx2)) is None                    # Alder Lake
    assert named_cpu(cpu("AuthenticAMD", 26, 2, avx512), asked="znver3") == "znver3"
    assert named_cpu(cpu("GenuineIntel", 6, 0xcf, avx512), asked="znver3") == "icelake-server"
    assert named_cpu(cpu("GenuineIntel", 6, 0xb7, avx2)) is None                    # Raptor Lake


def test_pocl_copies_made_for_deleted_installs_are_removed(tmp_path):
    """gpu/device.py keeps a copy of PoCL's library per pyopencl install (~104 MB, linked to
    that install's PoCL resources); a venv or clone deleted leaves its link dangling, and the
    next copy made removes such copies, not the others."""
    import os

    from socllm.actors.gpu.device import _prune
    root = tmp_path / "pocl"
    gone, live = root / "gone", root / "live"
    for d in (gone, live):
        (d / "pyopencl-icelake-server").mkdir(parents=True)
    (tmp_path / "resources").mkdir()
    os.symlink(tmp_path / "a-deleted-venv", gone / "pocl_binary_distribution")
    os.symlink(tmp_path / "resources", live / "pocl_binary_distribution")
    _prune(str(root))
    assert os.listdir(root) == ["live"]
