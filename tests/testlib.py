"""Plain helpers that several test files share (no fixtures: those are in conftest.py)."""
from __future__ import annotations

import socket

import numpy as np

from socllm.graph.build import build_graph
from socllm.graph.liveness import assign_slots
from socllm.graph.lower import lower
from socllm.graph.partition import DOMINANT, placed, row_cut
from socllm.memory.layout import PROCESSORS
from socllm.policies.placement import placement

PROMPTS = ("The capital of France is",
           "def fibonacci(n):",
           "Once upon a time, there was a little robot who")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def program(model_config, plan, phase, n_layers=2, cut=None):
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


def every_plan_gives_the_oracles_tokens_and_logits(eng, oracle, tol: float):
    """An engine on every processor: each one-processor plan's 8 greedy tokens are the oracle's,
    and so, to tol of their scale, are its teacher-forced logits over them."""
    assert eng.available == {"cpu", "gpu", "npu"}
    ids = eng.encode_prompt("Hello, world! 123")
    want = oracle.greedy(ids, 8)
    ref = oracle.logits_for(ids + want)                     # [len(ids) + 8, vocab]
    for plan in ("cpu", "gpu", "npu"):
        got = eng.generate_ids(ids, plan=plan, precision="f32", max_tokens=8, ignore_eos=True)
        assert got["tokens"] == want, plan
        logits = eng.logits_after(ids + want, plan, "f32")
        err = float(np.abs(logits - ref).max() / np.abs(ref).max())
        assert err <= tol, f"{plan}: logits {err:.2e} of their scale from the oracle's"


def prefill_then_decode(runner, prompts: list, forced: list, steps: int):
    """Each prompt prefilled in chunks of 5 rows (its K/V written through its own block table,
    blocks not in order), then all decoded as one batch for `steps` steps, teacher-forced with
    `forced`, every row at its own position. -> (block tables, per prompt its logits: the
    prefill's last row, then each step's)."""
    br = runner.lay.block_rows
    free = list(np.random.default_rng(0).permutation(runner.lay.kv_blocks))
    tables, got = {}, [[] for _ in prompts]
    for s, ids in enumerate(prompts):
        tables[s] = [int(free.pop()) for _ in range(-(-(len(ids) + len(forced[s])) // br))]
        for lo in range(0, len(ids), 5):
            chunk = ids[lo: lo + 5]
            logits = runner.step([(t, lo + i, s) for i, t in enumerate(chunk)], {s: tables[s]},
                                 all_rows=False)
        got[s].append(logits[0].copy())
    for i in range(steps):
        rows = [(forced[s][i], len(ids) + i, s) for s, ids in enumerate(prompts)]
        logits = runner.step(rows, tables, all_rows=True)
        for s in range(len(prompts)):
            got[s].append(logits[s].copy())
    return tables, got


def sse_events(raws) -> list:
    """Server-sent events (each "event: T\ndata: {...}") as objects, each event line its type."""
    import json
    out = []
    for raw in raws:
        head, data = raw.strip().split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert head == f"event: {obj['type']}"
        out.append(obj)
    return out
