"""Paged KV (Transformer-Lite §2.3, in place; vLLM's block tables) and the prefix cache over it.

The pool's KV region is fixed-size blocks of BLOCK_ROWS rows of every layer's K and V. A sequence
holds a block table, the ids of its blocks in order: its row p lives in block table[p //
BLOCK_ROWS], row p % BLOCK_ROWS. Blocks are taken as a sequence grows and given back when it ends;
nothing is ever copied between them.

Prefix cache (vLLM's automatic prefix caching, in nano-vllm's form): a full block is named by a
hash chained over every token before it and its own (`chain`). Once a block's rows are computed its
name is published; a later request whose prompt starts with the same tokens takes the same blocks
(a reference each) and prefills only the rest. A block is never written once full, so sharing it
needs no copy. A block whose last reference goes keeps its K/V and its name on an LRU list and is
taken back on a hit, or handed out blank (evicted) only when no never-named block is left. Past
the last whole block that matches, an idle block after the same prefix whose first tokens are the
request's next ones is taken over (`_take_over`): a chat's next turn reuses the rows of the last
turn's partly filled block, token by token.
One cache for every request of every client (llama.cpp's per-slot caches miss across agents,
llama.cpp #22942); a hit is checked token by token, never on a hash alone (#27148).
Eviction order: blocks never hit go first, least recently released first (a sequence's blocks
from the first of its run on: `_take`); blocks that were hit (a system prompt, a tool list, a
chat's history: what every call resends) go only when no other is left (mlx-lm's and SGLang's
orders). Blocks are taken in runs of consecutive ids, for the attention kernels' reads (`_take`).

Memory: the KV region is reserved whole, but a page costs memory only once written. Named blocks
nobody holds are kept up to `cache_max` (the service's --prefix-cache-mb); past it the least
recently released go (in the eviction order above) to the free stack. Free blocks that were written
and sit below the stack's top `keep` are handed to `trim`, whose caller gives their pages back to
the OS (actors/pool.py release_kv): without both, a busy service's cache grew until every block
had been written, and the whole region stayed resident (512 MB of K/V for the default model). A
service idle for a while lets the whole cache go (`drop_cached`), as Ollama unloads an idle model.

This is the bookkeeping only (no Ray, no kernels): the tables themselves are written into the
pool by the runner each step, where every processor's attention reads them.
"""
from __future__ import annotations

from collections import OrderedDict

BLOCK_ROWS = 16             # rows of a block (a multiple of 8: the GPU reads keys 8 at a time)


