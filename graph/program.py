"""Step programs: what the planner installs in a processor actor (DESIGN.md §3).

A StepProgram is, for one phase and one shape bucket, one ordered task list per processor. A task
names a kernel and where its tensors live in the pool, as byte offsets into the arena:

  ("a", off)              activation / io rows, contiguous, row-major, f32 (ids: int32)
  ("kv", off)             base of one layer's K or V cache [L_cap, kv_heads*head_dim] f32; as an
                          output, the kernel writes rows pos0 .. pos0+N (in place, no concatenation)
  ("w4", qs, d, m)        a Q4_1 / Q4_0 weight [M, K] in the planar layout of models/quant.py
  ("wq", fmt, qs, dm, qh) a weight [M, K] of another block format fmt (models/quant.py FORMATS:
                          low nibbles, (d, m) pairs, high bits; qh 0 for 4-bit codes)
  ("wt", fmt, off)        an F32 / F16 / BF16 weight [M, K] as in the file
  ("w8", qs, d)           a Q8_0 table [V, D] in natural order (the token embedding)
  ("wf", off)             an f32 vector weight

Static sizes (D, K, M, heads, eps, theta, ...) are task attributes; the two runtime values every
kernel gets are N (rows in this step) and pos0 (tokens already in the KV cache).

Synchronization is data, not calls: `waits` lists (word, value) pairs the task waits for
(word >= value) before it runs; `signals` lists (word, value) pairs it stores after it finished.
Values are relative to the step's epoch base (see memory/ready.py). `rows` is the output row range
of a split op (HeteroLLM §4.1 row-cut, graph/partition.py): None means the whole output. A split
linear's args are those of a smaller linear (`cut_rows`): M = hi - lo rows of the weight from row
lo, written from column lo of an output whose rows are `ld` (the uncut M) wide.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

WEIGHT_REFS = ("w4", "wq", "wt", "w8", "wf")
OPS = ("embed", "rmsnorm", "linear", "rope", "attention", "silu_mul", "gelu_mul", "add", "lm_head",
       "moe_route", "moe_linear", "attn_merge")


@dataclass
class Task:
    op: str
    args: dict              # name -> int | float | ref tuple (see module doc)
    waits: list = field(default_factory=list)    # [(word, value)]
    signals: list = field(default_factory=list)  # [(word, value)]
    rows: tuple | None = None                     # (lo, hi) output rows of a row-cut, else None
    layer: int = -1                               # for profiles and readable dumps
    seq: int = 0                                  # position in the step's global order (1-based)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}")


@dataclass
class StepProgram:
    phase: str              # "prefill" | "decode"
    bucket: int             # static row count the program was planned for (NPU graphs use it)
    tasks: dict             # processor name -> [Task]
    final: dict = field(default_factory=dict)     # processor -> seq of its last task
    buffer: int = 0         # activation buffer: 1, the pool's second one (memory/layout.py double)

    def to_bytes(self) -> bytes:
        def task(t: Task):
            return [t.op, {k: list(v) if isinstance(v, tuple) else v for k, v in t.args.items()},
                    t.waits, t.signals, list(t.rows) if t.rows else None, t.layer, t.seq]
        return msgpack.packb({"phase": self.phase, "bucket": self.bucket,
                              "tasks": {p: [task(t) for t in ts] for p, ts in self.tasks.items()},
                              "final": self.final, "buffer": self.buffer})

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepProgram":
        d = msgpack.unpackb(data, strict_map_key=False)

        def task(op, args, waits, signals, rows, layer, seq):
            args = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
            return Task(op, args, [tuple(w) for w in waits], [tuple(s) for s in signals],
                        tuple(rows) if rows else None, layer, seq)
        return cls(d["phase"], d["bucket"], {p: [task(*t) for t in ts] for p, ts in d["tasks"].items()},
                   d["final"], d.get("buffer", 0))

    def ordered(self) -> list:
        """Every processor's tasks in the step's global order."""
        return sorted((t for ts in self.tasks.values() for t in ts), key=lambda t: t.seq)


def stage_of(tasks: list) -> list:
    """Each task's stage: 0 before the first layer (the embedding), layer + 1 inside a layer,
    the last layer + 2 after it (final norm, lm-head). A step may run a span of stages at a time
    (the control block's span_lo, span_hi): only a layer's input is live between stages."""
    out, top = [], 0
    for t in tasks:
        top = max(top, t.layer + 1)
        out.append(t.layer + 1 if t.layer >= 0 else (top + 1 if top else 0))
    return out


def cut_rows(args: dict, lo: int, hi: int) -> dict:
    """A linear's args -> those of its rows [lo, hi): the weight refs (and a bias) move to row lo
    (models/quant.py's planar rows: K/32 blocks of codes, K/group scales and minimums), the
    output to column lo of rows ld wide."""
    from socllm.models.quant import FORMATS
    K, M = args["K"], args["M"]
    if not 0 <= lo < hi <= M:
        raise ValueError(f"rows [{lo}, {hi}) are not inside the {M} rows of the weight")
    w = args["w"]
    if w[0] == "w4":
        sb = K // 32 * 2                                   # bytes of d (and of m) a row
        moved = (w[1] + lo * K // 2, w[2] + lo * sb, w[3] + lo * sb)
    elif w[0] == "wq":
        f = FORMATS[w[1]]
        dm = K // f.group * 2 * (2 if f.scale == "f16" else 4)
        moved = (w[2] + lo * K // 2, w[3] + lo * dm, w[4] + lo * K // 32 * f.hb if w[4] else 0)
    else:
        raise ValueError(f"row-cut takes block-format weights, not {w[0]!r}")
    out = args["out"]
    cut = {**args, "M": hi - lo, "ld": M, "w": (*w[:len(w) - 3], *moved),
           "out": (out[0], out[1] + lo * 4) + tuple(out[2:])}
    if "b" in args:
        cut["b"] = (args["b"][0], args["b"][1] + lo * 4)
    return cut


def reads(t: Task) -> list:
    """Activation / KV / io refs a task reads (weights are never hazards)."""
    return [v for k, v in t.args.items() if k != "out" and isinstance(v, tuple) and v[0] not in WEIGHT_REFS]


def segment_live_out(prog: StepProgram, seqs: set) -> set:
    """Offsets written by the tasks `seqs` (one fused segment) whose last value there is read by a
    task outside the segment before being overwritten; KV and io outputs always count. A processor
    that fuses tasks into one graph must write exactly these back to the pool."""
    order = prog.ordered()
    last_writer: dict = {}
    live = set()
    for t in order:
        for ref in reads(t):
            w = last_writer.get(ref[1])
            if w is not None and w in seqs and t.seq not in seqs:
                live.add(ref[1])
        out = t.args["out"]
        last_writer[out[1]] = t.seq
        # a row-cut half writes part of a tensor someone else completes: always written back
        if t.seq in seqs and (out[0] == "kv" or t.op == "lm_head" or t.rows):
            live.add(out[1])
    return live
