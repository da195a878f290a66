"""The runner of serving steps: writes a step's rows into the pool, starts the processors, waits.

Any process attached to the pool can drive a step (the service's loop does): the step's token
ids and per-row metadata (position, KV row, sequence) and the block tables of its sequences go
into the pool's io region; the control block gets the program and N; the go words of the
processors the program uses are bumped; their done words are awaited (futex, no Ray call); the
logits are read from the pool. Programs are paged (graph/build.py): one for prefill chunks (the
last row's logits) and one for decode batches (every row's logits), installed once.
"""
from __future__ import annotations

import time

import numpy as np
import ray

from socllm.graph.program import StepProgram
from socllm.memory.ready import SleepPredictor
from socllm.policies.buckets import KV_STEP

from .control import PRECISIONS, run_step


class ProcessorLost(RuntimeError):
    """A processor actor's process died during a step (Engine.lost): the step did not happen."""

    def __init__(self, names: list):
        super().__init__(f"the {', '.join(names)} actor(s) died")
        self.names = names


class Runner:
    def __init__(self, engine, plan: str, precision: str = "f32", npu_chunk: int = 0):
        """precision: of a decode step's linears (policies/config.py SERVE_PRECISIONS); prefill
        chunks run in f32, or in int8 weight tiles at q8. npu_chunk: also install the NPU's
        static prefill chunk graphs of that many rows (Agent.xpu §4.3), for step(on="npu")."""
        self.eng, self.plan, self.precision = engine, plan, precision
        self.npu_chunk = npu_chunk
        self.chunk_precision = "q8" if precision == "q8" else "f32"   # prefill's linears
        lay = self.lay = engine.layout
        buf = engine.arena.buf

        def io(name, n, dtype=np.int32, where=lay.io):
            return buf[where[name]: where[name] + n * np.dtype(dtype).itemsize].view(dtype)
        # the step's rows per activation buffer (1: memory/layout.py's double buffer)
        self.meta = [{k: io(k, lay.max_rows) for k in ("ids", "pos", "rows", "seq")}]
        if lay.double:
            self.meta.append({k: io(k, lay.double_rows, where=lay.double)
                              for k in ("ids", "pos", "rows", "seq")})
        self.btab = io("btab", lay.max_seqs * lay.max_blocks).reshape(lay.max_seqs, lay.max_blocks)
        self.logits = io("logits", lay.max_seqs * lay.vocab, np.float32).reshape(lay.max_seqs, lay.vocab)
        self.words, self.ctl = engine.words, engine.ctl
        self.predict = SleepPredictor(engine.config.sleep_fraction)
        self.programs = {(all_rows, 0): self._install(all_rows) for all_rows in (False, True)}
        if lay.double:
            self.programs[(False, 1)] = self._install(False, 1)
        if npu_chunk:
            self.programs[(False, 0, "npu")] = self._install(False, 0, "npu")
        self.stages = engine.n_layers + 2        # graph/program.py stage_of

    def _install(self, all_rows: bool, buffer: int = 0, on: str | None = None):
        eng = self.eng
        bucket = self.npu_chunk if on == "npu" else 0
        pid, blob, procs = ray.get(eng.planner.paged_program.remote(on or self.plan, all_rows, buffer,
                                                                    bucket))
        actors = eng.processors()
        prec = self.precision if all_rows else self.chunk_precision
        ray.get([actors[p].install.remote(pid, blob, PRECISIONS[prec], prec) for p in procs])
        return pid, procs, StepProgram.from_bytes(blob).final

    def npu_fits(self, rows: list) -> bool:
        """Can the NPU's static chunk graph take these prefill rows: at most its bucket, starting
        at a block boundary (its K/V rows are written a whole block at a time, ov_segment.py)?"""
        return bool(self.npu_chunk) and len(rows) <= self.npu_chunk and \
            rows[0][1] % self.lay.block_rows == 0

    def step(self, rows: list, tables: dict, all_rows: bool, buffer: int = 0,
             span: tuple | None = None, on: str | None = None) -> np.ndarray:
        """rows: [(token id, position, sequence slot)], tables: slot -> block ids. Returns the
        logits [N, V] (all_rows) or [1, V] of the last row, a view into the pool.
        buffer 1: a prefill chunk in the second activation buffer; span (lo, hi): only its stages
        lo .. hi-1 (of `self.stages`), the rest at later calls with the same rows, other steps
        in between (Agent.xpu §4.4: a proactive prefill stops between layers). The logits are
        the last stage's. on="npu": a prefill chunk on the NPU's static graphs (npu_fits)."""
        n, br = len(rows), self.lay.block_rows
        meta = self.meta[buffer]
        if not 0 < n <= len(meta["ids"]):
            raise ValueError(f"a step of {n} rows (at most {len(meta['ids'])})")
        if span is not None and (buffer == 0 or not 0 <= span[0] < span[1] <= self.stages):
            raise ValueError(f"stages {span} of a step in buffer {buffer} ({self.stages} stages)")
        if on == "npu" and (all_rows or buffer or span or not self.npu_fits(rows)
                            or len({r[2] for r in rows}) != 1):
            raise ValueError(f"the NPU takes a prefill chunk of one sequence, at most {self.npu_chunk}"
                             f" rows from a block boundary, in the first buffer")
        if span is None or span[0] == 0:
            for slot, blocks in tables.items():
                self.btab[slot, :len(blocks)] = blocks
            tok, pos, seq = (np.fromiter((r[i] for r in rows), np.int32, n) for i in range(3))
            meta["ids"][:n], meta["pos"][:n], meta["seq"][:n] = tok, pos, seq
            meta["rows"][:n] = self.btab[seq, pos // br] * br + pos % br
        # one row: its position is also pos0 (the fused decode kernels' RoPE and key count); an
        # NPU chunk's first position picks its KV-length bucket (ov_segment.py)
        key = (False, 0, "npu") if on == "npu" else (all_rows, buffer)
        self._run(self.programs[key], n, int(rows[0][1]) if n == 1 or on == "npu" else 0,
                  self.precision if all_rows else self.chunk_precision, span)
        return self.logits[:n if all_rows else 1]

    def warm(self, max_seqs: int, chunks=(1, 2, 3, 5, 128)):
        """Runs a decode batch of every size up to max_seqs and prefill chunks of a few lengths
        once, on block 0 (no request holds blocks yet), so that kernel builds and launch
        recordings happen here and not inside the first requests (seconds on PoCL)."""
        self.btab[:max_seqs, 0] = 0
        for n in range(1, max_seqs + 1):
            self.step([(0, 0, s) for s in range(n)], {}, all_rows=True)
        lay = self.lay
        for buffer, meta in enumerate(self.meta):
            for n in chunks:
                if n <= min(len(meta["ids"]), lay.context):
                    blocks = [b % lay.kv_blocks for b in range(-(-n // lay.block_rows))]
                    self.step([(0, i, 0) for i in range(n)], {0: blocks}, all_rows=False,
                              buffer=buffer)
        if self.npu_chunk:
            n = self.npu_chunk
            blocks = [b % lay.kv_blocks for b in range(-(-n // lay.block_rows))]
            self.step([(0, i, 0) for i in range(n)], {0: blocks}, all_rows=False, on="npu")

    def warm_npu(self):
        """The NPU's attention graphs for every KV-length bucket (policies/buckets.KV_STEP rows),
        compiled here rather than inside requests (warm() compiles the first)."""
        lay, n = self.lay, self.npu_chunk
        for pos0 in range(KV_STEP, lay.context - n + 1, KV_STEP):
            blocks = [b % lay.kv_blocks for b in range(-(-(pos0 + n) // lay.block_rows))]
            self.step([(0, pos0 + i, 0) for i in range(n)], {0: blocks}, all_rows=False, on="npu")

    def drop_npu(self):
        """Prefill stays off the NPU: its chunk graphs go (they were only timed)."""
        pid, procs, _ = self.programs.pop((False, 0, "npu"))
        actors = self.eng.processors()
        ray.get([actors[p].uninstall.remote(pid) for p in procs])
        self.npu_chunk = 0

    def profile_batches(self, max_seqs: int, reps: int = 3) -> dict:
        """Seconds of a decode step of B rows for B = 1 .. max_seqs (the fastest of `reps`, after
        warm(), on block 0, where no request holds blocks yet): this device's batching profile,
        from which the agent policy's cap on mixed batches is chosen (policies/agent.py)."""
        out = {}
        for n in range(1, max_seqs + 1):
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                self.step([(0, 0, s) for s in range(n)], {}, all_rows=True)
                best = min(best, time.perf_counter() - t)
            out[n] = best
        return out

    def _run(self, prog, n: int, pos0: int, precision: str, span=None):
        pid, procs, final = prog
        run_step(self.lay, self.ctl, self.words, self.predict, pid, procs, final, n, pos0,
                 precision, self._check_errors, span)

    def reinstall(self):
        """Installs every program again where an actor lost them (a restarted actor; the others
        keep theirs): the planner still has them."""
        self.programs = {key: self._install(*key) for key in self.programs}

    def _check_errors(self, procs, waiting: bool = False):
        lost = self.eng.lost() if waiting else None    # every ~0.25 s of a late step
        if lost:
            raise ProcessorLost(lost)
        if self.ctl["error"]:
            eng = self.eng
            actors = eng.processors()
            msgs = ray.get([actors[p].last_error.remote() for p in procs])
            self.ctl["error"] = 0
            raise RuntimeError("; ".join(m for m in msgs if m))
