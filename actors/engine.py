"""The engine's step (Agent.xpu §4.1, §4.3; nano-vllm's LLMEngine.step), on the service's loop
thread: schedule -> run (actors/runner.py) -> postprocess -> publish.

Each step runs one prefill chunk of the first request that needs one (prefill runs singly, in
chunks) and then one decode step of every prefilled request (continuous batching: requests join
and leave the batch at every step); the sampled tokens become the requests' text, and requests
end where they end. Every request is one Sequence (policies/request.py); the service
(actors/service.py) adds them, and tells their clients through `publish`.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from socllm.policies.drafting import Tree, step_rows, walk
from socllm.policies.request import QueueFull, Sequence

from socllm.actors.pool import _trim
from socllm.actors.runner import ProcessorLost

KEEP_ENDED = 256              # ended requests kept in the table for late polls and status
CHECK_S = 1.0                 # how often a busy loop looks for dead actors and gone clients
TRIM_KEEP = 64                # free KV blocks kept written on top of the stack (the next taken),
                              # at most an eighth of them


class Engine:
    on_release = None        # called idle for prefix_cache_idle_s, as the cache goes (the service's)
    released = False         # that release happened in this idle spell

    def __init__(self, config, pool, runner, scheduler, metrics, publish, speculator=None):
        """pool: actors/pool.py's Pool (the pool and its actors); publish(seq): tell seq's
        client that it changed (called on this thread); speculator: policies/drafting.py's
        (None: no drafts)."""
        self.config, self.pool, self.runner, self.scheduler = config, pool, runner, scheduler
        self.metrics, self.publish, self.speculator = metrics, publish, speculator
        # the rows' final hidden states in the pool, for draft heads (None: no heads, or a plan
        # whose decode steps do not write them)
        self.hidden = runner.hidden_rows() if speculator and speculator.heads else None
        self.table: dict = {}                 # id -> Sequence, ended ones too (KEEP_ENDED)
        self.slots = list(range(config.max_seqs))[::-1]   # free rows of the block tables
        self.cv = threading.Condition()       # guards the table, the scheduler and the slots
        self.stopping = False
        self.part = None             # a prefill chunk stopped between spans (_prefill_spans)
        self.stage_s = 1e-4          # its seconds per stage and row, learned
        self.stopped = False         # the last step stopped a chunk for a reactive arrival
        self.doing = "idle"          # the step now: what a new request waits behind
        self.last_step = time.monotonic()     # when the last step ended
        self.next_check, self.idle_since = 0.0, None   # idle since (None: busy): _give_back
        self.ends = self.trimmed_at = 0    # requests ended; how many when the idle loop last
                                           # trimmed the heap
        self.token_times: collections.deque = collections.deque()   # tokens/s over a minute
        # prefill chunks, decode steps (of which in the step's kernels: the rest is sampling
        # and text), rows decoded
        self.times = dict.fromkeys(("prefill_chunks", "prefill_s", "prefill_stops", "decode_steps",
                                    "decode_rows", "decode_s", "decode_kernels_s"), 0)
        self.running: list = []      # the sequences of the phase running now (faults end them)
        self.recoveries: list = []   # processor actors that died and came back
        self.abandoned = 0           # requests cancelled because their client stopped polling
        self.masker = ThreadPoolExecutor(1, thread_name_prefix="socllm-masks")   # grammar masks

    # -- the loop ------------------------------------------------------------------------------
    def run(self):
        while not self.stopping:
            batch, self.running = self.schedule(), []
            try:
                self.watch(batch)
                if batch:
                    self.idle_since = None       # busy: an idle spell starts again after it
                    self.step(batch)
            except ProcessorLost as ex:     # redone at the next step, once it is back
                self.recover(ex.names, self.running)
            except Exception as ex:         # one bad step fails its requests, never the service
                traceback.print_exc()
                self.fail(self.running, ex)

    def step(self, batch):
        """One prefill chunk, then one decode batch (skipped once when the chunk stopped
        between layers for a reactive arrival: that one is scheduled first)."""
        self.running = batch.prefill[:1]
        if batch.prefill and self.prefill(batch.prefill) and not self.stopped:
            self.stopped, self.last_step = True, time.monotonic()
            return
        self.stopped, self.running = False, batch.decode
        if batch.decode:
            self.decode(batch.decode)
        self.last_step = time.monotonic()

    def schedule(self):
        """End what was cancelled, ask the policy for the next batch, give running sequences a
        row of the block tables; idle, wait for a request."""
        with self.cv:
            for seq in [s for s in self.scheduler.running if s.stop_asked]:
                self.end(seq, "cancelled", seq.stop_asked)
            batch = self.scheduler.schedule()
            for seq in batch.preempted:
                seq.state = "waiting"
                self._free_slot(seq)
            if not batch:
                self.doing = "idle"
                self.cv.wait(0.5)
            for seq in self.scheduler.running:
                if seq.slot is None:
                    seq.slot = self.slots.pop()
        return batch

    def watch(self, batch):
        """Idle, or every CHECK_S: cancel the requests whose client is gone (no poll open and
        none for abandon_s), give memory back, and raise ProcessorLost for an actor that died
        outside a step."""
        now = time.monotonic()
        if batch and now < self.next_check:
            return
        self.next_check = now + CHECK_S
        with self.cv:
            for seq in self.scheduler.running:
                if not seq.polls and not seq.stop_asked and now - seq.last_poll > self.config.abandon_s:
                    seq.stop_asked = "abandoned"
                    self.abandoned += 1
            # idle: nothing runs or waits now (the batch may be older than a new arrival)
            released = self._give_back(not batch and not self.scheduler.running and
                                       not any(s.state == "waiting" for s in self.table.values()))
        if released:
            if self.on_release is not None:
                self.on_release()    # outside the lock: the requests' threads take it
            _trim()                  # the heap pages freed by the release, back to the OS
        lost = self.pool.lost()
        if lost:
            raise ProcessorLost(lost)

    def _give_back(self, idle: bool) -> bool:
        """Memory no request uses, back to the OS: the pages of free KV blocks (memory/blocks.py
        trim; between steps, so none is taken meanwhile) and, idle after requests ended, the
        heap pages they freed (every thread's malloc arena: ~33 MB after a few hundred). Once
        idle for prefix_cache_idle_s: the prefix cache's blocks too, and the free ones kept
        written. -> whether that release happened now (once an idle spell: on_release follows)."""
        kv, now = self.scheduler.kv, time.monotonic()
        if not idle:
            self.idle_since = None
        elif self.idle_since is None:            # an idle spell starts
            self.idle_since, self.released = now, False
        window = getattr(self.config, "prefix_cache_idle_s", 0)
        release = bool(idle and window and not self.released and now - self.idle_since >= window)
        if release:
            kv.drop_cached()
            self.released = True
        if trimmed := kv.trim(0 if release else min(TRIM_KEEP, kv.n_blocks // 8)):
            self.pool.release_kv(trimmed)
        if idle and self.trimmed_at != self.ends:
            self.trimmed_at = self.ends
            _trim()
        return release

    # -- faults --------------------------------------------------------------------------------
    def fail(self, running: list, ex: Exception):
        if self.part is not None:
            running, self.part = [*running, self.part["seq"]], None
        for seq in running:
            if not seq.ended:
                self.end(seq, "failed", "error", f"{type(ex).__name__}: {ex}")

    def recover(self, names: list, running: list):
        """A processor actor died (DESIGN.md §5): Ray restarts it and its constructor attaches
        the pool again; the programs are installed in it again and the loop goes on. Nothing of
        the lost step was accepted, so the next step redoes it: it rewrites the same KV rows with
        the same values, and the KV of earlier steps is in the pool, which outlived the process.
        A chunk suspended between layers starts over (a span cut short may have updated its
        activations in place)."""
        t0 = time.monotonic()
        self.part = None
        try:
            restart_s = self.pool.revive(names)
            self.runner.reinstall()
        except Exception as ex:
            traceback.print_exc()
            self.fail(running, ex)
            return
        now = time.monotonic()
        self.recoveries.append({"processors": names, "at": time.time(), "restart_s": round(restart_s, 2),
                                "recovery_s": round(now - t0, 2),
                                # from the end of the last step that ran to now: the service's gap
                                "stalled_s": round(now - self.last_step, 2) if running else None})

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self, ready: list) -> bool:
        """One prefill chunk of the first request in `ready` (the policy's order). A policy with
        a slice_s runs proactive chunks in the second activation buffer, a span of layers at a
        time, and stops between spans when it says a reactive request waits; the chunk resumes
        at a later step (unless its request lost its blocks meanwhile). Returns True if the
        chunk stopped before its end."""
        seq, part = ready[0], self.part
        if part is not None and (part["seq"].ended or part["key"] != _chunk_key(part["seq"])
                                 or part["seq"] not in self.scheduler.running):
            part = self.part = None          # ended, cancelled or preempted: its rows are gone
        if part is not None and part["seq"] in ready and seq.priority != "reactive":
            seq = part["seq"]                # a suspended chunk goes on before newer ones
        if part is not None and part["seq"] is not seq and seq.priority != "reactive":
            # an aged chunk while the second buffer holds one the policy defers: the deferred one
            # gives up its buffer and starts over later (at most one chunk's work), so that no
            # proactive chunk ever runs whole where a reactive arrival would wait for all of it
            part = self.part = None
        # reactive chunks run whole in the first buffer (and those whose every row's output
        # is asked for: prompt_logprobs, an embedding)
        if self.scheduler.slice_s is None or seq.priority == "reactive" or not self.runner.meta[1:] \
                or seq.every_row or part is None and self._whole_within_bound(seq):
            self._prefill_chunk(seq, ready)
            return False
        return self._prefill_spans(seq)

    def _whole_within_bound(self, seq: Sequence) -> bool:
        """Does a proactive prompt's first chunk run whole on the plan's static chunk program
        (the NPU's whole-model graph) in no longer than a reactive arrival may wait (the policy's
        bound_s, Agent.xpu §4.4 ②)? Learned from such chunks that ran (runner.whole_chunk_s)."""
        if seq.computed or seq.embed is not None:
            return False
        n = min(len(seq.prompt) + len(seq.tokens), self.config.prefill_chunk)
        took = self.runner.whole_chunk_s(n, seq.slot)
        return took is not None and took <= self.scheduler.bound_s

    def _start_chunk(self, seq: Sequence, rows_max: int) -> tuple:
        ids = seq.prompt + seq.tokens     # a preempted request prefills its tokens too
        lo = seq.computed
        hi = min(len(ids), lo + rows_max)
        seq.state = "prefilling"
        if seq.prefill_start is None:
            seq.prefill_start = time.monotonic()
            self.metrics.prefill_started(seq)
        return [(ids[i], i, seq.slot) for i in range(lo, hi)], hi == len(ids)

    def _end_chunk(self, seq: Sequence, rows: list, last: bool, logits, t0: float | None):
        """t0: the chunk's start (None: a chunk whose time another sequence's call counts)."""
        seq.computed += len(rows)
        self._name_blocks(seq)
        if last and seq.embed is not None:
            self._embedded(seq)
        elif last:
            self.accept(seq, self._sample(seq, logits[0]))
        if t0 is not None:
            self.times["prefill_chunks"] += 1
            self.times["prefill_s"] += time.perf_counter() - t0

    def _prefill_chunk(self, seq: Sequence, ready: list):
        t0 = time.perf_counter()
        if seq.embed is not None:
            return self._prefill_embeds([seq, *(s for s in ready if s is not seq and s.embed is not None
                                                and s.priority == seq.priority)], t0)
        if seq.every_row:
            return self._prefill_logged(seq, t0)
        rows, last = self._start_chunk(seq, self.config.prefill_chunk)
        self.doing = f"chunk {seq.priority} {len(rows)}"
        # the plan's chunk program where it takes these rows (runner.py), else the base processor
        logits = self.runner.step(rows, {seq.slot: seq.blocks}, all_rows=False)
        self._end_chunk(seq, rows, last, logits, t0)

    def _prefill_logged(self, seq: Sequence, t0: float):
        """A prefill chunk whose every row's logits are kept (prompt_logprobs): at most a decode
        batch's rows, as one (the rows of one sequence, as a step verifying drafts runs them);
        each row's gives the logprob of the prompt's next token. A request re-prefilled after a
        preemption logs only the rows it had not."""
        rows, last = self._start_chunk(seq, min(self.config.prefill_chunk, self.runner.lay.max_seqs))
        self.doing = f"chunk {seq.priority} {len(rows)} (prompt logprobs)"
        logits = self.runner.step(rows, {seq.slot: seq.blocks}, all_rows=True)
        logged = seq.sampler.prompt_logprobs
        for i, (_, pos, _) in enumerate(rows):
            if pos == len(logged) and pos + 1 < len(seq.prompt):
                seq.sampler.log_prompt(logits[i], seq.prompt[pos + 1])
        self._end_chunk(seq, rows, last, logits[len(rows) - 1:], t0)

    def _prefill_embeds(self, seqs: list, t0: float):
        """One chunk of embeddings' prompts: the rows of as many of seqs as a chunk holds, in
        order (no logits are read, so several requests' rows share it), on the base processor's
        chunk program, whose final norm writes every row's hidden state to the pool
        (runner.hidden_rows), each request's pooled at once."""
        parts, room = [], self.config.prefill_chunk
        for seq in seqs:
            if room:
                rows, last = self._start_chunk(seq, room)
                parts.append((seq, rows, last))
                room -= len(rows)
        rows = [r for _, rs, _ in parts for r in rs]
        self.running = [seq for seq, _, _ in parts]     # a failed step fails them all
        self.doing = f"chunk {seqs[0].priority} {len(rows)} (embedding, {len(parts)} requests)"
        self.runner.step(rows, {seq.slot: seq.blocks for seq, _, _ in parts}, all_rows=False,
                         on=self.runner.base)
        at = 0
        for i, (seq, rs, last) in enumerate(parts):
            self._pool(seq, rs, at)
            self._end_chunk(seq, rs, last, None, t0 if i == len(parts) - 1 else None)
            at += len(rs)

    def _pool(self, seq: Sequence, rows: list, at: int):
        """An embedding's rows (the step's rows at .. at + len(rows)): each prompt row's
        final-normed hidden state (the LM head's input), summed ("mean") or the last kept
        ("last"), each row once (a request re-prefilled after a preemption pools only the rows
        it had not)."""
        hidden = self.runner.hidden_rows()
        for i, (_, pos, _) in enumerate(rows):
            if pos == seq.embedded:
                h = hidden[at + i].astype(np.float64)
                seq.embedding = h if seq.embed == "last" or seq.embedding is None else seq.embedding + h
                seq.embedded += 1

    def _embedded(self, seq: Sequence):
        """The embedding's vector, L2-normalized (as OpenAI's and llama-server's are); the
        request ends without a reply."""
        v = seq.embedding / (seq.embedded if seq.embed == "mean" else 1)
        norm = float(np.linalg.norm(v))
        seq.embedding = (v / norm if norm > 0 else v).astype(np.float32).tolist()
        self.end(seq, "finished", "stop")

    def _prefill_spans(self, seq: Sequence) -> bool:
        """Agent.xpu §4.4 ②: spans of about slice_s (the per-stage time learned from earlier
        spans), a check for a reactive arrival after each."""
        t0 = time.perf_counter()
        if self.part is None:
            rows, last = self._start_chunk(seq, self.runner.lay.double_rows)
            self.part = {"seq": seq, "rows": rows, "last": last, "stage": 0, "key": _chunk_key(seq)}
        part, stages = self.part, self.runner.stages
        rows = part["rows"]
        while True:
            lo = part["stage"]
            k = max(1, int(self.scheduler.slice_s / max(1e-6, self.stage_s * len(rows))))
            hi = min(stages, lo + k)
            t = time.perf_counter()
            self.doing = f"span {seq.priority} {len(rows)} {lo}-{hi}"
            logits = self.runner.step(rows, {seq.slot: seq.blocks}, all_rows=False, buffer=1,
                                      span=(lo, hi))
            per = (time.perf_counter() - t) / ((hi - lo) * len(rows))
            self.stage_s += 0.3 * (per - self.stage_s)       # seconds per stage and row
            part["stage"] = hi
            if hi == stages:
                break
            if self.scheduler.preempts_prefill():
                self.times["prefill_s"] += time.perf_counter() - t0
                self.times["prefill_stops"] += 1
                return True
        self.part = None
        self._end_chunk(seq, rows, part["last"], logits, t0)
        return False

    # -- decode and postprocess ----------------------------------------------------------------
    def decode(self, batch: list):
        """One decode step of every sequence in the batch, with its drafted tokens as more rows
        (policies/drafting.py: the step verifies them; the rows of rejected ones are written
        past the sequence's length, and the next step writes over them)."""
        batch = self._fit(batch)
        drafts = self._drafts(batch)
        rows, tree = step_rows(batch, drafts)
        self.doing = f"decode {len(rows)}"
        t0 = time.perf_counter()
        # the constrained rows' masks are computed on a CPU thread while the step runs
        masks = [s.constraint for s in batch if s.constraint is not None]
        filling = self.masker.submit(_fill, masks) if masks else None
        logits = self.runner.step(rows, {s.slot: s.blocks for s in batch}, all_rows=True, tree=tree)
        if filling is not None:
            filling.result()
        t1 = time.perf_counter()
        r = 0
        for seq, d in zip(batch, drafts):
            r += seq.lag                     # rows fed again: their K/V are in place now
            seq.computed, seq.lag = seq.computed + seq.lag, 0
            self._verify(seq, d, logits[r: r + 1 + len(d)], r)
            r += 1 + len(d)
        t = self.times
        t["decode_steps"] += 1
        t["decode_rows"] += len(rows)
        t["decode_kernels_s"] += t1 - t0
        self.scheduler.observe(len(rows), sum(pos + 1 for _, pos, _ in rows), t1 - t0)
        t["decode_s"] += time.perf_counter() - t0
        if self.speculator:         # a step's cost: its kernels and the verification of its rows
            self.speculator.costs.observe(len(rows), time.perf_counter() - t0)

    def _fit(self, batch: list) -> list:
        """The batch whose rows (each sequence's last token and those it feeds again) fit a step;
        a sequence left out feeds its rows as a prefill chunk instead (not `prefilled`)."""
        over = sum(1 + s.lag for s in batch) - self.runner.max_decode_rows
        if over <= 0:
            return batch
        out = []
        for s in reversed(batch):
            if over > 0 and s.lag:
                over -= 1 + s.lag
                s.lag = 0
            else:
                out.append(s)
        return out[::-1]

    def _drafts(self, batch: list) -> list:
        """Each sequence's drafted tokens for this step (none without a speculator), as many as
        the batch has room for."""
        if not self.speculator:
            return [[]] * len(batch)
        drafts = self.speculator.drafts(batch, self.pool.context)
        if any(drafts):
            drafts = self._room(batch, drafts)
            # a constrained row's drafts end where its grammar would refuse one; its masks for
            # the rows after each drafted token are filled with the step's (policies/grammar.py)
            drafts = [s.constraint.set_draft(d) if s.constraint is not None else d
                      for s, d in zip(batch, drafts)]
        return drafts

    def _room(self, batch: list, drafts: list) -> list:
        """Drafts cut to the KV blocks the pool can give their rows now."""
        kv, out = self.scheduler.kv, []
        with self.cv:
            for s, d in zip(batch, drafts):
                k = len(d)
                while k and not kv.can_grow(s.blocks, s.rows + k):
                    k -= 1
                if k:
                    kv.grow(s.blocks, s.rows + k)
                out.append(d[:k] if k else [])
        return out

    def _verify(self, seq: Sequence, drafted: list, logits, row: int):
        """A sequence's rows of the step (from `row` on): each row's token sampled as plain
        decoding samples it; the next row counts only while the token sampled equals the one
        drafted there. The last row's hidden state is kept for the draft heads."""
        if isinstance(drafted, Tree):
            return self._verify_tree(seq, drafted, logits, row)
        accepted = 0
        for j in range(len(drafted) + 1):
            seq.computed += 1
            self._name_blocks(seq)
            tok = self._sample(seq, logits[j])
            self.accept(seq, tok)
            if seq.ended or j == len(drafted) or tok != drafted[j]:
                break
            accepted += 1
        if self.speculator:
            self.speculator.verified(seq, len(drafted), accepted)
            if seq.spec is not None:
                seq.spec.hidden = None if self.hidden is None else self.hidden[row + j].copy()

    def _verify_tree(self, seq: Sequence, tree: Tree, logits, row: int):
        """A draft tree's rows (policies/drafting.py Tree; logits [1 + len(tree)], the root's
        first): from the root, each row's token sampled as plain decoding samples it, then on to
        the child drafted with that token, if any. A path off the tree's chain leaves its rows'
        K/V away from their positions: they are fed again at the next step (lag)."""
        def sample(node: int):
            if tree.in_place(node):
                seq.computed += 1
                self._name_blocks(seq)
            else:
                seq.lag += 1
            tok = self._sample(seq, logits[node + 1])
            self.accept(seq, tok)
            return None if seq.ended else tok

        path, trials = walk(tree, sample)
        self.speculator.verified(seq, len(tree), len(path) - 1, trials)
        if seq.spec is not None:
            seq.spec.hidden = None if self.hidden is None else self.hidden[row + path[-1] + 1].copy()

    @staticmethod
    def _sample(seq: Sequence, logits):
        """The next token from a row's logits [V]: under its grammar's mask, if it has one
        (policies/grammar.py: this row only), by its own sampler."""
        c = seq.constraint
        if c is None:
            return seq.sampler(logits)
        tok = seq.sampler(c.apply(logits))
        c.take(tok)
        return tok

    def _name_blocks(self, seq: Sequence):
        """Its blocks filled by now go into the prefix cache (memory/blocks.py), for later
        requests that start with the same tokens (a chat's next turn, an agent's next call)."""
        kv = self.scheduler.kv
        if seq.computed // kv.block_rows > len(seq.names):
            kv.publish(seq.blocks, seq.names, seq.ids, seq.computed)

    def accept(self, seq: Sequence, tok: int):
        """Postprocess one sampled token: its text to the client, the request ended where it
        ends."""
        now = time.monotonic()
        if seq.first_token is None:
            seq.first_token = now
        seq.last_token = now
        seq.state = "decoding"
        self.metrics.token(seq, now)
        self.token_times.append(now)
        seq.tokens.append(tok)
        pool, stops = self.pool, seq.stops
        if tok in pool.stop_ids and not seq.ignore_eos or tok in (seq.params.stop_token_ids or ()):
            reason = "stop"
        else:
            self._emit(seq, stops.feed(seq.decoder.feed(tok)))
            reason = "stop" if stops.hit else "length" if (
                len(seq.tokens) >= seq.params.max_tokens or seq.rows >= pool.context) else None
        if reason:
            if not stops.hit:
                self._emit(seq, stops.feed(seq.decoder.flush()) + stops.flush())
            self.end(seq, "finished", reason)

    def _emit(self, seq: Sequence, piece: str):
        if piece:
            seq.text += piece
            seq.pieces.append(piece)
            self.publish(seq)

    # -- the table -----------------------------------------------------------------------------
    def add(self, *seqs: Sequence, bound: bool = True):
        """New requests, queued together (raises ValueError for one that could never fit,
        QueueFull where the queue is full: then none queues)."""
        with self.cv:
            waiting = sum(s.state == "waiting" for s in self.table.values())
            if bound and waiting >= self.config.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting to start, the most this service "
                                f"queues (--max-waiting): try again later")
            for seq in seqs:
                self.scheduler.check(seq)
            for seq in seqs:
                seq.arrived_during = self.doing
                self.scheduler.add(seq)
                self.table[seq.id] = seq
                self.metrics.arrived(seq)
            self.cv.notify()

    def cancel(self, seq: Sequence):
        """A waiting request leaves the queue now; a running one before its next step."""
        with self.cv:
            if seq.state == "waiting":
                self.end(seq, "cancelled", "cancelled")
            else:
                seq.stop_asked = "cancelled"
                self.cv.notify()

    def end(self, seq: Sequence, state: str, reason: str, error: str | None = None):
        """End a request: its blocks and its row of the block tables are free at once."""
        with self.cv:
            seq.end(state, reason, error)
            self.ends += 1
            self.scheduler.finish(seq)
            self._free_slot(seq)
            self.metrics.ended(seq)
            ended = [s for s in self.table.values() if s.ended]
            for old in ended[:max(0, len(ended) - KEEP_ENDED)]:
                del self.table[old.id]
        self.publish(seq)

    def _free_slot(self, seq: Sequence):
        if seq.slot is not None:
            self.slots.append(seq.slot)
            seq.slot = None

    def stop(self):
        self.stopping = True
        with self.cv:
            self.cv.notify_all()


def _fill(constraints: list):
    for c in constraints:
        c.fill()


def _chunk_key(seq: Sequence) -> tuple:
    """What a suspended chunk's rows depend on: where its prefill was, its row, its blocks."""
    return seq.computed, seq.slot, tuple(seq.blocks)

