"""The runner of serving steps: writes a step's rows into the pool, starts the processors, waits.

Any process attached to the pool can drive a step (the service's loop does): the step's token
ids and per-row metadata (position, KV row, sequence) and the block tables of its sequences go
into the pool's io region; the control block gets the program and N; the go words of the
processors the program uses are bumped; their done words are awaited (futex, no Ray call); the
logits are read from the pool. Programs are paged (graph/build.py): one for prefill chunks (the
last row's logits) and one for decode batches (every row's logits), installed once.
"""
from __future__ import annotations

import collections
import time

import numpy as np
import ray

from socllm.graph.program import StepProgram
from socllm.memory.layout import W_FIRST_LOC
from socllm.memory.ready import MAX_EPOCH, STEP, SleepPredictor
from socllm.policies.buckets import KV_STEP, MAX_CHUNK, batch_bucket, bucket_for
from socllm.policies.arca import band_of, share_key
from socllm.policies.drafting import hcmp_entries
from socllm.policies.placement import PROCESSORS_OF, SERVE_PLANS, seq_parts

PRECISIONS = {"f32": 0, "q8": 3, "q16": 4}     # a step's precision code in the control block


def next_epoch(ctl, words) -> int:
    """The next step's epoch, shared through the control block by every process that drives
    steps of this pool: stamps only grow."""
    epoch = ctl["epoch"] + 1
    if epoch > MAX_EPOCH:            # stamps would wrap: every processor is idle, reset them
        words.words[W_FIRST_LOC:] = 0
        epoch = 1
    return epoch


def run_step(lay, ctl, words, predict, pid: int, procs, final: dict, n: int, pos0: int,
             precision: str, check_errors, span: tuple | None = None) -> int:
    """One step from any process attached to the pool: the control block's words, the go words
    of the processors the program uses, then their done words (a step's length is learned:
    predict sleeps most of it, then polls). check_errors(procs, waiting) raises a processor's
    error; waiting: called because the done words are late (where to look for a dead actor).
    span: (lo, hi), run only the program's stages lo .. hi-1 (graph/program.py stage_of).
    Returns the step's epoch."""
    epoch = next_epoch(ctl, words)
    ctl["epoch"], ctl["program"], ctl["n"], ctl["pos0"] = epoch, pid, n, pos0
    ctl["span_lo"], ctl["span_hi"] = span or (0, 0)
    ctl["precision"] = PRECISIONS[precision]
    base = epoch * STEP
    for p in procs:
        words.store(lay.go(p), epoch)
    for p in procs:
        while not predict.wait(words, (pid, p, span), lay.done(p), base + final[p], timeout_s=0.25):
            check_errors(procs, True)
    check_errors(procs, False)
    return epoch


class ProcessorLost(RuntimeError):
    """A processor actor's process died during a step (Pool.lost): the step did not happen."""

    def __init__(self, names: list):
        super().__init__(f"the {', '.join(names)} actor(s) died")
        self.names = names


