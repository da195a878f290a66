"""A mixture-of-experts FFN of a prefill chunk on the NPU, the NPUMoE way (§4).

The chunk's (token, slot) pairs are dispatched by expert into one static buffer (policies/moe.py
dispatch: each expert a slice of its capacity tier, most salient rows first); each resident group
of G same-tier experts is ONE compiled graph over its [G*C, dim] slice: batched matmuls over the
group's stacked expert weights (§4.2), the weights bound as inputs over the pool (u4 codes
dequantized in the graph), so every group of the same shape in every layer shares one compiled
graph. Cold experts (§4.3) and an expert's overflow rows (overflow "spill") run on the CPU beside
the NPU's calls, with the CPU actor's numpy kernels; "prune" drops the least salient overflow rows
instead (§3.2). The outputs scatter back by their routing weights, in rank order as the oracle.

The dispatch and combine are host work in the NPU actor's process, as NPUMoE does them on the CPU.
"""
from __future__ import annotations

import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from socllm.graph.program import cut_rows
from socllm.models.quant import QK, dequant_q4_1
from socllm.policies.moe import combine, dispatch

F32 = np.float32
RUNTIME_OVERFLOW = ("prune", "spill")     # pad needs a capacity per chunk: a static graph has one


def moe_ffn_runs(tasks: list) -> list:
    """Indices i where tasks[i:i+4] is one MoE FFN (graph/build.py _moe): gate, up, the gated
    product, down."""
    ops_ = [t.op for t in tasks]
    return [i for i in range(len(tasks) - 3)
            if ops_[i:i + 4] in (["moe_linear", "moe_linear", m, "moe_linear"] for m in ("silu_mul", "gelu_mul"))
            and tasks[i + 3].args["combine"]]


def _i64(*v):
    return np.array(v, np.int64)


def _group_model(G: int, C: int, D: int, F: int, act: str) -> ov.Model:
    """The grouped expert graph: x [G*C, D] and, per expert, its gate and up [F, D] and down
    [D, F] as Q4 planar inputs (u4 codes [M, K/32, 32], f16 d and m [M, K/32, 1]) -> y [G*C, D]:
    slice i of C rows through expert i."""
    x = ops.parameter([G * C, D], F32, name="x")
    params = [x]

    def weight(M, K):
        nb = K // QK
        q = ops.parameter([M, nb, QK], ov.Type.u4)
        d, m = ops.parameter([M, nb, 1], np.float16), ops.parameter([M, nb, 1], np.float16)
        params.extend([q, d, m])
        w = ops.add(ops.multiply(ops.convert(q, F32), ops.convert(d, F32)), ops.convert(m, F32))
        return ops.reshape(w, _i64(1, M, K), False)

    stacked = [[], [], []]
    for _ in range(G):
        for j, (M, K) in enumerate(((F, D), (F, D), (D, F))):
            stacked[j].append(weight(M, K))
    Wg, Wu, Wd = (ops.concat(s, 0) if G > 1 else s[0] for s in stacked)   # [G, F, D] x2, [G, D, F]
    xg = ops.reshape(x, _i64(G, C, D), False)
    h, u = ops.matmul(xg, Wg, False, True), ops.matmul(xg, Wu, False, True)          # [G, C, F]
    a = ops.multiply(ops.swish(h) if act == "silu" else ops.gelu(h, approximation_mode="tanh"), u)
    y = ops.reshape(ops.matmul(a, Wd, False, True), _i64(G * C, D), False)             # [G*C, D]
    return ov.Model([y], params, f"experts_g{G}_c{C}")


