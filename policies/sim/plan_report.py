"""What the solver chooses for one step, op by op (HeteroLLM §4.3): each op's predicted time on
each processor, its best row-cut (policies/rowcut.py's objective), the step's sequence-length cut
(policies/placement.seq_parts), and the strategy kept. Pure: the costs come from a function
(policies/predict.Predictor for this device, policies/soc for a simulated one).

The solver never keeps a strategy its own predictions make slower than the best single
processor: the per-op mix (each op where it is fastest, or row-cut, paying a synchronization at
every change of processor) and the sequence-length cut are kept only when they beat both.
"""
from __future__ import annotations

from socllm.graph.partition import ALIGN, DOMINANT
from socllm.graph.program import cut_rows

from ..buckets import prefill_chunks
from ..placement import seq_parts

PROCS = ("gpu", "npu")


def _static(cost, phase: str):
    """The cost function under NPU rules: a prefill step of n rows runs on the NPU as static
    chunks (policies/buckets.prefill_chunks, each padded to its bucket), one after the other."""
    def at(p, op, args, n, pos0):
        if p != "npu" or phase != "prefill":
            return cost(p, op, args, n, pos0)
        total, lo = 0.0, 0
        for rows, bucket in prefill_chunks(n):
            total += cost(p, op, args, bucket, pos0 + lo)
            lo += rows
        return total
    return at


def _cuttable(t) -> bool:
    """A linear whose output is an activation (V, which writes the KV cache, stays whole)."""
    return t.op == "linear" and t.args["out"][0] == "a" and t.args["M"] >= 2 * ALIGN


def _row_cut(cost, t, phase: str, n: int, pos0: int, sync_s: float, contention: float):
    """(rows on the other processor, predicted seconds) of the best proper cut of a linear."""
    dom = DOMINANT[phase]
    other = "npu" if dom == "gpu" else "gpu"
    M, best = t.args["M"], None
    for r in range(ALIGN, M, ALIGN):
        s = contention * max(cost(dom, t.op, cut_rows(t.args, 0, M - r), n, pos0),
                             cost(other, t.op, cut_rows(t.args, M - r, M), n, pos0)) + sync_s
        if best is None or s < best[1]:
            best = (r, s)
    return best


def plan_step(cost, tasks: list, phase: str, prompt_len: int, sync_s: float,
              contention: float = 1.0) -> dict:
    """tasks: one processor's program of the step (every op, in order). prefill: the prompt of
    prompt_len rows as one step; decode: one row after prompt_len. contention (>= 1): how much
    slower two parts run at once than the slower alone (processors sharing cores or memory
    bandwidth; the profile measures it, rowcut.contention's idea). -> the plan (module doc)."""
    n, pos0 = (prompt_len, 0) if phase == "prefill" else (1, prompt_len)
    cost = _static(cost, phase)
    ops, single = [], {p: 0.0 for p in PROCS}
    mixed, prev = 0.0, None
    seq = seq_parts(prompt_len) if phase == "prefill" else []
    seq_total = 0.0
    for t in tasks:
        alt = {p: cost(p, t.op, t.args, n, pos0) for p in PROCS}
        for p in PROCS:
            single[p] += alt[p]
        best = min(PROCS, key=alt.get)
        entry = {"op": t.op, "layer": t.layer, "strategy": best, "parts": [{"processor": best}],
                 "predicted_s": alt[best], "alternatives": dict(alt)}
        if _cuttable(t):
            r, s = _row_cut(cost, t, phase, n, pos0, sync_s, contention)
            entry["alternatives"]["row-cut"] = s
            if s < entry["predicted_s"]:
                dom = DOMINANT[phase]
                other = "npu" if dom == "gpu" else "gpu"
                M = t.args["M"]
                entry.update(strategy="row-cut", predicted_s=s, parts=[
                    {"processor": dom, "rows": [0, M - r]}, {"processor": other, "rows": [M - r, M]}])
        # a row-cut's own sync joins its halves on the dominant processor, which runs on
        on = entry["parts"][0]["processor"] if entry["strategy"] != "row-cut" else DOMINANT[phase]
        mixed += entry["predicted_s"] + (sync_s if prev is not None and on != prev else 0.0)
        prev = on
        if len({p for *_, p in seq}) > 1:        # the parts at once: NPU chunks in turn, GPU margin
            npu = sum(cost("npu", t.op, t.args, hi - lo, pos0 + lo) for lo, hi, p in seq if p == "npu")
            gpu = sum(cost("gpu", t.op, t.args, hi - lo, pos0 + lo) for lo, hi, p in seq if p == "gpu")
            s = contention * max(npu, gpu) + (sync_s if t.op == "attention" else 0.0)
            entry["alternatives"]["seq-cut"] = s
            seq_total += s
        ops.append(entry)
    totals = {**{f"{p} alone": s for p, s in single.items()}, "per op": mixed}
    if seq_total:
        totals["seq-cut"] = seq_total
    chosen = min(totals, key=totals.get)
    if chosen.endswith(" alone"):
        proc = chosen.split()[0]
        for e in ops:
            e.update(strategy=proc, parts=[{"processor": proc}], predicted_s=e["alternatives"][proc])
    elif chosen == "seq-cut":
        for e in ops:
            e.update(strategy="seq-cut", predicted_s=e["alternatives"]["seq-cut"],
                     parts=[{"processor": p, "seq": [lo, hi]} for lo, hi, p in seq])
    return {"phase": phase, "prompt_len": prompt_len, "strategy": chosen, "contention": contention,
            "sync_s": sync_s, "ops": ops,
            "predicted_total_s": totals[chosen], "alternatives_total_s": totals}
