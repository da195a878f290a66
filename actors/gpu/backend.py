"""GPU processor backend: OpenCL kernels (pyopencl) on one buffer that wraps the whole pool.

On a device that shares host memory (an iGPU; PoCL on this machine) the buffer is the pool
itself (CL_MEM_USE_HOST_PTR): no copies. Kernels are enqueued without waiting; the queue is
finished only where another processor needs a result (a signal) and at the end of the step.

A discrete GPU (kernels_cl.discrete) gets the pool's bytes copied into its memory once, weights
and all. It runs steps on the GPU alone (the gpu plan, the service's paged steps): a step copies
up what the control plane wrote for it (token ids and the rows' metadata) and down its logits;
the KV cache and the activations stay on the device. A program that exchanges tensors with other
processors mid-step (waits, signals) is refused there.
"""
from __future__ import annotations

import numpy as np

from socllm.graph.program import StepProgram, stage_of

from socllm.actors.worker import Unit, kernel_units

PAGED_PHASES = ("chunk", "batch")     # policies/planner.py paged_program
ACT_BITS = {"q16": 16, "q8": 8}       # a decode batch's linears in integers (cl/paged.cl)
# row counts whose launches a paged program keeps recorded: a decode batch has at most max_seqs;
# prefill chunks walk their tasks at every step (gpu/kernels.py replay: as fast, nothing kept)
RECORDINGS = {"batch": None, "chunk": 0}