class Runner:
    def __init__(self, engine, plan: str, precision: str = "f32", npu_chunk: int = 0):
        """plan: a serving plan (policies/placement.py SERVE_PLANS): what runs decode batches and
        prefill chunks. precision: a decode step's linears' (policies/config.py SERVE_PRECISIONS;
        chunks: the same integer tiles at q16 and q8, gpu/backend.py tiles_take_all). npu_chunk:
        the rows of the static chunk graphs of a plan the NPU takes part in (Agent.xpu §4.3; 0:
        its base processor's), or of the NPU's alone for step(on="npu") in another plan."""
        self.eng, self.plan, self.precision = engine, plan, precision
        self.decode_on, self.chunk_on = SERVE_PLANS[plan]
        # the processor of what the plan's own programs cannot take: a chunk that does not start
        # a block or outgrows a static bucket, a chunk stopped between layers (second buffer)
        self.base = plan if plan in ("cpu", "gpu") else "gpu" if "gpu" in engine.available else "cpu"
        need = {p for on in (self.decode_on, self.chunk_on) for p in PROCESSORS_OF.get(on, (on,))}
        missing = need - set(engine.available)
        if missing:
            raise ValueError(f"the {plan} plan needs the {' and the '.join(sorted(missing))} "
                             f"actor(s); this engine has {', '.join(sorted(engine.available))}")
        lay = self.lay = engine.layout
        self._map_io(engine.arena.buf, lay)
        self.words, self.ctl, self.predict = engine.words, engine.ctl, SleepPredictor(engine.config.sleep_fraction)
        self.npu_chunk = npu_chunk or (lay.max_rows if self.chunk_on in ("npu", "tensor") else 0)
        # the fewest rows of a chunk the NPU's static graph takes (0: any), and whether it takes
        # chunks past a prompt's start (per-layer graphs): the Service's auto sets them (timings)
        self.npu_from, self.npu_later = 0, True
        self.hcmp_bands = [(0, engine.config.hcmp_share or 0.0)]   # hcmp's: arca.band_of
        # (program plan, all_rows, buffer, bucket) -> (pid, processors, final stamps); programs
        # of static buckets are installed when a step first needs them
        self.programs, self.steps = {}, collections.Counter()   # steps run: named by `ran`
        self.first_s = collections.defaultdict(lambda: collections.deque(maxlen=5))  # _run
        self._install_first(npu_chunk)
        self.stages = engine.n_layers + 2        # graph/program.py stage_of

    def _install_first(self, npu_chunk: int):
        """The programs every step needs from the start: a decode batch, a chunk on the base
        processor (and in the second buffer), the plan's static chunk graphs (or the NPU's alone,
        for step(on="npu"))."""
        for key in {(self.decode_on, True, 0, self._batch_bucket(1)), (self.base, False, 0, 0)}:
            self._program(key)
        if self.lay.double:
            self._program((self.base, False, 1, 0))
        if self.chunk_on in ("npu", "tensor"):
            self._program((self.chunk_on, False, 0, self.npu_chunk))
        elif npu_chunk and "npu" in self.eng.available:
            self._program(("npu", False, 0, npu_chunk))

    def _map_io(self, buf, lay):
        """Views of the pool's step inputs and outputs: each activation buffer's rows (ids, pos,
        rows, seq: [max_rows] int32; 1: memory/layout.py's double buffer), the block tables
        [max_seqs, max_blocks] and the logits [max_seqs, vocab]."""
        def io(name, n, dtype=np.int32, where=lay.io):
            return buf[where[name]: where[name] + n * np.dtype(dtype).itemsize].view(dtype)
        self.meta = [{k: io(k, lay.max_rows) for k in ("ids", "pos", "rows", "seq")}]
        self.tmask = io("tmask", 4 * lay.max_rows).reshape(lay.max_rows, 4)
        if lay.double:
            self.meta.append({k: io(k, lay.double_rows, where=lay.double)
                              for k in ("ids", "pos", "rows", "seq")})
        self.btab = io("btab", lay.max_seqs * lay.max_blocks).reshape(lay.max_seqs, lay.max_blocks)
        self.logits = io("logits", lay.max_seqs * lay.vocab, np.float32).reshape(lay.max_seqs, lay.vocab)

    def hidden_rows(self) -> np.ndarray | None:
        """A view of the pool [max_rows, dim]: the last step's final-normed hidden state of each
        row (the LM head's input: draft heads read it, policies/drafting.py), where this plan's
        decode steps write it (the GPU's or the CPU's kernels, the NPU's batch graphs); else None."""
        slot = self.eng.hidden_slot
        if slot is None or self.decode_on not in ("gpu", "cpu", "hcmp", "npu"):
            return None
        off, dim = self.lay.slots[slot], self.eng.cfg.dim
        return self.eng.arena.buf[off: off + 4 * dim * self.lay.max_rows].view(np.float32).reshape(-1, dim)

    @property
    def max_decode_rows(self) -> int:
        """A decode step's rows, at most (its logits' rows in the pool)."""
        return self.lay.max_seqs

    @property
    def trees(self) -> bool:
        """Whether decode steps can verify draft trees: their attention runs in the GPU's or the
        CPU's kernels (paged.cl tree_row) or the NPU's batch graphs (npu/ops.py _tree_keys)."""
        return self.decode_on in ("gpu", "cpu", "hcmp", "npu")

    @property
    def ran(self) -> collections.Counter:
        """"plan phase[ bucket]" -> steps run ("npu chunk 32", "gpu batch"): for status."""
        out = collections.Counter()
        for (plan, all_rows, _, bucket), n in self.steps.items():
            # (an hcmp batch's bucket is its CPU share: its steps are counted together)
            out[f"{plan} {'batch' if all_rows else 'chunk'}" + (f" {bucket}" if bucket and plan != "hcmp"
                                                                 else "")] += n
        return out

    # decode batch buckets (rows) that the NPU's static graphs run on a plan decoding on the GPU:
    # those the Service's auto timed faster there (Ghidorah's issue: measured, not assumed)
    npu_batches = frozenset()

    def _batch_key(self, rows: list) -> tuple:
        """The program of a decode batch of these rows: the plan's (hcmp: its share at the rows'
        mean position), or the NPU's static batch graph where npu_batches has their bucket."""
        on, n = self.decode_on, len(rows)
        if on == "gpu" and self.npu_batches and batch_bucket(n, self.lay.max_seqs) in self.npu_batches:
            on = "npu"
        pos = sum(r[1] for r in rows) / n if on == "hcmp" else 0.0
        return (on, True, 0, self._batch_bucket(n, pos, on))

    def _batch_bucket(self, n: int, pos: float = 0.0, on: str | None = None) -> int:
        """The static rows of a decode batch of n rows on a plan the NPU takes part in: the next
        power of two, at most max_seqs (0: the GPU's and CPU's programs take any n); on hcmp,
        the CPU's share at the rows' mean position pos (policies/arca.py share_key)."""
        on = on or self.decode_on
        if on == "hcmp":
            return share_key(band_of(self.hcmp_bands, pos))
        if on in ("gpu", "cpu"):
            return 0
        return batch_bucket(n, self.lay.max_seqs)

    def _program(self, key):
        if key not in self.programs:
            self.programs[key] = self._install(*key)
        return self.programs[key]

    def _install(self, plan: str, all_rows: bool, buffer: int = 0, bucket: int = 0):
        eng = self.eng
        pid, blob, procs = eng.program((plan, all_rows, buffer, bucket))
        actors = eng.processors()
        # one precision for every step; in a prefill chunk the GPU's linears stay f32 but at q8
        # (gpu/backend.py ACT_BITS) and the NPU's in bf16 at q16 and q8 (buckets.NPU_PREFILL_ACT)
        prec = self.precision
        ray.get([actors[p].install.remote(pid, blob, PRECISIONS[prec], prec) for p in procs])
        return pid, procs, StepProgram.from_bytes(blob).final

    def _check_step(self, rows: list, all_rows: bool, buffer: int, span, on):
        n = len(rows)
        if not 0 < n <= len(self.meta[buffer]["ids"]):
            raise ValueError(f"a step of {n} rows (at most {len(self.meta[buffer]['ids'])})")
        if span is not None and (buffer == 0 or not 0 <= span[0] < span[1] <= self.stages):
            raise ValueError(f"stages {span} of a step in buffer {buffer} ({self.stages} stages)")
        if on == "npu" and (all_rows or buffer or span or not self.npu_fits(rows)):
            raise ValueError(f"the NPU takes a prefill chunk of one sequence, at most {self.npu_chunk}"
                             f" rows from a block boundary, in the first buffer")

    def npu_fits(self, rows: list, bucket: int | None = None) -> bool:
        """Can a static chunk graph of `bucket` rows (the NPU's chunk rows) take these prefill
        rows: at most its bucket, of one sequence, starting at a block boundary (its K/V rows
        are written a whole block at a time, npu/segment.py)?"""
        bucket = self.npu_chunk if bucket is None else bucket
        return bool(bucket) and len(rows) <= bucket and rows[0][1] % self.lay.block_rows == 0 \
            and bucket % self.lay.block_rows == 0 and len({r[2] for r in rows}) == 1

    def _chunk_key(self, rows: list, buffer: int, span, on: str | None) -> tuple:
        """The program of a prefill chunk: the plan's (or `on`'s) where it takes these rows,
        else the base processor's."""
        later = on is None and rows[0][1] > 0 and not self.npu_later    # the plan's NPU: not there
        on = on or self.chunk_on
        if buffer or span is not None or on == self.base or on in ("gpu", "cpu"):
            return (on if on in ("gpu", "cpu") else self.base, False, buffer, 0)
        n = len(rows)
        if on == "seqcut":
            # its NPU parts are static buckets from the chunk's first row (whole blocks where
            # that starts one); its GPU margin writes K/V through the row map: n need not fill
            # a block (300 rows: 256 on the NPU, 44 on the GPU)
            parts, br = seq_parts(n), self.lay.block_rows
            if len(parts) > 1 and n <= self.lay.max_rows and self.npu_fits(rows, -(-n // br) * br):
                return ("seqcut", False, 0, n)
        elif on == "hybrid":
            if n <= MAX_CHUNK and bucket_for(n) <= self.lay.max_rows and self.npu_fits(rows, bucket_for(n)):
                return ("tensor", False, 0, bucket_for(n))
        elif self.npu_fits(rows) and (on != "npu" or n >= self.npu_from and not later):
            return (on, False, 0, self.npu_chunk)
        return (self.base, False, 0, 0)

    def step(self, rows: list, tables: dict, all_rows: bool, buffer: int = 0,
             span: tuple | None = None, on: str | None = None, tree: tuple | None = None) -> np.ndarray:
        """rows: [(token id, position, sequence slot)], tables: slot -> block ids. Returns the
        logits [N, V] (all_rows) or [1, V] of the last row, a view into the pool.
        buffer 1: a prefill chunk in the second activation buffer; span (lo, hi): only its stages
        lo .. hi-1 (of `self.stages`), the rest at later calls with the same rows, other steps
        in between (Agent.xpu §4.4: a proactive prefill stops between layers). The logits are
        the last stage's. A prefill chunk runs on the plan's chunk program where it fits, else
        on the base processor; on: that chunk program instead ("npu" must fit: npu_fits).
        tree (a decode step verifying draft trees, policies/drafting.py Tree): (each row's KV
        position [N], its tree entry [N, 4]: the keys it sees, actors/gpu/cl/paged.cl tree_row)."""
        n = len(rows)
        meta = self.meta[buffer]
        self._check_step(rows, all_rows, buffer, span, on)
        if tree is not None and not (all_rows and self.trees):
            raise ValueError("draft trees are verified in decode steps on the GPU's or the CPU's kernels")
        if all_rows:
            key = self._batch_key(rows)
        else:
            key = self._chunk_key(rows, buffer, span, on)
        prog = self._program(key)
        if span is None or span[0] == 0:
            self.steps[key] += 1             # a step's only bookkeeping: named when read
            self._write_rows(rows, tables, meta, all_rows, tree)
        # one row: its position is also pos0 (the fused decode kernels' RoPE and key count); a
        # static chunk's first position picks its KV-length bucket (npu/segment.py)
        static = key[3] and not all_rows
        self._run(prog, n, int(rows[0][1]) if n == 1 or static else 0, self.precision, span,
                  key if static and rows[0][1] == 0 else None)
        return self.logits[:n if all_rows else 1]

    def whole_chunk_s(self, n: int, slot: int) -> float | None:
        """Seconds a prompt's first chunk of n rows takes where this plan runs it, if that is a
        static chunk program (it cannot stop between layers) that ran such a chunk before: the
        least of its latest 5 (a first run's set-up does not count once others ran); else None."""
        key = self._chunk_key([(0, i, slot) for i in range(n)], 0, None, None)
        times = self.first_s.get(key) if key[3] else None
        return min(times) if times else None

    def _write_rows(self, rows: list, tables: dict, meta: dict, all_rows: bool, tree):
        """A step's row metadata and block tables into the pool (step's arguments)."""
        n, br = len(rows), self.lay.block_rows
        for slot, blocks in tables.items():
            self.btab[slot, :len(blocks)] = blocks
        tok, pos, seq = (np.fromiter((r[i] for r in rows), np.int32, n) for i in range(3))
        meta["ids"][:n], meta["pos"][:n], meta["seq"][:n] = tok, pos, seq
        at = pos if tree is None else tree[0]
        meta["rows"][:n] = self.btab[seq, at // br] * br + at % br
        if all_rows:
            self.tmask[:n] = 0 if tree is None else tree[1]
            if self.decode_on == "hcmp":
                self.tmask[:n] = hcmp_entries(pos, seq, self.tmask[:n])

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
        # the static chunk graphs: the plan's, or the NPU's alone (not past a small context)
        if self.npu_chunk and self.npu_chunk <= lay.context:
            n = self.npu_chunk
            blocks = [b % lay.kv_blocks for b in range(-(-n // lay.block_rows))]
            self.step([(0, i, 0) for i in range(n)], {0: blocks}, all_rows=False,
                      on=None if self.chunk_on != self.base else "npu")

    def warm_npu(self):
        """The NPU's attention graphs for every KV-length bucket (policies/buckets.KV_STEP rows),
        compiled here rather than inside requests (warm() compiles the first): one later chunk
        run (its per-layer graphs are made at the first), the other buckets compiled unrun."""
        lay, n = self.lay, self.npu_chunk
        on = None if self.chunk_on != self.base else "npu"
        later = list(range(KV_STEP, lay.context - n + 1, KV_STEP))
        if not later:
            return
        blocks = [b % lay.kv_blocks for b in range(-(-(later[0] + n) // lay.block_rows))]
        self.step([(0, later[0] + i, 0) for i in range(n)], {0: blocks}, all_rows=False, on=on)
        if later[1:]:
            ray.get(self.eng.processors()["npu"].compile_kv.remote(later[1:]))

    def chunks_on(self, on: str):
        """Prefill chunks from now on run on `on`: the NPU's static graphs ("npu", installed at
        start with npu_chunk) or the base processor, whose NPU chunk graphs then go (they were
        only timed: Service's auto)."""
        if on == "npu":
            self.chunk_on = "npu"
            return
        key = ("npu", False, 0, self.npu_chunk)
        if key in self.programs:
            pid, procs, _ = self.programs.pop(key)
            actors = self.eng.processors()
            ray.get([actors[p].uninstall.remote(pid) for p in procs])
        self.chunk_on, self.npu_chunk = self.base, 0

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

    def time_verify(self, rows: int, pos: int, on: str | None = None, share: float | None = None,
                    reps: int = 3) -> float:
        """Seconds of a verifying step (time_step): one sequence's `rows` rows at positions
        pos .. pos+rows-1 (its last token and its drafts, a chain), in slot 0 over blocks 0 ..
        (ARCA times these: Service's _time_hcmp)."""
        lay = self.lay
        blocks = list(range(-(-(pos + rows) // lay.block_rows)))
        if pos + rows > lay.context or len(blocks) > lay.kv_blocks:
            raise ValueError(f"a verifying step of {rows} rows at {pos} past the pool's context")
        return self.time_step([(0, pos + j, 0) for j in range(rows)], {0: blocks}, on, share, reps)

    def time_step(self, rows: list, tables: dict, on: str | None = None, share: float | None = None,
                  reps: int = 3) -> float:
        """Seconds of a decode step of these rows (the fastest of reps, after one untimed run that
        installs its program; no request may hold their blocks) on the plan's decode program,
        or on `on`'s ("gpu", "cpu", "npu": a processor alone, the NPU in its static batch
        bucket), the hcmp plan's at the CPU's `share`."""
        saved = self.decode_on, self.hcmp_bands, self.npu_batches
        self.decode_on, self.npu_batches = on or self.decode_on, frozenset()
        if share is not None:
            self.hcmp_bands = [(0, share)]
        try:
            best = float("inf")
            for i in range(reps + 1):
                t = time.perf_counter()
                self.step(rows, tables, all_rows=True)
                best = min(best, time.perf_counter() - t) if i else best
            return best
        finally:
            self.decode_on, self.hcmp_bands, self.npu_batches = saved

    def keep_batches(self):
        """Uninstall every decode-batch program but those the plan's steps use now (the shares,
        processors and NPU batch graphs only timed: their memory in the processor actors)."""
        keep = {(self.decode_on, True, 0, share_key(s)) for _, s in self.hcmp_bands} \
            if self.decode_on == "hcmp" else {k for k in self.programs if k[0] == self.decode_on
                                              or k[0] == "npu" and k[3] in self.npu_batches}
        actors = self.eng.processors()
        for key in [k for k in self.programs if k[1] and k not in keep]:
            pid, procs, _ = self.programs.pop(key)
            ray.get([actors[p].uninstall.remote(pid) for p in procs])

    # -- one sequence, offline (Pool.generate_ids / logits_after: tests and benchmarks) ----------
    def generate(self, ids: list, max_tokens: int, sample, stop_ids=(), chunk: int = MAX_CHUNK,
                 slot: int = 0) -> tuple:
        """One sequence in `slot` over blocks 0 .. (no request may hold them): its prompt in
        chunks of `chunk` rows, then decode steps of one row, each token from sample(logits).
        -> (tokens, seconds of the prefill, seconds of the decode)."""
        lay = self.lay
        blocks = list(range(-(-min(len(ids) + max_tokens, lay.context) // lay.block_rows)))
        if len(ids) >= lay.context or len(blocks) > lay.kv_blocks:
            raise ValueError(f"a prompt of {len(ids)} tokens in a context of {lay.context}")
        t0 = time.perf_counter()
        for lo in range(0, len(ids), chunk):
            logits = self.step([(t, lo + i, slot) for i, t in enumerate(ids[lo: lo + chunk])],
                               {slot: blocks}, all_rows=False)
        t1 = time.perf_counter()
        out = [sample(logits[0])]
        while out[-1] not in stop_ids and len(out) < max_tokens and len(ids) + len(out) < lay.context:
            logits = self.step([(out[-1], len(ids) + len(out) - 1, slot)], {slot: blocks}, all_rows=True)
            out.append(sample(logits[0]))
        return out, t1 - t0, time.perf_counter() - t1

    def logits_after(self, ids: list, slot: int = 0) -> np.ndarray:
        """Teacher-forced logits [len(ids), V], one decode step a token (numerical checks)."""
        blocks = list(range(-(-len(ids) // self.lay.block_rows)))
        return np.stack([self.step([(t, pos, slot)], {slot: blocks}, all_rows=True)[0].copy()
                         for pos, t in enumerate(ids)])

    def _run(self, prog, n: int, pos0: int, precision: str, span=None, first=None):
        """first: the key of a static chunk program running a prompt's first chunk (the NPU's
        whole-model graph, policies/buckets.whole_graph): its time is kept (whole_chunk_s)."""
        pid, procs, final = prog
        t = time.perf_counter()
        run_step(self.lay, self.ctl, self.words, self.predict, pid, procs, final, n, pos0,
                 precision, self._check_errors, span)
        if first is not None:
            self.first_s[first].append(time.perf_counter() - t)

    def reinstall(self):
        """Installs every program again where an actor lost them (a restarted actor; the others
        keep theirs), from the bytes the pool keeps (the planner may be stopped)."""
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
