"""The tensor partition solver (HeteroLLM §4.3): how many rows of each linear the non-dominant
processor takes in the `tensor` plan (graph/partition.row_cut).

A profile is measured time per linear part and row count on each processor (seconds, from
`python -m socllm.scripts.profile_rowcut`, a JSON file per device). For one part of M rows the
solver weighs, over cuts aligned to ALIGN rows (the paper prunes to aligned cuts),

    T(r) = c * max(T_dom(M - r), T_other(r)) + T_sync      0 < r < M
    T_dom(M)                                               no cut
    T_other(M) + T_sync                                    all on the other processor

and keeps the least. c >= 1 is the contention of the two halves at once: both processors share
memory bandwidth (and here, where PoCL's "GPU" and OpenVINO's CPU "NPU" are the same two cores,
everything). The profiler measures it by running a cut for real (Ghidorah's profiling under
contention); each processor measured alone would predict gains that never come. T_sync is one hop through the pool (`socllm bench --sync`) plus, on this
kind of device, the dominant processor's wait; it is in the profile. Where the profile has no
row count the time is interpolated linearly in the rows (a roofline's shape: time grows with the
weight bytes read).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from socllm.graph.partition import ALIGN, CUTTABLE

DEFAULT_SHARE = 0.5     # the tensor plan without a profile: half of each cuttable linear
# where the profiler writes this device's profile, and the engine looks for it
PROFILE_PATH = os.path.join(os.path.expanduser("~"), ".cache", "socllm", "rowcut-profile.json")


@dataclass
class Choice:
    rows_other: int          # rows on the non-dominant processor (0: no cut, M: all moved)
    seconds: float           # predicted time of the part
    single_s: float          # the best single-processor time of the part

    @property
    def pays(self) -> bool:
        return 0 < self.rows_other and self.seconds < self.single_s


def _at(table: dict, rows: int) -> float:
    """Seconds for `rows` rows from a {rows: seconds} table, linear between measured points and
    through 0 below the first (a kernel of no rows costs nothing)."""
    pts = sorted((int(r), float(s)) for r, s in table.items())
    if rows <= 0:
        return 0.0
    lo = (0, 0.0)
    for r, s in pts:
        if rows == r:
            return s
        if rows < r:
            return lo[1] + (s - lo[1]) * (rows - lo[0]) / (r - lo[0])
        lo = (r, s)
    (r0, s0), (r1, s1) = pts[-2] if len(pts) > 1 else (0, 0.0), pts[-1]
    return s1 + (s1 - s0) * (rows - r1) / (r1 - r0)


def solve(dom: dict, other: dict, M: int, sync_s: float, cut_only: bool = False,
          contention: float = 1.0) -> Choice:
    """dom, other: {rows: seconds} of one part on the dominant and the other processor. The least
    predicted time; it never picks a cut predicted slower than the best single processor unless
    `cut_only` (the `tensor` plan asked for a cut: then the best proper cut)."""
    single = min(_at(dom, M), _at(other, M) + sync_s)
    best = Choice(0, _at(dom, M), single) if not cut_only else None
    if not cut_only and _at(other, M) + sync_s < best.seconds:
        best = Choice(M, _at(other, M) + sync_s, single)
    for r in range(ALIGN, M, ALIGN):
        t = contention * max(_at(dom, M - r), _at(other, r)) + sync_s
        if best is None or t < best.seconds:
            best = Choice(r, t, single)
    if best is None:
        raise ValueError(f"{M} rows cannot be cut in multiples of {ALIGN}")
    return best


def load_profile(path: str | None = None) -> dict | None:
    """A profile file; without a path, this device's at PROFILE_PATH, or None when there is none."""
    if path is None and not os.path.exists(PROFILE_PATH):
        return None
    with open(path or PROFILE_PATH) as f:
        return json.load(f)


def plan_rows(phase: str, sizes: dict, profile: dict | None = None) -> dict:
    """The `tensor` plan's cut for one phase: part -> rows on the non-dominant processor.
    sizes: part -> M. With a profile, the solver's best proper cut per part; without one (or for
    a part it did not measure), DEFAULT_SHARE of the rows, aligned."""
    rows = {}
    for part, M in sizes.items():
        if part not in CUTTABLE or M < 2 * ALIGN:
            continue
        if profile is None or part not in profile.get(phase, {}).get("dominant", {}):
            rows[part] = max(ALIGN, min(M - ALIGN, round(M * DEFAULT_SHARE / ALIGN) * ALIGN))
        else:
            rows[part] = solve_part(profile[phase], part, M, cut_only=True).rows_other
    return rows


def contention(phase_profile: dict, part: str) -> float:
    """Measured time of a real cut over its prediction without contention (at least 1)."""
    cut = phase_profile.get("cut", {}).get(part)
    if not cut:
        return 1.0
    return max(1.0, (cut["cut_measured_s"] - phase_profile["sync_s"]) /
               max(cut["cut_predicted_s"] - phase_profile["sync_s"], 1e-12))


def solve_part(phase_profile: dict, part: str, M: int, cut_only: bool = False) -> Choice:
    """The solver on one part of a profile (policies/rowcut JSON, one phase)."""
    p = phase_profile
    return solve(p["dominant"][part], p["other"][part], M, p["sync_s"], cut_only, contention(p, part))
