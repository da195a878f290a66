"""Decode operator fusion (Transformer-Lite §2.2): a pass over one processor's decode task list.

It rewrites runs of tasks into the fused kernels of actors/gpu/cl/decode.cl and epilogue.cl, so a layer
is 5 launches instead of 15, and it never changes what the step computes:

  rmsnorm -> linears reading it           norm_prep (+ the linears below)
  linear q, k, v + rope(q), rope(k)        qkv_rope   (with one rope_table per step)
  linear gate, up + silu_mul(gate, up)     gate_up_silu
  linear + add(residual, linear)           linear_act(add=1)
  any other linear                         prep + linear_act
  rmsnorm -> lm_head                       norm_prep(natural) + lm_head_act
  moe_linear gate, up + silu_mul           moe_gate_up (over the MoE scratch's prepared row)
  moe_linear down + add(residual, it)      moe_down (moe_linear_act with the residual)
  attention -> linears reading it          attention_split + merge_prep (split-K over keys)

then a launch that only finishes a row (norm_prep, prep, merge_prep) joins the launch before it
that wrote the row, run by its last work-group (_epilogues): a layer is 5 launches.

A row-cut half (graph/partition.py) joins no group: it runs as prep + linear_act over its rows.
A fused task's intermediate outputs are dropped only when no task outside it reads them
(`_readers` over the whole program, so another processor's reads count); a run is fused only if
nothing inside it waits or signals (the group takes its first task's waits and last task's signals).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .program import StepProgram, Task, reads


@dataclass
class Fused:
    op: str                 # a kernel of actors/gpu/cl/decode.cl
    args: dict              # refs and sizes, like Task.args
    waits: list = field(default_factory=list)
    signals: list = field(default_factory=list)
    seqs: tuple = ()        # the tasks it replaces
    layer: int = -1


def _readers(prog: StepProgram) -> dict:
    """task seq -> seqs of the tasks that read its output before it is overwritten."""
    last, readers = {}, {}
    for t in prog.ordered():
        for ref in reads(t):
            if ref[1] in last:
                readers[last[ref[1]]].add(t.seq)
        last[t.args["out"][1]] = t.seq
        readers[t.seq] = set()
    return readers


def _joinable(run: list) -> bool:
    return all(not t.waits for t in run[1:]) and all(not t.signals for t in run[:-1])


def _fusable(t: Task) -> bool:
    """A linear the fused kernels take: not one with a bias, nor one over float weights (those
    run op by op, reading x from its slot)."""
    return t.op == "linear" and "b" not in t.args and t.args["w"][0] != "wt"


def _linears(tasks: list, i: int, x) -> int:
    """End of the run of consecutive fusable linears from i that all read x."""
    while i < len(tasks) and _fusable(tasks[i]) and tasks[i].args["x"] == x:
        i += 1
    return i


def _one_format(linears: list) -> bool:
    """One launch reads weights of one format (a program is built per format)."""
    return len({t.args["w"][:2] if t.args["w"][0] == "wq" else t.args["w"][0] for t in linears}) == 1


def _only_read_by(readers, t: Task, u: Task) -> bool:
    return readers[t.seq] == {u.seq}


def _qkv_rope(group, rest, readers):
    if any(t.rows for t in group) or len(group) != 3 or len(rest) < 2 or any(r.op != "rope" for r in rest[:2]):
        return None
    if any(r.args.get("neox") for r in rest[:2]):       # qkv_rope rotates NORM pairs only
        return None
    by_out = {t.args["out"]: t for t in group}
    ropes = rest[:2]
    if {r.args["x"] for r in ropes} - set(by_out):
        return None
    (rq, lq), (rk, lk) = sorted(((r, by_out[r.args["x"]]) for r in ropes),
                                key=lambda p: -p[1].args["M"])           # q has the most rows
    lv = next(t for t in group if t is not lq and t is not lk)
    if not (_only_read_by(readers, lq, rq) and _only_read_by(readers, lk, rk)):
        return None
    if lk.args["M"] != lv.args["M"] or not _joinable(group + ropes) or not _one_format(group):
        return None
    return Fused("qkv_rope", {"x": lq.args["x"], "wq": lq.args["w"], "wk": lk.args["w"],
                              "wv": lv.args["w"], "q_out": rq.args["out"], "k_out": rk.args["out"],
                              "v_out": lv.args["out"], "K": lq.args["K"], "Mq": lq.args["M"],
                              "Mk": lk.args["M"], "head_dim": rq.args["head_dim"],
                              "theta": rq.args["theta"], **({"f": rq.args["f"]} if "f" in rq.args else {}),
                              **({"rows": lv.args["rows"]} if "rows" in lv.args else {})},
                 [], ropes[-1].signals, tuple(t.seq for t in group + ropes), lq.layer)


def _gate_up(group, rest, readers):
    if any(t.rows for t in group) or len(group) != 2 or not rest or rest[0].op != "silu_mul":
        return None
    s = rest[0]
    by_out = {t.args["out"]: t for t in group}
    g, u = by_out.get(s.args["g"]), by_out.get(s.args["u"])
    if g is None or u is None or g is u or not _joinable(group + [s]) or not _one_format([g, u]):
        return None
    if not (_only_read_by(readers, g, s) and _only_read_by(readers, u, s)):
        return None
    return Fused("gate_up_silu", {"x": g.args["x"], "wg": g.args["w"], "wu": u.args["w"],
                                  "out": s.args["out"], "K": g.args["K"], "M": g.args["M"]},
                 [], s.signals, (g.seq, u.seq, s.seq), g.layer)


def _linear(t, rest, readers):
    a = {"x": t.args["x"], "w": t.args["w"], "out": t.args["out"], "res": None,
         "K": t.args["K"], "M": t.args["M"], **({"ld": t.args["ld"]} if t.rows else {}),
         **({"rows": t.args["rows"]} if "rows" in t.args else {})}
    nxt = rest[0] if rest else None
    if (nxt is not None and not t.rows and nxt.op == "add" and _only_read_by(readers, t, nxt)
            and _joinable([t, nxt]) and t.args["out"][0] == "a"):
        other = nxt.args["b"] if nxt.args["a"] == t.args["out"] else nxt.args["a"]
        if other != t.args["out"]:
            a.update(out=nxt.args["out"], res=other)
            return Fused("linear_act", a, [], nxt.signals, (t.seq, nxt.seq), t.layer)
    return Fused("linear_act", a, [], t.signals, (t.seq,), t.layer)


def _moe_gate_up(run: list, readers):
    """moe_linear gate, moe_linear up (same rows, route, sizes and weight format) and the gated
    product reading only them -> moe_gate_up (cl/moe.cl)."""
    if len(run) < 3 or [t.op for t in run[:2]] != ["moe_linear"] * 2 or run[2].op not in ("silu_mul", "gelu_mul"):
        return None
    a, b, mul = run[:3]
    by_out = {a.args["out"]: a, b.args["out"]: b}
    g, u = by_out.get(mul.args["g"]), by_out.get(mul.args["u"])
    same = ("x", "route", "K", "M", "E", "k", "per_slot", "combine")
    if g is None or u is None or g is u or any(g.args[n] != u.args[n] for n in same) or g.args["per_slot"] \
            or g.args["combine"] or g.args["w"][0] == "wt" or not _one_format([g, u]) \
            or not _joinable(run[:3]) or not (_only_read_by(readers, g, mul) and _only_read_by(readers, u, mul)):
        return None
    return Fused("moe_gate_up", {"x": g.args["x"], "route": g.args["route"], "wg": g.args["w"],
                                 "wu": u.args["w"], "out": mul.args["out"], "K": g.args["K"],
                                 "M": g.args["M"], "k": g.args["k"], "gelu": int(mul.op == "gelu_mul"),
                                 "tasks": [(t.op, t.args) for t in run[:3]]},
                 a.waits, mul.signals, tuple(t.seq for t in run[:3]), a.layer)


def _moe_down(run: list, readers):
    """moe_linear down (combine) and the residual add reading only it -> moe_linear with res."""
    t, nxt = run[0], run[1] if len(run) > 1 else None
    if nxt is None or nxt.op != "add" or not t.args["combine"] or t.args["w"][0] == "wt" \
            or not _only_read_by(readers, t, nxt) or not _joinable([t, nxt]):
        return None
    other = nxt.args["b"] if nxt.args["a"] == t.args["out"] else nxt.args["a"]
    if other == t.args["out"]:
        return None
    return Fused("moe_down", {**t.args, "out": nxt.args["out"], "res": other,
                              "tasks": [(u.op, u.args) for u in (t, nxt)]},
                 t.waits, nxt.signals, (t.seq, nxt.seq), t.layer)


def fuse_decode(prog: StepProgram, proc: str) -> list:
    """proc's decode tasks -> a list of Task (run as they are) and Fused (decode.cl kernels)."""
    return _epilogues(_fuse(_no_saliency(prog, proc), proc))


