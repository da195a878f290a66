"""Where everything lives in the arena. Offsets are bytes from the arena's start.

  [ weights (read-only, written once) | KV cache | activation slots | io | control | ready words ]

  weights   planar quantized matrices, float matrices and f32 vectors (models/quant.py)
  kv        [n_layers, 2, kv_rows, kv_cols] f32 (or f16: kv_dtype), kv_rows = context + largest bucket (a padded
            NPU chunk writes up to a bucket of rows past the real ones) or, paged, kv_blocks
            blocks of block_rows rows (memory/blocks.py), whichever is more
  slots     reusable activation slots, sized for `max_rows` rows (graph/liveness.py); with a
            double buffer, a second set for a suspended prefill chunk (Agent.xpu §4.4 ①)
  io        ids int32 [max_rows], logits f32 [max_seqs, vocab], row metadata and block tables of a serving step, GPU decode scratch
  control   int64 fields of the current step (CTL_*)
  words     u32 ready words: go and done word per processor, then one per tensor location
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from socllm.models.quant import W4_FORMATS

from .arena import ALIGN, align

PROCESSORS = ("cpu", "gpu", "npu")
# span_lo, span_hi: the stages of the program this step runs (graph/program.py stage_of; 0, 0:
# all): a prefill chunk in its own activation buffer runs a few layers at a time
CTL_FIELDS = ("epoch", "program", "n", "pos0", "precision", "error", "span_lo", "span_hi")
_CTL = {name: i for i, name in enumerate(CTL_FIELDS)}
W_GO, W_DONE, W_ERROR, W_FIRST_LOC = 0, 4, 9, 16


KV_DTYPES = {"f32": 4, "f16": 2}     # a KV element's type -> its bytes
ATT_SPLITS = 16     # key splits of the GPU's decode attention (ATT_S of actors/gpu/cl/decode.cl)


@dataclass
class PoolLayout:
    weights: dict = field(default_factory=dict)    # name -> ref tuple ("w4", ...) etc.
    readonly_bytes: int = 0
    kv: dict = field(default_factory=dict)         # "kcache.3" -> offset
    kv_rows: int = 0
    kv_cols: int = 0
    kv_dtype: str = "f32"                          # "f16": half the bytes (paged programs only)
    kv_blocks: int = 0                             # paged: kv_rows // block_rows blocks
    block_rows: int = 16
    max_blocks: int = 0                            # a block table's length (context's blocks)
    max_seqs: int = 1                              # sequences a serving step may hold
    slots: list = field(default_factory=list)      # slot id -> offset
    slot_bytes: list = field(default_factory=list)
    io: dict = field(default_factory=dict)         # "ids" | "logits" | "pos" | ... -> offset
    max_rows: int = 0
    context: int = 0
    vocab: int = 0
    ctl: int = 0
    words: int = 0
    n_words: int = 0
    locations: dict = field(default_factory=dict)  # location key -> ready word index
    done_words: dict = field(default_factory=dict)  # processor -> done(processor), as data
    # the double activation buffer (Agent.xpu §4.4 ①): slot id -> offset of a second set of slots
    # and io name -> offset of a second ids / pos / rows / seq / rope_rows, for double_rows rows;
    # a prefill chunk there keeps its activations while other steps run (empty: none)
    double: dict = field(default_factory=dict)
    double_rows: int = 0
    # a decode step's final-normed hidden rows (the LM head's input, which draft heads read):
    # [offset, bytes] in the pool (a discrete GPU copies them down with the logits); empty: none
    hidden: list = field(default_factory=list)
    size: int = 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of one KV element."""
        return KV_DTYPES[self.kv_dtype]

    def word(self, loc: str) -> int:
        return self.locations[loc]

    @staticmethod
    def go(proc: str) -> int:
        return W_GO + PROCESSORS.index(proc)

    @staticmethod
    def done(proc: str) -> int:
        return W_DONE + PROCESSORS.index(proc)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block: its rows of every layer's K and V."""
        return len(self.kv) * self.block_rows * self.kv_cols * self.kv_bytes

    def kv_pages(self, blocks: list) -> list:
        """The whole pages that only these KV blocks' rows occupy, in every layer's K and V:
        [(offset, bytes)], page-aligned (a page shared with a block not among them is left out:
        at f16 a block's rows of one layer are 1.5 pages)."""
        per = self.block_rows * self.kv_cols * self.kv_bytes
        runs, out = [], []
        for b in sorted(blocks):
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
        for base in self.kv.values():
            for lo, hi in runs:
                start = -(-(base + lo * per) // ALIGN) * ALIGN
                end = (base + hi * per) // ALIGN * ALIGN
                if end > start:
                    out.append((start, end - start))
        return out

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "PoolLayout":
        d = dict(d)
        d["weights"] = {k: tuple(v) for k, v in d["weights"].items()}
        return cls(**d)


def plan_layout(weights: dict, n_layers: int, kv_cols: int, slot_bytes: list, max_rows: int,
                context: int, vocab: int, max_k: int = 4096, max_seqs: int = 1,
                kv_blocks: int = 0, block_rows: int = 16, kv_dtype: str = "f32",
                double: tuple = ()) -> PoolLayout:
    """weights: name -> planar dict of arrays (quantized) or an f32 array. max_seqs sequences of
    a serving step read kv_blocks blocks of block_rows rows (memory/blocks.py) through their
    block tables; the KV rows also hold one contiguous sequence of the context (the one-shot
    engine's programs). kv_dtype: the KV elements' type (KV_DTYPES). double: (rows, slot_bytes) of
    the double activation buffer (empty: none): the service's prefill chunk."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    lay = PoolLayout(max_rows=max_rows, context=context, vocab=vocab, kv_cols=kv_cols,
                     kv_dtype=kv_dtype, max_seqs=max_seqs, block_rows=block_rows,
                     max_blocks=-(-context // block_rows))
    off = 0

    def take(nbytes, a=64):
        nonlocal off
        start = align(off, a)
        off = start + nbytes
        return start

    for name, w in weights.items():
        lay.weights[name] = weight_ref(w, [take(a.nbytes) for a in weight_arrays(w)])
    lay.readonly_bytes = align(off, ALIGN)
    off = lay.readonly_bytes
    lay.kv_rows = max(context + max_rows, kv_blocks * block_rows)
    lay.kv_blocks = lay.kv_rows // block_rows
    for i in range(n_layers):
        for which in ("kcache", "vcache"):
            lay.kv[f"{which}.{i}"] = take(lay.kv_rows * kv_cols * lay.kv_bytes, ALIGN)
    lay.slot_bytes = list(slot_bytes)
    lay.slots = [take(b, ALIGN) for b in slot_bytes]
    # act: the GPU's prepared activation row for its decode GEMVs (values f32 or int8, block
    # scales, block sums; actors/gpu/cl/decode.cl) for the widest matmul input, rewritten per GEMV
    # input; rope: the per-step RoPE cos/sin table (head_dim <= 1024); att: split-K decode
    # attention's partials, ATT_SPLITS x heads x (head_dim + 2) f32 (heads x head_dim <= max_k,
    # head_dim >= 16)
    act = 4 * max_k + 8 * max_k // 32
    # pos, rows, seq: a serving step's row metadata; tmask: a decode step's draft tree rows;
    # btab: its block tables (graph/build.py)
    # act_rows: a decode batch's or a prefill chunk's rows prepared for its linears, in int16 (q16)
    # or int8 (q8), padded to whole tiles of 16 rows (actors/gpu/cl/batch.cl, paged.cl);
    # rope: the fused decode row's cos / sin and its kernels' counters; rope_rows: a serving
    # step's cos / sin per row
    lay.io = {"ids": take(max_rows * 4), "logits": take(max_seqs * vocab * 4),
              "pos": take(max_rows * 4), "rows": take(max_rows * 4),
              "seq": take(max_rows * 4), "tmask": take(max_rows * 16),
              "btab": take(max_seqs * lay.max_blocks * 4),
              "act_rows": take(align(max(max_seqs, max_rows), 16)
                               * align(2 * max_k + 8 * max_k // 32, 64), 64),
              "act": take(act), "rope": take(4 * 1024), "rope_rows": take(4 * max_rows * kv_cols),
              "att": take(ATT_SPLITS * 4 * (max_k + max_k // 8))}
    if double:
        rows, dbytes = double
        if not 0 < rows <= max_rows or len(dbytes) != len(slot_bytes):
            raise ValueError(f"a double buffer of {rows} rows and {len(dbytes)} slots")
        lay.double_rows = rows
        lay.double = {"slots": [take(b, ALIGN) for b in dbytes],
                      **{k: take(rows * 4) for k in ("ids", "pos", "rows", "seq")},
                      "rope_rows": take(4 * rows * kv_cols)}
    lay.ctl = take(len(CTL_FIELDS) * 8)
    locs = [f"slot.{i}" for i in range(len(slot_bytes))] + list(lay.kv) + ["ids", "logits"]
    lay.locations = {k: W_FIRST_LOC + i for i, k in enumerate(locs)}
    lay.done_words = {p: lay.done(p) for p in PROCESSORS}
    lay.n_words = W_FIRST_LOC + len(locs)
    lay.words = take(lay.n_words * 4)
    lay.size = align(off, ALIGN)
    return lay


def weight_arrays(w) -> list:
    """The arrays of one weight (models/llama.py load_weights), in the order its ref lists them."""
    if isinstance(w, np.ndarray):
        return [w]
    if "w" in w:
        return [w["w"]]
    if "dm" in w:
        return [w["qs"], w["dm"]] + ([w["qh"]] if "qh" in w else [])
    return [w["qs"], w["d"], w["m"]] if "m" in w else [w["qs"], w["d"]]


def weight_ref(w, offs: list) -> tuple:
    """A weight's ref (graph/program.py) from its arrays' offsets."""
    if isinstance(w, np.ndarray):
        return ("wf", *offs)
    fmt = w.get("fmt")
    if fmt in W4_FORMATS or (fmt is None and "m" in w):
        return ("w4", *offs)
    if fmt is None:
        return ("w8", *offs)
    if "w" in w:
        return ("wt", fmt, *offs)
    return ("wq", fmt, *offs, *[0] * (3 - len(offs)))      # (qs, dm, qh): qh 0 for 4-bit codes


def write_weights(buf: np.ndarray, lay: PoolLayout, weights: dict):
    """Copy the weights into the arena once (the creator does this before any actor attaches)."""
    for name, ref in lay.weights.items():
        offs = [v for v in ref[1:] if not isinstance(v, str)]
        for off, arr in zip(offs, weight_arrays(weights[name])):
            raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            buf[off: off + raw.size] = raw


class Control:
    """The step's control block: a few int64 fields the control actor writes before a step."""

    def __init__(self, buf: np.ndarray, lay: PoolLayout):
        self.f = buf[lay.ctl: lay.ctl + len(CTL_FIELDS) * 8].view(np.int64)

    def __getitem__(self, name):
        return int(self.f[_CTL[name]])

    def __setitem__(self, name, value):
        self.f[_CTL[name]] = value
