"""The simulated SoC (policies/sim/simulate.py, policies/sim/soc.py): socllm's own step programs in
virtual time. Makespans of hand-made programs are computed here by hand from the profile's
published numbers; the published models' decode rates come out within ±25 % of HeteroLLM's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from socllm.graph.program import StepProgram, Task
from socllm.policies.sim.simulate import simulate_step
from socllm.policies.sim.soc import load_soc

SOC = "snapdragon-8gen3"
K = M = 4096
W4 = 0.625                  # bytes per weight of socllm's Q4_1 layout


def _linear(**kw):
    return Task("linear", {"K": K, "M": M, "w": ("w4", 0, 0, 0)}, **kw)


def _mem_s(proc, bandwidth=None):
    """A one-row 4096x4096 W4 linear on `proc`: memory-bound, bytes / bandwidth + kernel cost."""
    nbytes = M * K * W4 + (K + M) * 2
    return nbytes / (bandwidth or proc.bandwidth) + proc.kernel_s


def test_two_dependent_kernels_take_the_sum_of_their_times_and_one_sync():
    soc = load_soc(SOC)
    gpu, npu = soc.processors["gpu"], soc.processors["npu"]
    # the NPU waits for the GPU's word: decode is GPU-dominant, so the NPU pays no resubmission
    prog = StepProgram("decode", 1, {"gpu": [_linear(signals=[(100, 1)])],
                                     "npu": [_linear(waits=[(100, 1)])]})
    r = simulate_step(prog, soc, 1, 0)
    assert 2 * M * K / gpu.flops < _mem_s(gpu)           # both memory-bound
    assert r.seconds == pytest.approx(_mem_s(gpu) + soc.sync_s + _mem_s(npu), rel=1e-9)
    assert r.syncs == 1
    slow = simulate_step(prog, soc, 1, 0, fast_sync=False)
    assert slow.seconds - r.seconds == pytest.approx(soc.sync_copy_s - soc.sync_s, rel=1e-9)


def test_kernels_at_once_share_the_socs_bandwidth():
    """HeteroLLM §3.3: each processor alone reaches its own bandwidth, both together the SoC's
    total, shared in proportion to what each draws."""
    soc = load_soc(SOC)
    gpu, npu = soc.processors["gpu"], soc.processors["npu"]
    alone = simulate_step(StepProgram("decode", 1, {"gpu": [_linear()]}), soc, 1, 0)
    assert alone.seconds == pytest.approx(_mem_s(gpu), rel=1e-9)
    both = simulate_step(StepProgram("decode", 1, {"gpu": [_linear()], "npu": [_linear()]}), soc, 1, 0)
    share = soc.bandwidth_total / (gpu.bandwidth + npu.bandwidth)
    # the NPU (no kernel cost) ends first; the GPU, a fraction f of its kernel done by then,
    # finishes the rest alone at its own bandwidth
    t1 = _mem_s(npu, npu.bandwidth * share)
    f = t1 / _mem_s(gpu, gpu.bandwidth * share)
    assert both.seconds == pytest.approx(t1 + (1 - f) * _mem_s(gpu), rel=1e-9)
    assert both.bandwidth == pytest.approx(2 * (M * K * W4 + (K + M) * 2) / both.seconds)


def test_a_task_waiting_for_a_word_nobody_signals_is_a_deadlock():
    soc = load_soc(SOC)
    prog = StepProgram("decode", 1, {"gpu": [_linear(waits=[(7, 1)])], "npu": [_linear(waits=[(8, 1)], signals=[(7, 1)])],
                                     "cpu": []})
    prog.tasks["gpu"][0].signals = [(8, 1)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_step(prog, soc, 1, 0)


@pytest.fixture(scope="module")
def planners():
    from socllm.models.published import PUBLISHED, shape_weights
    from socllm.policies.sim.soc_plans import planner_for
    soc = load_soc(SOC)
    return soc, {m: planner_for(cfg, shape_weights(cfg), soc, 4096) for m, cfg in PUBLISHED.items()}


def test_socllms_programs_simulate_deterministically(planners):
    from socllm.policies.sim.soc_plans import decode, prefill
    soc, pl = planners
    for _ in range(2):
        a = [prefill(soc, pl["llama-8b"], "hetero-tensor", 300), decode(soc, pl["llama-8b"], "hetero-tensor", 300)]
        b = [prefill(soc, pl["llama-8b"], "hetero-tensor", 300), decode(soc, pl["llama-8b"], "hetero-tensor", 300)]
        assert a == b


def test_the_solvers_cuts_on_the_predicted_profile_follow_the_socs_characteristics(planners):
    """HeteroLLM §4.1.2 / §4.3 on the prediction mode: decode is memory-bound and both processors
    read at the same bandwidth, so a decode cut halves a linear (within an ALIGN); prefill is
    compute-bound and the NPU is ~10x the GPU, so the GPU's share of a prefill cut is small."""
    from socllm.graph.partition import ALIGN
    from socllm.policies.rowcut import solve_part
    from socllm.policies.sim.soc_plans import predicted_profile
    from socllm.models.published import PUBLISHED
    soc, _ = planners
    prof = predicted_profile(soc, PUBLISHED["llama-8b"])
    for part in ("ffn_up", "ffn_gate", "attn_q"):
        M = max(prof["decode"]["dominant"][part])
        dec = solve_part(prof["decode"], part, M)
        assert dec.pays and abs(dec.rows_other - M / 2) <= 2 * ALIGN, (part, dec)
        pre = solve_part(prof["prefill"], part, M, cut_only=True)
        assert pre.rows_other <= M // 8, (part, pre)