def _no_saliency(prog: StepProgram, proc: str) -> StepProgram:
    """A decode step's routes without their saliency (the L2 norm of the attention output, which
    only a prefill chunk's grouped experts drop rows by): the o projection then has one reader,
    its residual add, and the two fuse (a MoE layer: 2 launches fewer)."""
    tasks = prog.tasks.get(proc, [])
    if not any(t.op == "moe_route" and "sal" in t.args for t in tasks):
        return prog
    tasks = [dataclasses.replace(t, args={k: v for k, v in t.args.items() if k != "sal"})
             if t.op == "moe_route" else t for t in tasks]
    return dataclasses.replace(prog, tasks={**prog.tasks, proc: tasks})


# (launch, epilogue launch) -> the launch with the epilogue in its last work-group
_EPILOGUE = {("linear_act", "norm_prep"): "linear_act_norm",
             ("gate_up_silu", "prep"): "gate_up_silu_prep",
             ("attention_split", "merge_prep"): "attention_merge"}


def _epilogues(units: list) -> list:
    out = []
    for u in units:
        prev = out[-1] if out else None
        op = _EPILOGUE.get((prev.op, u.op)) if isinstance(prev, Fused) and isinstance(u, Fused) else None
        reads_prev = op is not None and u.args.get("x", prev.args["out"]) == prev.args["out"]
        # a row-cut half's epilogue would see part of a row
        if reads_prev and "ld" not in prev.args and not u.waits and not prev.signals and prev.args["out"][0] == "a":
            args = dict(prev.args)
            if op == "linear_act_norm":
                args.update(norm_w=u.args["w"], norm_out=u.args["out"], eps=u.args["eps"],
                            store=u.args["store"], natural=u.args.get("natural", False))
            elif op == "attention_merge":
                args.update(store=u.args["store"])
            out[-1] = Fused(op, args, prev.waits, u.signals, prev.seqs + u.seqs, prev.layer)
            continue
        out.append(u)
    return out