class GroupedExperts:
    """One layer's MoE FFN (tasks: gate, up, product, down) for chunks of up to `rows` tokens,
    laid out by `layer_plan` (policies/moe.py LayerPlan); run(n, pos0) like an OVSegment's."""

    def __init__(self, core, device: str, arena: np.ndarray, tasks: list, layer_plan, overflow: str,
                 props: dict, shared: dict):
        if overflow not in RUNTIME_OVERFLOW:
            raise ValueError(f"moe overflow {overflow!r}: grouped expert graphs take "
                             f"{' or '.join(RUNTIME_OVERFLOW)} (pad needs a capacity per chunk)")
        gate, up, act, down = tasks
        a = gate.args
        if any(t.args["w"][0] != "w4" for t in (gate, up, down)):
            raise ValueError("grouped expert graphs read Q4_1 / Q4_0 experts")
        self.k, self.E, self.F, self.D = a["k"], a["E"], a["M"], a["K"]
        self.x_off, self.route_off, self.out_off = a["x"][1], a["route"][1], down.args["out"][1]
        self.refs = {"gate": a, "up": up.args, "down": down.args}
        self.arena, self.overflow, self.plan = arena, overflow, layer_plan
        self.act = "gelu" if act.op == "gelu_mul" else "silu"
        self.base, self.static, rows = layer_plan.layout()
        self.cap = np.asarray(layer_plan.cap, np.int64)
        self.xbuf = np.zeros((max(rows, 1), self.D), F32)      # the static buffer: [rows, D]
        self.ybuf = np.zeros((max(rows, 1), self.D), F32)
        self.calls, self.compile_s, row = [], 0.0, 0          # [(lo, hi, infer request)]
        for g in layer_plan.groups:
            if g.processor != "npu":
                continue
            G, C = len(g.experts), g.capacity
            key = ("moe", G, C, self.D, self.F, self.act)
            if key not in shared:
                t = time.perf_counter()
                shared[key] = core.compile_model(_group_model(G, C, self.D, self.F, self.act), device,
                                                 props)
                self.compile_s += time.perf_counter() - t
            req = shared[key].create_infer_request()
            lo, hi = row, row + G * C
            tensors = [ov.Tensor(self.xbuf[lo:hi], shared_memory=True)]
            for e in g.experts:
                for part, M, K in (("gate", self.F, self.D), ("up", self.F, self.D), ("down", self.D, self.F)):
                    tensors += self._expert_tensors(part, e, M, K)
            for i, tensor in enumerate(tensors):
                req.set_input_tensor(i, tensor)
            req.set_output_tensor(0, ov.Tensor(self.ybuf[lo:hi], shared_memory=True))
            self.calls.append((lo, hi, req))
            row = hi
        # so far: pairs on the NPU's graphs, on the CPU, pruned; NPU calls; ms dispatching (the
        # host's sort, gather and combine), waiting for the NPU, on the CPU's experts
        self.done = {"npu_rows": 0, "cpu_rows": 0, "pruned": 0, "calls": 0, "host_ms": 0.0,
                     "npu_wait_ms": 0.0, "cpu_ms": 0.0}

    def _expert_views(self, part: str, e: int, M: int, K: int) -> tuple:
        """Expert e's rows of a stacked Q4 weight in the arena: codes [M, K/2] u8, d and m
        [M, K/32] f16 (models/quant.py's planar layout)."""
        whole = {"w": self.refs[part]["w"], "K": K, "M": self.E * M, "out": ("a", 0)}
        _, qs, d, m = cut_rows(whole, e * M, (e + 1) * M)["w"]
        nb = K // QK
        return (self.arena[qs: qs + M * K // 2].reshape(M, K // 2),
                self.arena[d: d + M * nb * 2].view(np.float16).reshape(M, nb),
                self.arena[m: m + M * nb * 2].view(np.float16).reshape(M, nb))

    def _expert_tensors(self, part: str, e: int, M: int, K: int) -> list:
        """The same as OpenVINO tensors over the arena: u4 codes [M, K/32, 32], d and m [M, K/32, 1]."""
        codes, d, m = self._expert_views(part, e, M, K)
        nb = K // QK
        return [ov.Tensor(codes.reshape(-1), [M, nb, QK], ov.Type.u4),
                ov.Tensor(d.reshape(M, nb, 1), shared_memory=True),
                ov.Tensor(m.reshape(M, nb, 1), shared_memory=True)]

    def _expert(self, part: str, e: int, M: int, K: int) -> np.ndarray:
        """Expert e's matrix of a part, dequantized: f32 [M, K] (the CPU's share, each call)."""
        return dequant_q4_1(*self._expert_views(part, e, M, K))

    def _f32(self, off: int, rows: int, cols: int) -> np.ndarray:
        return self.arena[off: off + rows * cols * 4].view(F32).reshape(rows, cols)

    def run(self, n: int, pos0: int):
        t0 = time.perf_counter()
        k = self.k
        rt = self._f32(self.route_off, n, 2 * k + 1)
        sel, w, sal = rt[:, :k].astype(np.int64), rt[:, k:2 * k], rt[:, 2 * k]
        x = self._f32(self.x_off, n, self.D)
        d = dispatch(sel, sal, self.cap, self.overflow, base=self.base, static=self.static)
        self.xbuf[d.row] = x[d.token]
        busy = np.zeros(len(self.xbuf), bool)
        busy[d.row] = True
        started = [req for lo, hi, req in self.calls if busy[lo:hi].any()]   # an empty group: no call
        for req in started:
            req.start_async()
        t1 = time.perf_counter()
        fallback = self._cpu(x, sel, d.fallback_token, d.fallback_slot)
        t2 = time.perf_counter()
        for req in started:
            req.wait()
        t3 = time.perf_counter()
        self._f32(self.out_off, n, self.D)[:] = combine(self.ybuf, fallback, w, d)
        t4 = time.perf_counter()
        for key, v in (("npu_rows", len(d.row)), ("cpu_rows", len(d.fallback_token)),
                       ("pruned", len(d.dropped_token)), ("calls", len(started)),
                       ("host_ms", 1e3 * (t1 - t0 + t4 - t3)), ("npu_wait_ms", 1e3 * (t3 - t2)),
                       ("cpu_ms", 1e3 * (t2 - t1))):
            self.done[key] += v

    def _cpu(self, x, sel, tok, slot) -> np.ndarray:
        """The pairs (tok, slot) through their experts with the CPU's kernels -> [S, D]."""
        out = np.zeros((len(tok), self.D), F32)
        experts = sel[tok, slot]
        for e in np.unique(experts):
            i = np.flatnonzero(experts == e)
            W = {p: self._expert(p, e, M, K)
                 for p, M, K in (("gate", self.F, self.D), ("up", self.F, self.D), ("down", self.D, self.F))}
            xe = x[tok[i]]
            h = xe @ W["gate"].T
            g = h / (1 + np.exp(-h)) if self.act == "silu" else \
                0.5 * h * (1 + np.tanh(F32(np.sqrt(2 / np.pi)) * (h + F32(0.044715) * h ** 3)))
            out[i] = (g * (xe @ W["up"].T)) @ W["down"].T
        return out


def moe_plan(config, tasks: list, chunk: int):
    """The MoE layout (policies/moe.py MoEPlan) of a prefill chunk program's MoE layers, from the
    model's calibration in the cache (`socllm calibrate`; the one of this chunk size), else a
    uniform one (every expert expected at T*k/E rows, twice that its p95): exact all the same
    with overflow "spill", only slower where the real load is skewed. -> (plan, source)."""
    import glob
    import json
    import os

    from socllm.models.gguf_file import file_digest, model_path
    from socllm.policies import moe
    g = next(t.args for t in tasks if t.op == "moe_linear")
    E, k, F, D = g["E"], g["k"], g["M"], g["K"]
    sha = file_digest(model_path(config.model))
    calib, source = None, "uniform (no calibration cached: socllm calibrate MODEL)"
    for f in sorted(glob.glob(os.path.join(config.cache_dir or "", "moe", f"{sha}-T{chunk}-*.json"))):
        with open(f) as fh:
            calib, source = json.load(fh), f"calibration {os.path.basename(f)}"
        break
    if calib is None:
        base = chunk * k / E
        layers = sorted({t.layer for t in tasks if t.op == "moe_route"})
        calib = {"chunk": chunk, "top_k": k, "n_experts": E, "dim": D, "ffn_dim": F,
                 "gguf_sha256": sha,
                 "layers": [{"layer": l, "mean": [base] * E, "p95": [2 * base] * E, "rho": 2.0}
                            for l in layers]}
    if config.moe_graphs == "per_expert":     # NPUMoE's baseline: a graph per expert, T rows
        return moe.plan(calib, overflow="spill", group_size=1, tiers=False, residency=False,
                        capacity=chunk), source
    profile = device_profile(config.cache_dir, D, F)
    return moe.plan(calib, profile, overflow=config.moe_overflow, group_size=config.moe_group), source


def device_profile(cache_dir: str | None, D: int, F: int) -> dict:
    """policies/moe.py's device profile, measured on this machine once per expert shape and
    kept in the cache: one expert's FFN on 16 and on 64 rows as a grouped graph on the NPU's
    device (its launch and per-row cost) and with the CPU's numpy kernels (per row, and
    dequantizing the expert's weights, which it does each call)."""
    import json
    import os

    from socllm.policies.moe import EXAMPLE_PROFILE
    path = os.path.join(cache_dir, "moe", f"profile-d{D}-f{F}.json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    rng = np.random.default_rng(0)
    planar = {p: {"qs": rng.integers(0, 256, (M, K // 2), dtype=np.uint8),
                  "d": (rng.random((M, K // QK)) * 1e-2).astype(np.float16),
                  "m": (rng.random((M, K // QK)) * -1e-2).astype(np.float16)}
              for p, M, K in (("gate", F, D), ("up", F, D), ("down", D, F))}
    core = ov.Core()
    from socllm.actors.npu.segment import _compile_props, pick_device
    weights = []                                  # the expert's tensors, as _group_model takes them
    for w in planar.values():
        M, nbk = w["d"].shape
        weights += [ov.Tensor(w["qs"].reshape(-1), [M, nbk, QK], ov.Type.u4),
                    ov.Tensor(w["d"].reshape(M, nbk, 1)), ov.Tensor(w["m"].reshape(M, nbk, 1))]
    W = {}

    def dequantize():                             # what the CPU does each call
        W.update({p: dequant_q4_1(w["qs"], w["d"], w["m"]) for p, w in planar.items()})
    cpu = {"dequant": _best(dequantize)}
    npu = {}
    for C in (16, 64):
        req = core.compile_model(_group_model(1, C, D, F, "silu"), pick_device(core),
                                 _compile_props(core, "f32", {"INFERENCE_NUM_THREADS": 2})).create_infer_request()
        x = rng.standard_normal((C, D)).astype(F32)
        for i, t in enumerate([ov.Tensor(x)] + weights):
            req.set_input_tensor(i, t)
        npu[C] = _best(req.infer)
        cpu[C] = _best(lambda x=x: ((x @ W["gate"].T) * (x @ W["up"].T)) @ W["down"].T)

    def row(t):                                   # ms a row: the slope from 16 to 64 rows
        return max(1e-6, (t[64] - t[16]) / 48)
    profile = {**EXAMPLE_PROFILE,
               "npu": {"launch_ms": max(0.0, npu[16] - 16 * row(npu)), "ms_per_row": row(npu)},
               "fallback": {"launch_ms": max(0.0, cpu[16] - 16 * row(cpu)), "ms_per_row": row(cpu),
                            "ms_per_expert": cpu["dequant"]},
               "measured": f"{pick_device(core)} grouped graph vs numpy, one expert [{F}x{D}], 2 threads"}
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(profile, f, indent=1)
    return profile


def _best(fn, reps: int = 5) -> float:
    """ms of fn's fastest of reps runs, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3
