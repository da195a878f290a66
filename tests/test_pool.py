"""The unified pool: slots reused across layers, KV written in place, no leaked segments."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time


from socllm.graph.build import build_graph
from socllm.graph.liveness import assign_slots
from socllm.graph.lower import lower
from socllm.graph.partition import DOMINANT, placed, row_cut
from socllm.graph.program import StepProgram, segment_live_out
from socllm.memory.arena import SHM_DIR, Arena, reap_orphans
from socllm.memory.layout import PROCESSORS, PoolLayout
from socllm.memory.ready import ReadyWords, SleepPredictor
from socllm.policies.placement import placement


def test_slot_count_does_not_grow_with_layers(model_config):
    counts = {L: len(assign_slots(build_graph(model_config, L)).sizes) for L in (2, 4, 30)}
    assert counts[2] == counts[4] == counts[30] <= 10


def test_slots_never_hold_two_live_tensors(model_config):
    g = build_graph(model_config, 3)
    slots = assign_slots(g)
    live: dict = {}                      # slot -> tensor currently in it
    last = {n: i for i, op in enumerate(g.ops) for n in op.inputs.values()}
    for i, op in enumerate(g.ops):
        for name in op.inputs.values():
            if name in slots.assign:
                assert live[slots.assign[name]] == name, f"{name} was overwritten before op {i}"
        for name in op.outputs.values():
            if name in slots.assign:
                s = slots.assign[name]
                prev = live.get(s)
                assert prev is None or last.get(prev, -1) <= i, f"{name} overwrites live {prev}"
                live[s] = name


def _program(model_config, plan, phase, n_layers=2, cut=None):
    """cut: part -> rows on the non-dominant processor (the tensor plan's row-cut)."""
    g = build_graph(model_config, n_layers)
    slots = assign_slots(g)
    place = placement(plan, phase) if cut is None else placed
    if cut is not None:
        g = row_cut(g, cut, DOMINANT[phase], "npu" if DOMINANT[phase] == "gpu" else "gpu")
    refs, words, off = {}, {}, 0
    for name, t in g.tensors.items():
        off += 4096
        weight = ("w8", off, off + 1) if t.dtype == "q8_0" else ("w4", off, off + 1, off + 2)
        refs[name] = ("kv", off) if t.kind == "kv" else weight if t.kind == "weight" \
            else ("a", 10**7 + 4096 * slots.assign[name]) if t.kind == "act" else ("a", off)
    locs = [f"slot.{i}" for i in range(len(slots.sizes))] + [n for n, t in g.tensors.items()
                                                             if t.kind in ("kv", "input", "output")]
    words = {k: 16 + i for i, k in enumerate(locs)}
    done = {p: 4 + i for i, p in enumerate(PROCESSORS)}
    return g, lower(g, slots, refs, words, done, place, phase, 32)


def test_kv_projections_write_in_place(model_config):
    g, prog = _program(model_config, "gpu", "decode")
    kv_writes = [t for t in prog.tasks["gpu"] if t.args["out"][0] == "kv"]
    # per layer: V by its linear, K by its rope, both straight into the cache; no copy op exists
    assert sorted(t.op for t in kv_writes) == ["linear", "linear", "rope", "rope"]
    assert {t.args["out"][1] for t in kv_writes} == {t.args["k"][1] for t in prog.tasks["gpu"]
                                                     if t.op == "attention"} | \
        {t.args["v"][1] for t in prog.tasks["gpu"] if t.op == "attention"}


def test_single_processor_plan_has_no_waits(model_config):
    _, prog = _program(model_config, "npu", "prefill")
    assert list(prog.tasks) == ["npu"]
    assert all(not t.waits and not t.signals for t in prog.tasks["npu"])


def test_hetero_prefill_hands_attention_to_gpu_and_back(model_config):
    _, prog = _program(model_config, "hetero", "prefill", n_layers=2)
    gpu, npu = prog.tasks["gpu"], prog.tasks["npu"]
    assert [t.op for t in gpu] == ["attention", "attention"]
    for att in gpu:
        assert att.waits, "attention must wait for the NPU's q/k/v"
        assert att.signals, "attention must signal the NPU's o-projection"
    # the o-projection after each attention waits for the GPU
    oproj = [t for t in npu if t.op == "linear" and t.seq == gpu[0].seq + 1]
    assert oproj and oproj[0].waits
    # round trip through msgpack keeps every field
    again = StepProgram.from_bytes(prog.to_bytes())
    assert [(t.op, t.args, t.waits, t.signals, t.seq) for t in again.tasks["gpu"]] == \
        [(t.op, t.args, t.waits, t.signals, t.seq) for t in gpu]


def test_row_cut_decode_is_gpu_dominant(model_config):
    """HeteroLLM §4.2, Figure 11: the GPU enqueues its half unsynchronised (no signal, so no queue
    finish) and its next kernel waits only for the NPU's half; the NPU waits for its input."""
    g, prog = _program(model_config, "tensor", "decode", cut={"ffn_up": 768})
    gpu, npu = prog.tasks["gpu"], prog.tasks["npu"]
    assert [t.op for t in npu] == ["linear", "linear"]          # one half per layer
    done_npu = 4 + PROCESSORS.index("npu")
    for half in npu:
        assert half.rows == (768, 1536) and half.args["M"] == 768 and half.args["ld"] == 1536
        assert half.waits, "the NPU's half waits for the GPU's normed input"
        assert (done_npu, half.seq) in half.signals
        mine = next(t for t in gpu if t.seq == half.seq + 1)
        assert mine.rows == (0, 768) and not mine.signals and not mine.waits
        silu = next(t for t in gpu if t.op == "silu_mul" and t.layer == half.layer)
        assert (done_npu, half.seq) in silu.waits
        # the halves write their columns of one slot: no merge copy
        assert half.args["out"][1] == mine.args["out"][1] + 768 * 4


def test_row_cut_prefill_is_npu_dominant(model_config):
    """In prefill the rest of the layer runs on the NPU, which waits for the GPU's half; the GPU's
    next half waits until the NPU has finished the layer's input."""
    g, prog = _program(model_config, "tensor", "prefill", cut={"attn_output": 192})
    gpu, npu = prog.tasks["gpu"], prog.tasks["npu"]
    assert [t.rows for t in gpu] == [(384, 576), (384, 576)]
    done_gpu = 4 + PROCESSORS.index("gpu")
    for half in gpu:
        assert half.waits and (done_gpu, half.seq) in half.signals
        add = next(t for t in npu if t.op == "add" and t.seq > half.seq)
        assert (done_gpu, half.seq) in add.waits
    assert gpu[1].waits[0][1] > gpu[0].seq   # layer 1's half waits for the NPU's layer 1
    again = StepProgram.from_bytes(prog.to_bytes())
    assert [t.rows for t in again.tasks["gpu"]] == [(384, 576), (384, 576)]


def test_segment_live_out_keeps_only_what_others_read(model_config):
    _, prog = _program(model_config, "hetero", "prefill", n_layers=2)
    npu = prog.tasks["npu"]
    first_att = prog.tasks["gpu"][0]
    seg = {t.seq for t in npu if t.seq < first_att.seq}
    live = segment_live_out(prog, seg)
    q_slot = first_att.args["q"][1]
    assert q_slot in live                                  # the GPU reads the rope'd q
    assert first_att.args["k"][1] in live                  # K cache rows (in place)
    norm_out = next(t for t in npu if t.op == "rmsnorm").args["out"][1]
    assert norm_out not in live or norm_out == q_slot      # read only inside the segment


def test_ready_word_blocking_wait_burns_no_core():
    arena = Arena.create(1 << 16)
    try:
        words = ReadyWords(arena.buf[:64])
        t0 = time.process_time()
        threading.Timer(0.3, lambda: words.store(2, 7)).start()
        assert words.wait(2, 7)
        assert time.process_time() - t0 < 0.05             # slept in the kernel, did not spin
        assert not words.wait(3, 1, timeout_s=0.05)
    finally:
        arena.unlink()


def test_predicted_sleep_learns_the_wait_and_still_wakes_on_time():
    """HeteroLLM §4.2: after a few steps of ~20 ms waits the waiter sleeps ~80 % of it, then
    polls; each wait still ends when the word is stored, and a short wait is never slept."""
    arena = Arena.create(1 << 16)
    try:
        words, pred = ReadyWords(arena.buf[:64]), SleepPredictor(fraction=0.8)
        for step in range(1, 5):
            t0 = time.perf_counter()
            threading.Timer(0.02, lambda v=step: words.store(2, v)).start()
            assert pred.wait(words, "site", 2, step, timeout_s=5)
            assert time.perf_counter() - t0 < 0.2
        assert 0.8 * 0.015 < pred.sleep_s("site") < 0.8 * 0.1
        words.store(3, 1)
        assert pred.wait(words, "short", 3, 1) and pred.sleep_s("short") == 0.0
    finally:
        arena.unlink()


def test_arena_attach_maps_weights_read_only():
    code = (
        "from socllm.memory.arena import Arena;import sys;"
        "a=Arena.attach(sys.argv[1], int(sys.argv[2]), 4096);"
        "print(int(a.buf[100]), int(a.buf[5000]));a.buf[5000]=9;a.buf[100]=1"
    )
    arena = Arena.create(3 * 4096, readonly_bytes=4096)
    try:
        arena.buf[100], arena.buf[5000] = 42, 43
        r = subprocess.run([sys.executable, "-c", code, arena.name, str(arena.size)], capture_output=True, text=True)
        assert r.stdout.split() == ["42", "43"]
        assert r.returncode != 0                            # the write to the weight region faults
        assert arena.buf[5000] == 9 and arena.buf[100] == 42
    finally:
        arena.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, arena.name))


def test_segment_of_a_killed_creator_is_reaped():
    code = "from socllm.memory.arena import Arena;import os;a=Arena.create(4096);print(a.name,flush=True);os._exit(0)"
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    assert os.path.exists(os.path.join(SHM_DIR, name))     # os._exit skipped the cleanup
    assert name in reap_orphans()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_layout_round_trips(model_config, model_weights):
    from socllm.memory.layout import plan_layout
    lay = plan_layout({"output_norm.weight": model_weights["output_norm.weight"],
                       "blk.0.attn_q.weight": model_weights["blk.0.attn_q.weight"]},
                      2, 192, [4096, 8192], 32, 64, 1000)
    again = PoolLayout.from_dict(lay.to_dict())
    assert again == lay
    assert lay.readonly_bytes % 4096 == 0 and min(lay.kv.values()) >= lay.readonly_bytes
    assert lay.kv_rows == 64 + 32                          # room for a padded chunk past the context
