"""The unified pool: slots reused across layers, KV written in place, no leaked segments."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from socllm.graph.build import build_graph
from socllm.graph.liveness import assign_slots
from socllm.graph.program import StepProgram, segment_live_out
from socllm.memory.arena import SHM_DIR, Arena, reap_orphans
from socllm.memory.layout import PROCESSORS, PoolLayout
from socllm.memory.ready import _SYS_FUTEX, ReadyWords, SleepPredictor

from testlib import program as _program


def test_symbolic_sizes_compare_and_evaluate_as_c_times_a_power_of_n():
    import pytest

    from socllm.graph.ir import N, Sym, sym
    a, b = N * 576 * 4, 4 * (1536 * N)
    assert a == Sym(2304, 1) and a.at(3) == 6912 and repr(a) == "2304*N" and sym(7) == 7
    assert a / b == 0.375 and (N * N) / a is None and a / 4 is None      # ratios: numbers or None
    assert {a, Sym(2304, 1)} == {a} and Sym(0, 1) == 0 and N != 1
    with pytest.raises(TypeError):
        sym(1.5)


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


def _blocked_in(tid: int) -> int | None:
    """The system call thread `tid` of this process is blocked in (None while it runs)."""
    with open(f"/proc/self/task/{tid}/syscall") as f:
        word = f.read().split()[0]
    return None if word == "running" else int(word)


def test_ready_word_blocking_wait_burns_no_core():
    """A waiter whose word is not ready sleeps in the kernel (a futex on the word), not in a
    spin: the waiting thread is seen blocked in futex(2), and a store wakes it with the value."""
    arena = Arena.create(1 << 16)
    try:
        words = ReadyWords(arena.buf[:64])
        got, tid = [], []

        def waiter():
            tid.append(threading.get_native_id())
            got.append(words.wait(2, 7))
        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        while not tid:
            pass
        seen, deadline = set(), time.monotonic() + 60
        while _SYS_FUTEX not in seen and time.monotonic() < deadline:   # a spinning waiter never
            seen.add(_blocked_in(tid[0]))                              # blocks
            time.sleep(0.001)
        assert _SYS_FUTEX in seen, f"the waiter never blocked in futex(2): {seen}"
        assert t.is_alive() and not got        # still waiting: nothing stored yet
        words.store(2, 7)
        t.join(30)
        assert got == [True]
        assert not words.wait(3, 1, timeout_s=0.05)           # a word nobody stores: a timeout
    finally:
        arena.unlink()


def test_predicted_sleep_learns_the_wait_and_each_wait_ends_with_its_word():
    """HeteroLLM §4.2: the predictor keeps an exponential average of the producer's time per
    site and sleeps `fraction` of it; a site whose waits are too short to sleep is never slept;
    each wait ends with the word stored, whatever was predicted."""
    pred = SleepPredictor(fraction=0.8, alpha=0.5)
    for waited in (0.02, 0.02, 0.04):
        pred.observe("site", waited)
    assert abs(pred.expected["site"] - 0.03) < 1e-12          # 0.02, 0.02, then halfway to 0.04
    assert abs(pred.sleep_s("site") - 0.8 * 0.03) < 1e-12
    pred.observe("short", 1e-5)
    assert pred.sleep_s("short") == 0.0 and pred.sleep_s("never seen") == 0.0
    arena = Arena.create(1 << 16)
    try:
        words = ReadyWords(arena.buf[:64])
        for step in range(1, 5):
            threading.Timer(0.02, lambda v=step: words.store(2, v)).start()
            assert pred.wait(words, "site", 2, step, timeout_s=30)
            assert words.get(2) >= step
        assert "site" in pred.expected and pred.sleep_s("short") == 0.0
        words.store(3, 1)
        assert pred.wait(words, "ready", 3, 1) and pred.expected["ready"] == 0.0   # no wait
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


def test_released_kv_blocks_give_their_pages_back_and_no_neighbours_row(model_config, model_weights):
    """memory/blocks.py trim -> Pool.release_kv: the pages only the released blocks' rows hold go
    back to the OS in every layer's K and V (the segment's allocated bytes shrink), read as
    zeros after; a page shared with a kept block (f16: a block's rows of a layer are 1.5 pages)
    keeps that block's rows."""
    import numpy as np
    from socllm.memory.layout import plan_layout
    lay = plan_layout({"output_norm.weight": model_weights["output_norm.weight"]}, 2, 192,
                      [4096], 32, 64, 1000, max_seqs=2, kv_blocks=40, block_rows=16, kv_dtype="f16")
    per = 16 * 192 * 2                                     # a block's bytes in one layer: 1.5 pages
    assert lay.kv_block_bytes == 4 * per
    arena = Arena.create(lay.size, lay.readonly_bytes)
    try:
        kv = {k: arena.buf[o: o + lay.kv_rows * 192 * 2] for k, o in lay.kv.items()}
        for region in kv.values():
            region[:] = 7                                  # every block written
        fd = os.open(os.path.join(SHM_DIR, arena.name), os.O_RDONLY)
        used = os.fstat(fd).st_blocks
        freed = [3, 4, 5, 6, 10]                           # a run of 4 (6 pages) and one alone
        ranges = lay.kv_pages(freed)
        assert all(off % 4096 == 0 and n % 4096 == 0 for off, n in ranges)
        arena.release(ranges)
        after = os.fstat(fd).st_blocks
        os.close(fd)
        # per layer region: blocks 3..6 are bytes [3 per, 7 per) -> pages 5..9 (5 whole pages,
        # the first and last shared with blocks 2 and 7); block 10 alone: bytes [15, 16.5) pages
        # -> page 15 only
        assert (used - after) * 512 == len(lay.kv) * 6 * 4096
        for region in kv.values():
            kept = np.ones(len(region), bool)
            for lo, hi in ((5, 10), (15, 16)):
                kept[lo * 4096: hi * 4096] = False
            assert (region[~kept] == 0).all() and (region[kept] == 7).all()
            for b in (2, 7, 9, 11):                        # neighbours keep every row
                assert (region[b * per: (b + 1) * per] == 7).all()
    finally:
        arena.unlink()