class GPUBackend:
    name = "gpu"

    def __init__(self, arena_buf, lay, threads: int, profile: bool = False, build_options: str = "",
                 config=None):
        """build_options: kernels.cl's tuning macros, e.g. a GPU's work shapes on PoCL (tests).
        config: the engine's (policies/config.py: fuse, cl_discrete, the PoCL knobs); None: the
        environment's (scripts and tests that make a backend in process)."""
        from socllm.policies.config import EngineConfig

        from socllm.actors.gpu.device import make_context, wrap_arena
        from socllm.actors.gpu.kernels import CLKernels
        config = EngineConfig.from_env() if config is None else config
        self.ctx, self.queue, self.device = make_context(profile=profile, config=config)
        from socllm.actors.gpu.fused import counter_at, pos_word_at
        # a process killed inside a fused launch leaves last_group's count half-way: the
        # restarted actor (actors/processor.py) starts from zero (before a discrete copy is made)
        arena_buf[counter_at(lay.io["rope"]):][:4].view(np.int32)[0] = 0
        self.pos_word = pos_word_at(lay.io["rope"])
        self.buf = wrap_arena(self.ctx, arena_buf, config.cl_discrete)
        self.kernels = CLKernels(self.ctx, self.queue, self.buf, build_options, kv_dtype=lay.kv_dtype,
                                 forced_discrete=config.cl_discrete)
        # a discrete GPU: the host arena, what a step copies up (the control plane's writes) and
        # what it copies down (the logits)
        self.host, self.copies = arena_buf, self.kernels.copies
        meta = ("ids", "pos", "rows", "seq")
        self.step_inputs = [(lay.io[k], lay.io[k] + 4 * lay.max_rows) for k in meta] + \
            [(lay.io["tmask"], lay.io["tmask"] + 16 * lay.max_rows)] + \
            [(lay.io["btab"], lay.io["btab"] + 4 * lay.max_seqs * lay.max_blocks)] + \
            [(lay.double[k], lay.double[k] + 4 * lay.double_rows) for k in meta if lay.double] + \
            [(self.pos_word, self.pos_word + 4)]
        # what a step leaves for the host: the logits, and the rows' hidden states (draft heads)
        self.step_outputs = [(lay.io["logits"], lay.io["logits"] + 4 * lay.max_seqs * lay.vocab)] + \
            ([(lay.hidden[0], lay.hidden[0] + lay.hidden[1])] if lay.hidden else [])
        self.act_off, self.rope_off = lay.io["act"], lay.io["rope"]
        self.rows_act_off = lay.io["act_rows"]
        self.rows_act_bytes = lay.io["act"] - lay.io["act_rows"]          # the next io region
        self.kernels.moe_scratch = (self.rows_act_off, self.rows_act_bytes)
        # a serving step's rope table (paged.cl rope_rows_table)
        self.kernels.rope_rows = (lay.io["rope_rows"], lay.io["att"] - lay.io["rope_rows"])
        self.att_off, self.att_bytes = lay.io["att"], lay.ctl - lay.io["att"]   # io's last area
        self.lay, self.double, self.double_rows = lay, lay.double, lay.double_rows
        self.threads = threads
        # decode runs the fused kernels (5 launches a layer), in a GPU's work shapes on a GPU
        # (gpu/fused.py); the config's fuse False (SOCLLM_FUSE=0): op by op (for profiles)
        self.fuse = config.fuse

    def build_units(self, prog: StepProgram, precision: str) -> list:
        tasks = prog.tasks.get(self.name, [])
        if self.copies and any(t.waits or t.signals for t in tasks):
            raise ValueError(f"{self.device.name} is a discrete GPU: it runs steps on the GPU alone "
                             "(plan gpu), not a plan that exchanges tensors with other processors")
        if prog.phase in PAGED_PHASES and not any(t.waits or t.signals for t in tasks):
            # a serving step on this processor alone: its launches recorded once per row count;
            # a decode batch of one row runs the fused decode kernels (at this precision); q8
            # prefill chunks run their linears in int8 as batches do, q16 chunks in the int16
            # weight tiles where those take every linear (tiles_take_all) on a CPU's OpenCL
            # (measured there; a GPU's chunks keep the f32 GEMM, not measured against them). A
            # GPU's decode batches of several rows keep it too: those integer kernels are shaped
            # for a CPU's cores; on an H100 a q16 batch took 16.0 ms at 2 rows and 37.0 at 8 in
            # them, 7.9 and 8.7 in the f32 GEMM (scripts/results/h100/tree/run1/gpu-rows.txt)
            # (q8's were not measured there: they keep int8)
            on_cpu = self.kernels.on_cpu
            bits = ACT_BITS.get(precision) if prog.phase == "batch" and on_cpu or precision == "q8" \
                or precision == "q16" and on_cpu and tiles_take_all(tasks) else None
            rows_act = (self.rows_act_off, self.rows_act_bytes, bits) if bits else None
            # a chunk in the second activation buffer has its own rope table there (its stages
            # may run apart, with other steps between them)
            rope_rows = (self.double["rope_rows"], 4 * self.double_rows * self.lay.kv_cols) \
                if prog.buffer else None
            replay = self.kernels.replay(tasks, rows_act, keep=RECORDINGS[prog.phase],
                                         rope_rows=rope_rows, stages=stage_of(tasks))
            seqs = tuple(t.seq for t in tasks)
            if prog.phase != "batch" or not self.fuse:
                return [Unit([], replay, [], seqs, spans=True)]
            fused = self._fused_units(prog, precision)

            def run(n, pos0):
                if n > 1:
                    return replay(n)
                for u in fused:
                    u.run(1, pos0)
            return [Unit([], run, [], seqs)]
        if prog.phase == "batch" and not any(t.rows for t in tasks):
            return self._replayed_runs(tasks, precision)
        if prog.phase != "decode":
            return kernel_units(self.kernels, tasks)
        if not self.fuse:         # op by op, each launch pre-bound (no Python per op and step)
            k = self.kernels
            return [Unit(t.waits, _one_row(k.bind(lambda p, t=t: k.run(t.op, t.args, 1, p))),
                         t.signals, (t.seq,)) for t in tasks]
        return self._fused_units(prog, precision)

    def _replayed_runs(self, tasks: list, precision: str) -> list:
        """A decode batch that exchanges tensors with another processor (hcmp: graph/hcmp.py):
        its tasks in runs from one wait to the end of the next run of signalling tasks (their
        signals stored together after it: one finish, not one a task; the q, K and V rows a
        layer's sparse part waits for come from 3 consecutive tasks), each run's launches
        recorded and replayed as a whole step's are (in the batches' integer tiles on a CPU's
        OpenCL), not walked op by op in Python at every step."""
        bits = ACT_BITS.get(precision) if self.kernels.on_cpu else None
        rows_act = (self.rows_act_off, self.rows_act_bytes, bits) if bits else None
        runs: list = [[]]
        for t in tasks:
            if runs[-1] and (t.waits or runs[-1][-1].signals and not t.signals):
                runs.append([])
            runs[-1].append(t)
        return [Unit(run[0].waits, self.kernels.replay(run, rows_act, keep=RECORDINGS["batch"]),
                     [s for t in run for s in t.signals], tuple(t.seq for t in run)) for run in runs]

    def _fused_units(self, prog: StepProgram, precision: str) -> list:
        # Transformer-Lite §2.2: decode runs fused kernels (graph/fuse.py, cl/decode.cl)
        from socllm.graph.fuse import Fused, fuse_decode
        from socllm.actors.gpu.fused import FusedCL
        fused = FusedCL(self.kernels, self.act_off, self.rope_off, precision, self.att_off,
                        self.att_bytes, pos_word=True)
        units, k = [], self.kernels
        k.moe_bits = ACT_BITS.get(precision, 32)       # MoE linears' rows as the fused GEMVs'
        try:
            for f in fuse_decode(prog, self.name):
                if isinstance(f, Fused):
                    run = k.bind(lambda p, f=f: fused.run(f, 1, p))
                else:
                    run = k.bind(lambda p, f=f: k.run(f.op, f.args, 1, p))
                seqs = f.seqs if isinstance(f, Fused) else (f.seq,)
                units.append(Unit(f.waits, _one_row(run), f.signals, seqs))
        finally:
            k.moe_bits = 32
        return units

    def begin_step(self, precision: str, pos0: int):
        """A precision's activation format is built into its fused decode units (q16: int16, q8:
        int8 GEMV activations; the rest f32; prefill runs in f32). The fused units read pos0 from
        the position word. A discrete GPU: the step's inputs up."""
        self.host[self.pos_word:][:4].view(np.int32)[0] = pos0
        for lo, hi in self.step_inputs if self.copies else ():
            self.kernels.to_device(self.host, lo, hi)

    def finish(self):
        self.kernels.finish()
        for lo, hi in self.step_outputs if self.copies else ():    # a discrete GPU: them down
            self.kernels.to_host(self.host, lo, hi)

    def describe(self) -> dict:
        d = self.device
        return {"processor": "gpu", "api": "OpenCL", "platform": d.platform.name, "device": d.name,
                "type": "CPU (PoCL: OpenCL on the CPU, not a GPU)" if d.type & 2 else "GPU",
                "host_unified_memory": bool(d.host_unified_memory), "discrete": bool(self.copies),
                "threads": self.threads, "fuse": self.fuse}


def tiles_take_all(tasks) -> bool:
    """Do the int16 weight tiles (cl/batch.cl linear_tile) take every linear of these tasks:
    Q4_1 / Q4_0 weights, M a multiple of 8, no bias, no MoE? Then a q16 prefill chunk runs in
    them: 1.6-1.8x the f32 GEMM's rows a second at 16-128 rows on 2 Zen 5 cores (PoCL, VNNI),
    int16 activations per 32-block as a q16 decode batch's. Other formats' rows in int16
    (linear_rows_act) are slower than the f32 GEMM past two rows, so those chunks keep it."""
    return all(t.op != "moe_linear" and (t.op != "linear" or (
        t.args["w"][0] == "w4" and t.args["M"] % 8 == 0 and "b" not in t.args)) for t in tasks)


def _one_row(run):
    """A unit's run(n, pos0) over a bound decode launch, which holds for one row only."""
    def unit(n, pos0):
        if n != 1:
            raise ValueError(f"a decode unit runs one row, got {n}")
        run(pos0)
    return unit
