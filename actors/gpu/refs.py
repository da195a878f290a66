"""A step program's tensor refs (graph/program.py) as the OpenCL kernels' arguments: byte offsets
into the arena, the build options of a weight's format, and the alignment the kernels load at."""
from __future__ import annotations

from socllm.models.quant import FORMATS, QK

VEC = 32  # bytes: the alignment of every vector-loaded tensor (float8 / uchar16 / char16)


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m (work sizes)."""
    return (n + m - 1) // m * m


FLOAT_BUILD = {"F16": 1, "BF16": 2, "F32": 3}     # kernels.cl W_FLT


def weight_build(ref) -> tuple:
    """A matrix ref (graph/program.py) -> ((qs, d, m) offsets: for a "wq" ref its (qs, dm, qh);
    the -D options of the program that reads its format: kernels.cl's W_WQ, WHB, W_F32, W_G16,
    W_ZERO; "" for Q4_1 / Q4_0)."""
    if ref[0] == "w4":
        return tuple(ref[1:]), ""
    if ref[0] == "wt":                 # a float matrix as in the file
        return (ref[2], 0, 0), f"-DW_FLT={FLOAT_BUILD[ref[1]]}"
    if ref[0] != "wq":
        raise ValueError(f"the OpenCL kernels do not read {ref[0]} weights")
    f = FORMATS[ref[1]]
    opts = ["-DW_WQ", f"-DWHB={f.hb}"] + ["-DW_F32"] * (f.scale == "f32") \
        + ["-DW_G16"] * (f.group == 16) + [f"-DW_ZERO={f.zero}"] * bool(f.zero)
    return tuple(ref[2:]), " ".join(opts)


def out_offset(ref, pos0: int, cols: int, kv_half: bool = False) -> int:
    """Byte offset of an output ref's first row: KV refs start at row pos0 (written in place, in
    f32: an f16 cache is written through row maps only, by paged programs)."""
    if ref[0] != "kv":
        return ref[1]
    if kv_half:
        raise ValueError("an f16 KV cache is written through row maps only (paged programs)")
    return ref[1] + pos0 * cols * 4


def check_aligned(op: str, *offsets: int, to: int = VEC):
    """Raise unless every byte offset a kernel loads vectors from is a multiple of `to`."""
    if any(o % to for o in offsets):
        raise ValueError(f"{op}: vector-loaded offsets {offsets} must be multiples of {to} bytes")


def prepared_row_bytes(bits: int, K: int) -> int:
    """Bytes a row of K prepared activations takes in the scratch (prep_rows: values of `bits`,
    then each 32-block's scale and sum as f32), rounded to 64."""
    return round_up(bits // 8 * K + 8 * (K // QK), 64)