def blocks_for(rows: int, block_rows: int = BLOCK_ROWS) -> int:
    return -(-rows // block_rows)


def chain(parent: int | None, tokens: tuple) -> int:
    """A full block's name: its tokens and, through parent (the previous block's name), every
    token before them. Python's tuple hash: the cache lives in one process."""
    return hash((parent, tokens))


class BlockPool:
    def __init__(self, n_blocks: int, block_rows: int = BLOCK_ROWS, cache: bool = True,
                 cache_max: int | None = None):
        """cache_max: the most named blocks kept that no sequence holds (None: every block)."""
        if n_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {n_blocks}")
        self.n_blocks, self.block_rows, self.cache = n_blocks, block_rows, cache
        self.cache_max = n_blocks if cache_max is None else cache_max
        self.written: set = set()                 # free blocks whose pages may be resident
        self.trimmed = 0                          # blocks handed to trim() so far
        self.dropped = self.drops = 0             # cached blocks drop_cached() let go; its calls
        # never named (or evicted): a stack (a dict in order, its last key the top), so that the
        # pages a busy service touches stay the few it needs at its peak (a queue would walk
        # through every page of the region)
        self.free: dict = dict.fromkeys(range(n_blocks - 1, -1, -1))
        self.released = [0] * n_blocks            # which release() left each block idle
        self.releases = 0
        # named blocks no sequence holds, least recently released first: never hit, then hit
        self.idle: tuple = (OrderedDict(), OrderedDict())
        self.refs = [0] * n_blocks                # sequences holding each block
        self.name: list = [None] * n_blocks       # block -> (name, its tokens, parent's name)
        self.tail: dict = {}                      # idle partial block -> (parent's name, tokens)
        self.children: dict = {}                  # parent's name -> blocks after it (both kinds)
        self.hit_count = [0] * n_blocks
        self.by_name: dict = {}                   # name -> block
        self.queries = self.hits = self.evicted = 0     # prompt rows asked for / found / blocks

    @property
    def n_free(self) -> int:
        """Blocks a sequence could take now: blank ones and named ones nobody holds."""
        return len(self.free) + len(self.idle[0]) + len(self.idle[1])

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    @property
    def n_cached(self) -> int:
        """Named blocks nobody holds: K/V kept for a later hit."""
        return len(self.idle[0]) + len(self.idle[1])

    def need(self, table: list, rows: int) -> int:
        """Blocks a sequence holding `table` must still take to hold `rows` rows."""
        return max(0, blocks_for(rows, self.block_rows) - len(table))

    def can_grow(self, table: list, rows: int) -> bool:
        return self.need(table, rows) <= self.n_free

    def grow(self, table: list, rows: int):
        """Append blocks to `table` until it holds `rows` rows (RuntimeError if too few are free)."""
        n = self.need(table, rows)
        if n > self.n_free:
            raise RuntimeError(f"{n} KV blocks needed, {self.n_free} free")
        for k in range(n):
            b = self._take(table[-1] if table else None, n - k)
            self.refs[b] = 1
            table.append(b)

    def _take(self, after: int | None, n: int) -> int:
        """A block for a sequence whose last block is `after` (None: its first) and that takes
        n now. Locality: a sequence's blocks are taken in runs of consecutive ones, the block
        after its last where that one is free, so that attention reads each sequence's K/V as
        a few long runs. On PoCL a decode batch of 16 rows at position 192 took 23.5 ms with
        every block at random against 19.5 in runs (attention 9.1 against 5.2 ms), which is
        what interleaved growth and then an LRU's evictions make of a service's tables (runs
        taken backwards: 21.6 ms, attention 7.3). Once no blank block is left, the blocks of the
        least recently released sequence go first, as before, but from the first of its run on
        (its head before its tail: the cost, its tail's cache is worth nothing without it)."""
        if self.free:
            b = after + 1 if after is not None else None
            if b is None or b not in self.free:
                b = self._run_start(n)
            del self.free[b]
            self.written.discard(b)
            return b
        idle = self.idle[0] or self.idle[1]
        head = next(iter(idle))                        # least recently released
        b = after + 1 if after is not None else None
        # the block after its last if it went idle with the least recently released ones, else
        # the first block of their run (the LRU order holds between releases, not inside one)
        if b is None or b not in idle or self.released[b] > self.released[head]:
            b = head
            while b - 1 in idle and self.released[b - 1] == self.released[head]:
                b -= 1
        self._forget(b)
        self.evicted += 1
        return b

    def _run_start(self, n: int, gap: int = 8, scan: int = 512) -> int:
        """A free block to start a run at: near the top of the stack (pages touched lately), with
        n - 1 free blocks after it (at most 2 gap are looked at: a long prompt's start costs no
        more than a short one's) and none of the `gap` before it held (the room a running
        sequence there grows into); the top itself if none of the first `scan` is."""
        free, refs, ahead = self.free, self.refs, min(n, 2 * gap)
        for k, b in enumerate(reversed(free)):
            if k == scan:
                break
            if not any(b - j >= 0 and refs[b - j] for j in range(1, gap + 1)) and \
                    all(b + j in free for j in range(1, ahead)):
                return b
        return next(reversed(free))

    def _forget(self, b: int):
        """Block b leaves the cache (evicted, or taken over by one sequence): no name, not idle."""
        self.idle[0].pop(b, None)
        self.idle[1].pop(b, None)
        self.hit_count[b] = 0
        if self.name[b] is not None:
            name, _, parent = self.name[b]
            del self.by_name[name]
            self.name[b] = None
        elif b in self.tail:
            parent = self.tail.pop(b)[0]
        else:
            return
        kids = self.children[parent]
        kids.discard(b)
        if not kids:                      # no key left behind for every parent ever named
            del self.children[parent]

    def match(self, table: list, names: list, ids: list, rows: int) -> int:
        """A sequence starts: `table` and `names` (empty) take the cached blocks that hold the
        longest run of full blocks of ids[:rows - 1] (the last row is always computed: its logits
        sample the next token). Returns the rows found, which the sequence need not compute."""
        br, parent = self.block_rows, None
        if not self.cache:
            return 0
        for i in range((rows - 1) // br):
            tokens = tuple(ids[i * br:(i + 1) * br])
            name = chain(parent, tokens)
            b = self.by_name.get(name)
            if b is None or self.name[b][1] != tokens:      # a collision is a miss
                break
            if self.refs[b] == 0:
                self.idle[self.hit_count[b] > 0].pop(b)
            self.refs[b] += 1
            self.hit_count[b] += 1
            table.append(b)
            names.append(name)
            parent = name
        return len(table) * br + self._take_over(table, parent, ids[len(table) * br:rows - 1])

    def _take_over(self, table: list, parent, rest: list) -> int:
        """Token-granular reuse of the next block (SGLang's radix cache reuses any prefix; block
        hashes only whole blocks): an idle block after `parent` whose first k tokens are the
        sequence's next ones (a partial tail a finished request left, or a full block its text
        leaves early) is taken over whole, uncached: the sequence keeps its first k rows and
        writes the rest. Returns k (0: none). A block another sequence holds is never taken."""
        best, k_best = None, 0
        for b in self.children.get(parent, ()):
            if self.refs[b]:
                continue
            tokens = self.name[b][1] if self.name[b] is not None else self.tail[b][1]
            k = 0
            for a, c in zip(tokens, rest):
                if a != c:
                    break
                k += 1
            if k > k_best:
                best, k_best = b, k
        if best is not None:
            self._forget(best)
            self.refs[best] = 1
            table.append(best)
        return k_best

    def count(self, rows: int, found: int):
        """A sequence was admitted: `rows` asked for, `found` of them cached (the hit rate)."""
        self.queries += rows
        self.hits += found

    def publish(self, table: list, names: list, ids: list, computed: int):
        """The sequence holding `table` has its first `computed` rows (ids) in the cache: name its
        full blocks that are not named yet, for later requests to find."""
        if not self.cache:
            return
        br = self.block_rows
        for i in range(len(names), computed // br):
            tokens = tuple(ids[i * br:(i + 1) * br])
            name = chain(names[-1] if names else None, tokens)
            names.append(name)
            b = table[i]
            if name not in self.by_name and self.name[b] is None:
                self.by_name[name] = b          # a twin computed at the same time stays unnamed
                self.name[b] = (name, tokens, names[-2] if i else None)
                self.children.setdefault(self.name[b][2], set()).add(b)

    def release(self, table: list, names: list | None = None, ids: list | None = None,
                computed: int = 0):
        """Give a sequence's blocks back (it ended, was cancelled or preempted): named ones stay
        cached until needed, tail first in line. Given its ids and computed rows, a partly
        filled last block stays cached too (for a take-over: its tokens are a chat's last turn)."""
        br = self.block_rows
        tail = computed // br if self.cache and ids is not None and computed % br and names is not None \
            and len(names) == computed // br else None
        self.releases += 1
        for i in range(len(table) - 1, -1, -1):
            b = table[i]
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            self.released[b] = self.releases
            if self.name[b] is not None:
                self.idle[self.hit_count[b] > 0][b] = None
            elif i == tail:
                parent = names[i - 1] if i else None
                self.tail[b] = (parent, tuple(ids[i * br:computed]))
                self.children.setdefault(parent, set()).add(b)
                self.idle[0][b] = None
            else:
                self._to_free(b)
        table.clear()
        if names is not None:
            names.clear()
        while self.n_cached > self.cache_max:      # the least recently released, never hit first
            b = next(iter(self.idle[0] or self.idle[1]))
            self._forget(b)
            self.evicted += 1
            self._to_free(b)

    def _to_free(self, b: int):
        """Block b, written, on top of the free stack (the next taken)."""
        self.free[b] = None
        self.written.add(b)

    def drop_cached(self) -> int:
        """Every block kept for a later hit leaves the cache (the service has been idle long
        enough: ServeConfig.prefix_cache_idle_s) onto the free stack, written: the next trim
        hands them over. Blocks a sequence holds keep their names. -> how many left."""
        gone = [*self.idle[0], *self.idle[1]]
        for b in gone:
            self._forget(b)
            self._to_free(b)
        self.dropped += len(gone)
        self.drops += 1
        return len(gone)

    def trim(self, keep: int) -> list:
        """Free blocks that were written, but for the `keep` on top of the free stack (the next
        to be taken): their pages may go back to the OS now (the caller's; K/V read back as
        zeros, and no sequence holds them). -> their ids, ascending."""
        if not self.written:                      # the common case while busy: nothing to walk
            return []
        out = [b for k, b in enumerate(reversed(self.free)) if k >= keep and b in self.written]
        self.written.difference_update(out)
        self.trimmed += len(out)
        return sorted(out)

    def stats(self) -> dict:
        return {"prefix_cache": self.cache, "queries": self.queries, "hits": self.hits,
                "hit_rate": round(self.hits / self.queries, 4) if self.queries else 0.0,
                "cached_blocks": self.n_cached, "cached_blocks_max": self.cache_max,
                "evicted_blocks": self.evicted, "trimmed_blocks": self.trimmed,
                "dropped_blocks": self.dropped, "drops": self.drops, "written_free_blocks": len(self.written)}