def _fuse(prog: StepProgram, proc: str) -> list:
    tasks = prog.tasks.get(proc, [])
    readers = _readers(prog)
    out, i, prepared, table = [], 0, None, None
    while i < len(tasks):
        t = tasks[i]
        run = tasks[i + 1:_linears(tasks, i + 1, t.args["out"])]   # linears reading t's output
        nxt = tasks[i + 1] if i + 1 < len(tasks) else None
        # a MoE layer's norm (read by its router, a float linear, and its experts): a norm_prep
        # that stores its row, so that it joins the o projection's launch as its epilogue
        router = t.op == "rmsnorm" and not run and t.args.get("heads", 1) == 1 \
            and [u.op for u in tasks[i + 1:i + 3]] == ["linear", "moe_route"] \
            and nxt.args["x"] == t.args["out"] and nxt.args["w"][0] == "wt" and not nxt.waits
        if t.op == "rmsnorm" and (run or router) and not t.signals and not (run and run[0].waits):
            store = bool(readers[t.seq] - {u.seq for u in run})
            out.append(Fused("norm_prep", {**t.args, "store": store}, t.waits, [], (t.seq,), t.layer))
            prepared, i = t.args["out"], i + 1
            continue
        if t.op == "rmsnorm" and nxt is not None and nxt.op == "lm_head" \
                and nxt.args["table"][0] == "w8" \
                and nxt.args["x"] == t.args["out"] and _joinable([t, nxt]):
            # the final hidden state is stored as well: speculative decoding's draft heads read
            # it from the pool (policies/drafting.py)
            out.append(Fused("norm_prep", {**t.args, "store": True, "natural": True}, t.waits, [],
                             (t.seq,), t.layer))
            out.append(Fused("lm_head_act", dict(nxt.args), [], nxt.signals, (nxt.seq,), nxt.layer))
            prepared, i = None, i + 2
            continue
        if t.op == "attention" and run and _joinable([t, nxt]) and t.args["out"][0] == "a":
            store = bool(readers[t.seq] - {u.seq for u in run})
            out.append(Fused("attention_split", dict(t.args), t.waits, [], (t.seq,), t.layer))
            out.append(Fused("merge_prep", {"out": t.args["out"], "heads": t.args["heads"],
                                            "head_dim": t.args["head_dim"], "store": store},
                             [], [], (), t.layer))
            prepared, i = t.args["out"], i + 1
            continue
        if _fusable(t):
            if prepared != t.args["x"] or t.waits:   # a prep carries the linear's waits
                out.append(Fused("prep", {"x": t.args["x"], "K": t.args["K"]}, t.waits, [], (), t.layer))
                prepared = t.args["x"]
            j = _linears(tasks, i, t.args["x"])
            f = _qkv_rope(tasks[i:j], tasks[j:j + 2], readers)
            if f is not None:
                key = (f.args["head_dim"], f.args["theta"], f.args.get("f"))
                if table != key:       # one cos/sin table serves every layer of the same rope
                    out.append(Fused("rope_table", {"head_dim": f.args["head_dim"],
                                                    "theta": f.args["theta"],
                                                    **({"f": f.args["f"]} if "f" in f.args else {})}))
                    table = key
                out.append(f)
                i = j + 2
                continue
            f = _gate_up(tasks[i:j], tasks[j:j + 1], readers)
            if f is not None:
                out.append(f)
                i = j + 1
                continue
            f = _linear(t, tasks[i + 1:i + 2], readers)
            if t.args["out"][1] == prepared[1] or f.args["out"][1] == prepared[1]:
                prepared = None
            out.append(f)
            i += len(f.seqs)
            continue
        f = _moe_gate_up(tasks[i:i + 3], readers) if t.op == "moe_linear" else None
        f = f or (_moe_down(tasks[i:i + 2], readers) if t.op == "moe_linear" else None)
        out.append(f or t)
        prepared = None
        i += len(f.seqs) if f else 1
    return out
