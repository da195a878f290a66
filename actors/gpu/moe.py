"""The GPU actor's mixture-of-experts launches (cl/moe.cl; graph/build.py _moe): CLKernels takes
them as a mixin. A row's route, then its experts' linears: for a batch at q16 / q8 by expert in
weight tiles, for a few rows over prepared rows, else in the weight's own format."""
from __future__ import annotations

import numpy as np

from socllm.actors.gpu.refs import check_aligned, prepared_row_bytes, round_up, weight_build
from socllm.models.quant import QK

u64, i32 = np.uint64, np.int32
MOE_SCALARS = {  # kernel -> dtypes of its scalar args after the arena buffer
    "moe_route": [u64] * 3 + [i32] * 5,
    "moe_linear": [u64] * 6 + [i32] * 5,
    "moe_linear_act": [u64] * 6 + [i32] * 6 + [u64],
    "moe_gate_up": [u64] * 9 + [i32] * 5,
    "moe_sort": [u64] * 2 + [i32] * 3,
    "moe_gather": [u64] * 3 + [i32] * 5,
    "moe_tile": [u64] * 6 + [i32] * 4,
    "moe_combine": [u64] * 4 + [i32] * 2,
    "moe_down_q4": [u64] * 6 + [i32] * 4 + [u64],
}


class MoELaunches:
    """CLKernels' MoE ops. Uses its _go, _kernels, rows_act, _prepared, group, lin_t, lin_r,
    tile_max, and moe_scratch / moe_bits (set by the GPU backend)."""

    def _moe_route(self, a, N, pos0):
        """x [N, E] router logits, sal [N, D] -> out [N, 2k+1] (NumpyKernels.moe_route); no sal
        (a fused decode step's, graph/fuse.py): saliency 0."""
        if a["E"] > 256:
            raise ValueError(f"moe_route: {a['E']} experts, the kernel takes 256 at most")
        self._go("moe_route", (N,), None, a["x"][1], a.get("sal", a["x"])[1], a["out"][1], a["E"],
                 a["k"], int(a.get("norm", 1)), N, a["D"] if "sal" in a else 0)

    def _moe_linear(self, a, N, pos0):
        """x [N, K] or [N, k*K], route [N, 2k+1], W [E*M, K] -> out [N, k*M] or, combine, [N, M]
        (NumpyKernels.moe_linear): every row's k experts' rows, in the weight's own format. Rows
        that fit the scratch are prepared first (prep_rows: f32, or int16 / int8 at q16 / q8) and
        multiplied as the dense GEMVs are (moe_linear_act; a decode step of the MoEfied SmolLM2 at
        f32, 2 Zen 5 cores: its MoE linears 6.8 -> 4.8 ms, with graph/fuse.py's moe_gate_up);
        else, and for float weights, moe_linear."""
        (qs, d, m), wopts = weight_build(a["w"])
        check_aligned("moe_linear", a["x"][1])
        K, M, k, per_slot, combine = a["K"], a["M"], a["k"], int(a["per_slot"]), int(a["combine"])
        res = a["res"][1] if a.get("res") else 0           # combine: + the residual
        if N > 1 and self._moe_tiles(a, N, res):
            return
        prepared = self._moe_rows(a["x"][1], K, N * (k if per_slot else 1), wopts, a["w"][0])
        if prepared is not None:
            ks, off, row_bytes = prepared
            if combine and per_slot and "moe_down_q4" in ks:       # Q4_1 on a CPU
                self._go("moe_down_q4", (round_up(-(-M // 2), self.lin_r), N), (self.lin_r, 1), off,
                         a["route"][1], qs, d, m, a["out"][1], K, M, k, row_bytes,
                         res, ks=ks)
                return
            self._go("moe_linear_act", (self.lin_t, round_up(-(-M // 2), self.lin_r), N if combine else N * k),
                     (self.lin_t, self.lin_r, 1), off, a["route"][1], qs, d, m, a["out"][1], K, M, k,
                     per_slot, combine, row_bytes, res, ks=ks)
            return
        self._go("moe_linear", (M, N), None, a["x"][1], a["route"][1], qs, d, m, a["out"][1],
                 K, M, k, per_slot, combine, ks=self._kernels(64, 32, None, wopts))

    def _moe_tiles(self, a, N, res: int = 0) -> bool:
        """A decode batch's moe_linear by expert in weight tiles (cl/moe.cl moe_sort, moe_gather,
        moe_tile; q16 / q8 rows, Q4_1 experts, M a multiple of 8), where the sort's table, the
        rows and (combine) the slots' outputs fit the scratch. False: not taken."""
        if self.rows_act is None or self.rows_act[2] not in (8, 16) or a["w"][0] != "w4" \
                or a["M"] % 8 or a["K"] % QK or self.moe_scratch is None:
            return False
        K, M, k, E, bits = a["K"], a["M"], a["k"], a["E"], self.rows_act[2]
        per_slot, combine = int(a["per_slot"]), int(a["combine"])
        tn = min(N, self.tile_max)                      # rows a tile (kernels.py TILE16_MAX)
        R = N * k + E * (tn - 1)                        # the runs' rows, each padded to tn
        row_bytes = prepared_row_bytes(bits, K)
        off, nbytes = self.moe_scratch
        rows_at = off + round_up(4 * (2 * E + R), 64)
        part = rows_at + R * row_bytes                  # combine: the slots' outputs [N, k, M]
        if part + (4 * N * k * M if combine else 0) > off + nbytes:
            return False
        ks = self._kernels(64, bits, None, f"-DTILE_N={tn} -DTILE_K={K} -DTILE_ROW_BYTES={row_bytes}")
        x, route = a["x"][1], a["route"][1]
        if self._prepared != ("moe", x, route, N):     # gate's rows serve up
            self._go("moe_sort", (1,), (1,), route, off, N, k, E, ks=ks)
            self._go("moe_gather", (round_up(K // QK, 8), R), (8, 1), x, off, rows_at, K, row_bytes,
                     k, E, per_slot, ks=ks)
            self._prepared = ("moe", x, route, N)
        _, qs, d, m = a["w"]
        self._go("moe_tile", (round_up(M // 8, self.lin_r), -(-N // tn), E), (self.lin_r, 1, 1),
                 rows_at, qs, d, m, part if combine else a["out"][1], off, K, M, E, row_bytes, ks=ks)
        if combine:
            self._go("moe_combine", (round_up(M, self.group), N), (self.group, 1), part, route,
                     a["out"][1], res, M, k, ks=ks)
        return True

    def _moe_rows(self, x, K, rows, wopts, kind, held: int | None = None):
        """(kernels, scratch offset, row bytes) once x [rows, K] is prepared in the scratch (as
        _prep_rows: a linear before that read the same rows leaves them), or None where they do
        not fit, there is no scratch, or the weights are floats. held: where x's one row is
        already prepared (the fused decode's act scratch): read there, nothing prepared."""
        if self.moe_scratch is None or kind == "wt" or K % QK:
            return None
        bits = self.rows_act[2] if self.rows_act is not None else self.moe_bits
        off, nbytes = self.moe_scratch
        row_bytes = prepared_row_bytes(bits, K)
        ks = self._kernels(64, bits, None, wopts)
        if rows * row_bytes > nbytes or "moe_linear_act" not in ks:
            return None
        if held is not None and rows == 1:
            return ks, held, row_bytes
        if self._prepared != (x, rows):
            self._go("prep_rows", (round_up(K // QK, 8), rows), (8, 1), x, off, K, row_bytes, rows, ks=ks)
            self._prepared = (x, rows)
        return ks, off, row_bytes