def test_decode_rates_within_a_quarter_of_heterollms_published_ones(planners):
    """§5.3: Hetero-tensor decodes Llama-8B at 14.01, Llama-3B at 29.9 and InternLM-1.8B at 51.12
    tokens/s; decoding on both processors reads faster than the GPU alone (43.3 -> 59.1 GB/s)."""
    from socllm.policies.sim.soc_plans import against_published, decode
    soc, pl = planners
    rows = [r for r in against_published(soc, pl) if r["what"] == "decode tok/s"]
    assert len(rows) == 3 and all(0.75 <= r["ratio"] <= 1.25 for r in rows), rows
    gpu = decode(soc, pl["llama-8b"], "gpu", 256, weights="w4a16")
    both = decode(soc, pl["llama-8b"], "hetero-tensor", 256, weights="w4a16")
    assert both["bandwidth_gbs"] > 1.15 * gpu["bandwidth_gbs"] and both["tok_s"] > gpu["tok_s"]


def test_socllm_simulate_prints_json_and_refuses_bad_input():
    cli = [sys.executable, "-m", "socllm.actors.front.cli", "simulate"]
    r = subprocess.run(cli + ["--model", "llama-3b", "--prompt-len", "300", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["simulated"] is True and out["soc"] == SOC and out["prompt_len"] == 300
    assert {p["strategy"] for p in out["prefill"]} >= {"gpu", "npu-pipe", "hetero-tensor"}
    r = subprocess.run(cli + ["--prompt-len", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "prompt-len" in r.stderr
    r = subprocess.run(cli + ["--soc", "nokia-3310"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2


@pytest.mark.parametrize("length", [300, 525])
def test_figure_14s_ranking_at_misaligned_lengths(planners, length):
    """HeteroLLM §5.2.2, Figure 14 (Llama-8B): Hetero-tensor (here the faster of socllm's row-cut
    and seq-cut, which wins) is the fastest; Pipe beats Padding and Online-prepare."""
    from socllm.policies.sim.soc_plans import PREFILL, prefill
    soc, pl = planners
    t = {s: prefill(soc, pl["llama-8b"], s, length, weights="w4a16")["seconds"] for s in PREFILL}
    assert t["hetero-tensor"] == min(t.values()) == t["seq-cut"] < t["hybrid"]
    assert t["npu-pipe"] < t["npu-padding"] and t["npu-pipe"] < t["online-prepare"]
    assert t["gpu"] == max(t.values())


def test_the_agent_policy_on_the_simulated_soc_serves_reactive_requests_first(planners):
    """Agent.xpu §6 in virtual time: socllm's policies unchanged, steps timed by the simulator.
    Every request of the trace is served by both; reactive requests wait less under the agent
    policy (NPU prefill beside GPU decode, reactive first) than under FCFS on the GPU; runs repeat
    exactly."""
    import random
    from socllm.policies.sim.soc_serving import serve, summary
    soc, pl = planners
    rng = random.Random(1)
    items = sorted((rng.uniform(0, 120), cls, rng.randint(20, 600), rng.randint(8, 120))
                   for cls in ("reactive",) * 6 + ("proactive",) * 12)
    fcfs, agent = (serve(soc, pl["llama-3b"], items, how) for how in ("fcfs-gpu", "agent"))
    assert len(fcfs) == len(agent) == len(items)
    f, a = summary(fcfs)["reactive"], summary(agent)["reactive"]
    assert a["e2e_mean_s"] < f["e2e_mean_s"] and a["ttft_mean_s"] < f["ttft_mean_s"]
    assert serve(soc, pl["llama-3b"], items, "agent") == agent
    with pytest.raises(ValueError, match="serve"):
        serve(soc, pl["llama-3b"], items, "lifo")
    # the two pipelines share the SoC's bandwidth: with less of it for both at once, the agent
    # policy's overlapping steps slow down; fcfs, one pipeline, never overlaps
    import dataclasses
    narrow = dataclasses.replace(soc, bandwidth_total=soc.processors["gpu"].bandwidth)
    assert serve(narrow, pl["llama-3b"], items, "fcfs-gpu") == fcfs
    slowed = summary(serve(narrow, pl["llama-3b"], items, "agent"))
    assert slowed["proactive"]["e2e_mean_s"] > summary(agent)["proactive"]["e2e_mean_s"]


def test_the_simulated_core_ultra_serves_agents_with_agent_xpus_published_figure_beside():
    """`socllm simulate --soc core-ultra --workload agents`: Agent.xpu's testbed, its W8A16
    weights by default; the JSON carries the simulated reduction of the reactive mean latency
    (agent against fcfs on the iGPU, positive: the agent policy is faster) beside the published
    one for the same model and rates; the SoC's workload figures stay out of the per-step table."""
    cli = [sys.executable, "-m", "socllm.actors.front.cli", "simulate", "--soc", "core-ultra"]
    r = subprocess.run(cli + ["--workload", "agents", "--model", "llama-3b", "--minutes", "3",
                              "--reactive-rate", "3", "--proactive-rate", "6", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["simulated"] is True and out["weights"] == "w8a16"
    assert out["published_reduction"] == 0.9384
    assert 0 < out["reactive_mean_reduction"] < 1
    r = subprocess.run(cli + ["--model", "llama-3b", "--prompt-len", "256", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["published"] == []


def test_longer_proactive_prompts_load_the_simulated_baseline_more():
    """--proactive-words sets the proactive prompts' median (Agent.xpu's proactive datasets hold
    longer inputs than the default replay's): the same arrivals with longer prompts keep the
    iGPU baseline busier, so its reactive requests wait longer; a median out of range is refused
    in one line."""
    cli = [sys.executable, "-m", "socllm.actors.front.cli", "simulate", "--soc", "core-ultra", "--workload",
           "agents", "--model", "llama-3b", "--minutes", "3", "--json"]
    runs = {}
    for words in ("320", "600"):
        r = subprocess.run(cli + ["--proactive-words", words], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        runs[words] = json.loads(r.stdout)
    assert runs["600"]["workload"]["lengths"]["proactive"]["words"][0] == 600
    fcfs = {w: o["runs"]["fcfs-gpu"]["reactive"]["e2e_mean_s"] for w, o in runs.items()}
    assert fcfs["600"] > fcfs["320"]
    r = subprocess.run(cli + ["--proactive-words", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "--proactive-words" in r.stderr
