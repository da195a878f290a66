"""Speculative decoding's pure decisions (Ghidorah §III-C; DESIGN.md §5): what to draft, how many
rows to verify, what to accept. No Ray, no kernels.

A step of the one engine verifies drafts as extra rows of a sequence in the decode batch: the row
of its last token, then one row per drafted token at the next positions (a chain). The step's
logits at row j are the target's distribution after the drafted tokens 1..j, so the exact rule
for point-mass drafts holds (Leviathan et al. 2023; HF's and vLLM's "no draft probabilities"
path): sample the row's token as plain decoding would, with the same sampler in the same order;
keep going while it equals the next drafted token. Every emitted token is one plain decoding
would have emitted from the same logits with the same random draws, so greedy output and seeded
sampled output are those of plain decoding.

- `PromptLookup`: n-gram drafting from the sequence's own ids (prompt and output): the longest
  suffix of 1..max_n tokens that occurred before, most recent occurrence first, and what followed
  it (prompt-lookup decoding, vLLM's NgramProposer, llama.cpp's lookup). No training; long
  accepted runs where the output copies the input (summaries, extraction, rewrites, tool calls).
- `Acceptance`: a sequence's running acceptance rate of drafted tokens.
- `choose`: how many tokens each sequence drafts this step (ARCA, §III-C2): the step cost of n
  rows is measured on this device (runner.profile_batches); expected accepted tokens follow from
  each sequence's acceptance rate; drafts are added one row at a time, to the sequence whose next
  row is most likely accepted, while tokens per second grow.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np

MODES = ("auto", "off", "lookup", "heads")     # --speculate / a request's speculate
MAX_DRAFT = 15                        # drafted tokens one sequence verifies in a step
FORCED = -1                           # a draft's "n-gram length" when a grammar forced it
HEADS = -2                            # ... when draft heads made it
PREDICTED = -3                        # ... when it follows the request's prediction, in step with it
                                      # (PREDICTED - n: after an n-gram found in it)
# a draft row must promise this share more tokens a second than the step without it: a batch of
# short requests (acceptance still the prior) on a step that is already compute-bound lost 12 %
# of its throughput to drafts at 0 (8-16 streams, scripts/results/serve-2core-zen5-q16tiles*.json)
MARGIN = 0.05
# a draft head's second candidate, accepted once its parent was, before any was seen: 364 of
# 4,145 (8.8 %) on the default model's open chat prompts (spec-2core-emr-open-ranks2-run1.json)
SIDE_PRIOR = 0.1


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"speculate must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class PromptLookup:
    """Drafts from n-grams of one sequence's ids, indexed as they grow (O(max_n) a token)."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes {min_n}..{max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.seen: dict = {}          # n-gram (tuple) -> where what followed it starts (latest)
        self.ids: list = []

    def extend(self, ids: list):
        """The sequence's ids grew to `ids` (a list that only grows: prompt, then tokens)."""
        old = len(self.ids)
        self.ids = ids
        for t in range(max(old, 1), len(ids)):
            # the n-grams that end just before t now have a continuation starting at t
            for n in range(self.min_n, min(self.max_n, t) + 1):
                self.seen[tuple(ids[t - n:t])] = t

    def propose(self, k: int, ids: list | None = None) -> tuple:
        """(up to k tokens that followed the latest earlier occurrence of the longest suffix of
        the ids (this index's own, or `ids`: another sequence's, looked up here) that occurred
        before, that suffix's length n; 0: none found)."""
        own = self.ids
        ids = own if ids is None else ids
        if k <= 0 or not ids:
            return [], 0
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            start = self.seen.get(tuple(ids[len(ids) - n:]))
            if start is not None:
                return own[start:start + k], n
        return [], 0


class Prediction:
    """A request's prediction (OpenAI's Predicted Outputs) as ids, with every place each of its
    1..max_n-grams occurs (built once, with the request, off the engine's thread)."""

    def __init__(self, ids: list, max_n: int = 3):
        self.ids = list(ids)
        self.max_n = max_n
        self.at: dict = {}            # n-gram -> where what followed it starts, ascending
        for t in range(1, len(self.ids)):
            for n in range(1, min(max_n, t) + 1):
                self.at.setdefault(tuple(self.ids[t - n:t]), []).append(t)

    def __len__(self):
        return len(self.ids)

    def after(self, ids: list, cursor: int, k: int) -> tuple:
        """(up to k tokens that followed the longest suffix of `ids` found in the prediction, at
        its first occurrence from `cursor` on (the place the reply has reached), else its last
        before; that suffix's length n, 0 if none; where the tokens start)."""
        for n in range(min(self.max_n, len(ids)), 0, -1):
            where = self.at.get(tuple(ids[len(ids) - n:]))
            if where:
                i = bisect.bisect_left(where, cursor)
                start = where[min(i, len(where) - 1)]
                return self.ids[start:start + k], n, start
        return [], 0, cursor


def predicted(sp: "Speculation", prediction: Prediction, tokens: list, ids: list, k: int) -> tuple:
    """A draft from the request's prediction (the text the reply is expected to be, an edited
    file's old text, say): while the reply has followed it token for token, its next k tokens
    (source PREDICTED); once they differ, what followed the sequence's longest suffix inside the
    prediction, nearest after the place the reply had reached (sp.cursor: a repeated line of the
    prediction is taken in order, not its last copy), as source PREDICTED - n for a suffix of n
    (its acceptance kept apart from the prompt lookup's). sp.aligned: how many of the reply's
    leading tokens equal the prediction's (the reply only grows: each token compared once)."""
    a, pred = sp.aligned, prediction.ids
    sp.predicting = True
    while a < len(tokens) and a < len(pred) and tokens[a] == pred[a]:
        a += 1
    sp.aligned = a
    if a == len(tokens):
        sp.cursor = a
        return pred[a:a + k], PREDICTED
    draft, n, sp.cursor = prediction.after(ids, sp.cursor, k)
    return draft, PREDICTED - n if n else 0


@dataclass
class Acceptance:
    """A sequence's drafted and accepted tokens, and its acceptance rate (an average over recent
    drafts that drifts back to `prior` while nothing is drafted, so a sequence whose drafts were
    rejected is tried again later)."""
    prior: float = 0.5
    rate: float = 0.5
    drafted: int = 0
    accepted: int = 0
    steps: int = 0                      # verification steps (rows drafted > 0)
    weight: float = 0.3

    def update(self, drafted: int, accepted: int):
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1
            # the chance that a drafted token is accepted given the one before was: a run of
            # `accepted` then a reject (if any) is accepted+1 trials with `accepted` successes
            trials = accepted + (accepted < drafted)
            self.rate += self.weight * (accepted / max(trials, 1) - self.rate)
        else:
            self.rate += 0.05 * (self.prior - self.rate)

    def observe(self, trials: int, hits: int):
        """`trials` drafted tokens whose parents were accepted, `hits` of them accepted (a tree's
        nodes of one rank)."""
        if trials:
            self.drafted += trials
            self.accepted += hits
            self.steps += 1
            self.rate += self.weight * (hits / trials - self.rate)


def expected(rate: float, k: int) -> float:
    """Tokens a step emits when a sequence drafts k tokens, each accepted with probability `rate`
    once the one before was: 1 + rate + ... + rate^k."""
    return sum(rate ** j for j in range(k + 1))


def chain_gains(rate: float, n: int) -> list:
    """The chance that each of a chain's n drafted tokens is accepted: rate, rate^2, ..."""
    return [rate ** k for k in range(1, n + 1)]


def choose(cost: list, rates: list, limits: list, max_rows: int, margin: float = 0.0) -> list:
    """Drafted tokens per sequence for one step, for chains: choose_rows where sequence i's
    k-th drafted token is accepted with probability rates[i]^k, limits[i]: the most it may draft
    (what its drafter found, its room in the context and max_tokens)."""
    return choose_rows(cost, [chain_gains(r, n) for r, n in zip(rates, limits)], max_rows, margin)


def choose_rows(cost: list, gains: list, max_rows: int, margin: float = 0.0,
                rows: int | None = None) -> list:
    """Drafted rows per sequence for one step.

    cost[n]: seconds of a step of n rows (n = 1 .. len(cost) - 1; cost[0] unused), this device's
    profile; gains[i]: the chance that each of sequence i's drafted rows is accepted, in the order
    they would be added (not increasing: a chain's rate^k, a tree's nodes best first, Tree). A
    step has one row per sequence (`rows`: those and the rows fed again, Request.lag) plus its
    drafts, at most max_rows (and len(cost) - 1). A row is added where its expected tokens are
    highest, as long as tokens per second grow (by more than `margin`, a share: what the costs'
    noise and the rates' errors could eat)."""
    ks = [0] * len(gains)
    tokens = float(len(gains))
    rows = len(gains) if rows is None else rows
    top = min(max_rows, len(cost) - 1)
    if rows == 0 or rows > top:
        return ks
    best = tokens / cost[rows]
    while rows < top:
        open_ = [(gains[i][ks[i]], i) for i in range(len(ks)) if ks[i] < len(gains[i])]
        if not open_:
            break
        gain, i = max(open_)
        # a row that does not pay now may still pay with more behind it (a flat stretch of the
        # cost curve): look ahead along this sequence's next rows
        trial_k, trial_tokens, trial_rows = ks[i], tokens, rows
        while trial_rows < top and trial_k < len(gains[i]):
            trial_tokens += gains[i][trial_k]
            trial_k += 1
            trial_rows += 1
            if trial_tokens / cost[trial_rows] > best * (1 + margin):
                break
        else:
            break
        ks[i], tokens, rows = trial_k, trial_tokens, trial_rows
        best = tokens / cost[rows]
    return ks


class Tree:
    """A sequence's drafted tokens as a tree (Medusa's candidates, SpecInfer's token tree),
    verified in one step: node i is token tokens[i] after its parent parents[i] (-1: after the
    sequence's last token, the root row), rank[i] the place of its token among its head's
    candidates (0: the likeliest).

    Nodes are laid out parents first, the chain of rank-0 nodes from the root at the front: node i
    of that chain (depth i + 1) writes its K/V at its own position, so an accepted path along the
    chain leaves the cache as a chain draft would. Every other node writes past the chain and sees
    the prefix and its ancestors only (entries, actors/gpu/cl/paged.cl tree_row); a path that
    leaves the chain is fed again at the next step (Request.lag), nothing is copied."""

    def __init__(self, tokens: list, parents: list, rank: list):
        if not (len(tokens) == len(parents) == len(rank)) or \
                any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError("a tree's nodes come after their parents")
        if len(tokens) > 64:
            raise ValueError(f"a tree of {len(tokens)} nodes (at most 64)")
        self.tokens, self.parents, self.rank = list(tokens), list(parents), list(rank)
        self.depth = []
        for p in self.parents:
            self.depth.append(1 if p < 0 else self.depth[p] + 1)
        self.chain = 0                    # nodes 0 .. chain-1: the rank-0 chain at its positions
        while self.chain < len(tokens) and self.parents[self.chain] == self.chain - 1 \
                and self.rank[self.chain] == 0:
            self.chain += 1

    @classmethod
    def laid_out(cls, tokens: list, parents: list, rank: list) -> "Tree":
        """The tree of these nodes (any order with parents first), laid out chain first."""
        chain, at = [], -1
        while True:
            nxt = [i for i, p in enumerate(parents) if p == at and rank[i] == 0]
            if not nxt:
                break
            chain.append(nxt[0])
            at = nxt[0]
        order = chain + [i for i in range(len(tokens)) if i not in set(chain)]
        new = {old: k for k, old in enumerate(order)}
        return cls([tokens[i] for i in order], [new.get(parents[i], -1) for i in order],
                   [rank[i] for i in order])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, k):
        """A prefix of the nodes (a slice from 0) is a tree: parents come first."""
        if not isinstance(k, slice) or k.start not in (None, 0) or k.step not in (None, 1):
            raise TypeError("a tree is cut to its first nodes only")
        n = len(self.tokens) if k.stop is None else min(k.stop, len(self.tokens))
        return Tree(self.tokens[:n], self.parents[:n], self.rank[:n])

    def in_place(self, i: int) -> bool:
        """Node i's K/V are at its own position (-1: the root)."""
        return i < self.chain

    def child(self, i: int, token: int) -> int | None:
        """Node i's child (-1: the root's) whose token is `token`, if drafted."""
        for c, p in enumerate(self.parents):
            if p == i and self.tokens[c] == token:
                return c
        return None

    def entries(self, root: int) -> tuple:
        """For the step's rows of the nodes, the root at position `root`: (positions [T], KV
        positions [T], tree entries [T, 4] int32: L, base, mask low, mask high; paged.cl tree_row:
        a chain node's entry is 0, it sees 0 .. its position)."""
        T = len(self.tokens)
        pos = np.array([root + d for d in self.depth], np.int32)
        at = np.arange(root + 1, root + 1 + T, dtype=np.int32)
        ent = np.zeros((T, 4), np.int32)
        for i in range(self.chain, T):
            mask, a = 0, i
            while a >= 0:
                mask |= 1 << a
                a = self.parents[a]
            ent[i] = entry(root + 1, root + 1, mask)
        return pos, at, ent


def entry(L: int, base: int, mask: int) -> tuple:
    """A tree entry's four int32 (paged.cl tree_row): L, base, the mask's low and high words."""
    lo, hi = mask & 0xFFFFFFFF, mask >> 32
    return L, base, lo - (lo >> 31 << 32), hi - (hi >> 31 << 32)


def hcmp_entries(pos: np.ndarray, seq: np.ndarray, ent: np.ndarray) -> np.ndarray:
    """A decode step's tree entries [N, 4] for HCMP (graph/hcmp.py), which splits each row's
    keys into a dense part, 0 .. L-1, and a sparse part, the entry's mask: a draft tree's node
    keeps its entry; a chain's row (entry 0) at position p sees its sequence's keys from p0, the
    first position of the sequence's chain rows in this step, as its sparse part (base p0, the
    bits 0 .. p - p0): the drafted rows' keys; a lone decode row's sparse part is its own key."""
    out = np.array(ent, np.int32)
    chain = (out[:, 2] == 0) & (out[:, 3] == 0)
    for s in np.unique(seq[chain]):
        rows = chain & (seq == s)
        p0 = int(pos[rows].min())
        for n in np.flatnonzero(rows):
            d = int(pos[n]) - p0
            lo = p0 if d < 64 else int(pos[n])        # a longer chain: its own key sparse
            out[n] = entry(lo, lo, (1 << (int(pos[n]) - lo + 1)) - 1)
    return out


def walk(tree: Tree, sample) -> tuple:
    """A draft tree's verification: from the root (node -1), sample(node) is the token sampled
    from node's row as plain decoding samples it (None: the sequence ended there); then on to the
    child drafted with that token, if any, and its row. Every token comes from the row whose
    context is exactly the tokens emitted before it, so the output is plain decoding's, in
    distribution and, draw for draw, for a seeded sampler. -> (the nodes whose rows were
    sampled, root first; [(rank, accepted)] of each node whose parent's row was sampled)."""
    node, path, trials = -1, [-1], []
    while True:
        tok = sample(node)
        if tok is None:
            break
        trials += [(tree.rank[c], tree.tokens[c] == tok)
                   for c, p in enumerate(tree.parents) if p == node]
        nxt = tree.child(node, tok)
        if nxt is None:
            break
        node = nxt
        path.append(node)
    return path, trials


def _spread(ks: list, mine: list) -> list:
    """Drafted rows chosen for the sequences marked in `mine` (in order), 0 for the others."""
    it = iter(ks)
    return [next(it) if m else 0 for m in mine]


def step_rows(batch: list, drafts: list) -> tuple:
    """A decode step's rows [(token, position, slot)] for the sequences of `batch` (Sequence:
    policies/request.py) and their drafts (a chain or a Tree): each sequence's rows fed again
    (Request.lag), its last token's, then its drafts'; and, where a draft is a tree, the runner's
    `tree` argument (each row's KV position, its tree entry; None: no tree)."""
    rows, at, ent = [], [], []
    trees = any(isinstance(d, Tree) for d in drafts)
    for s, d in zip(batch, drafts):
        last = s.rows - 1
        rows += [(t, last - s.lag + j, s.slot) for j, t in enumerate(s.tokens[len(s.tokens) - 1 - s.lag:])]
        if isinstance(d, Tree):
            pos, kv, e = d.entries(last)
            rows += [(t, int(p), s.slot) for t, p in zip(d.tokens, pos)]
            at += list(range(last - s.lag, last + 1)) + kv.tolist()
            ent += [np.zeros((1 + s.lag, 4), np.int32), e]
            continue
        rows += [(t, last + 1 + j, s.slot) for j, t in enumerate(d)]
        if trees:
            at += list(range(last - s.lag, last + 1 + len(d)))
            ent.append(np.zeros((1 + s.lag + len(d), 4), np.int32))
    return rows, (np.array(at, np.int32), np.concatenate(ent)) if trees else None


def tree_candidates(top: np.ndarray, rates: list, depth: int, width: int) -> tuple:
    """The likeliest nodes of a draft tree from the heads' candidates: top [K, R], head k's R
    likeliest tokens (k + 1 places after the next one); rates[r]: the chance that a rank-r
    candidate is accepted once its parent was. A node's chance is the product along its path;
    best first (a parent before its children), at most `width` nodes of depth <= `depth`.
    -> (tokens, parents, ranks, chances), in that order."""
    import heapq
    K, R = top.shape
    depth = min(depth, K)
    heap = [(-rates[r], r, -1, 1, r) for r in range(R) if depth >= 1]
    heapq.heapify(heap)
    tokens, parents, ranks, chances = [], [], [], []
    while heap and len(tokens) < width:
        negp, _, parent, d, r = heapq.heappop(heap)
        tokens.append(int(top[d - 1, r]))
        parents.append(parent)
        ranks.append(r)
        chances.append(-negp)
        if d < depth:
            me = len(tokens) - 1
            for r2 in range(R):
                heapq.heappush(heap, (negp * rates[r2], len(tokens) * R + r2, me, d + 1, r2))
    return tokens, parents, ranks, chances


class Heads:
    """Medusa-style draft heads (Medusa-1: the model is frozen, so verification keeps its
    tokens exact): head k maps a row's final-normed hidden state x to x + SiLU(W_k x + b_k),
    whose logits over a token subset (the model's own embedding rows of it) give the token k+1
    places after the row's next one. A chain draft: each head's most likely token. Trained by
    scripts/train_heads.py (models/heads.py holds the files).

    With A (Hydra's sequentially dependent heads, arXiv 2402.05109), head k also sees the token
    before the one it drafts: z_k = W_k x + A_k e(t_k) + b_k, where t_1 is the row's next token
    (the model's own, sampled by the step that made x) and t_k the token head k-1 drafted; e is
    the embedding row of a token of the subset (zero for a token outside it). The heads then run
    one after another, each on the previous one's likeliest token: in a tree (ranks > 1) the
    second candidates of head 1 are its own, deeper nodes follow the likeliest path's tokens."""

    def __init__(self, W: np.ndarray, b: np.ndarray, vocab: np.ndarray, embed: np.ndarray,
                 prior: float = Acceptance.prior, A: np.ndarray | None = None):
        """prior: the first head's accuracy on held-out rows, the acceptance expected before any
        is seen. A [K, D, D]: the heads' token matrices (None: Medusa's heads, on x alone)."""
        # W [K,D,D], b [K,D], vocab [V'], embed [V',D], kept as every head's W_k in one matrix
        # [D, K*D] and E' transposed [D, V']: two GEMMs a step (np.einsum would loop in C without
        # BLAS: 1.7-3 ms a step on the Xeon VM, against the step's ~15 ms of kernels); the
        # arrays as given are not kept (13 MB for the default model's)
        self.b, self.vocab, self.k, self.prior = b, vocab, W.shape[0], prior
        self.Wt = np.ascontiguousarray(W.reshape(-1, W.shape[-1]).T)
        # E' with a zero row after it (Hydra's input for a token outside the subset), read as rows
        # there and as its transpose (a view: BLAS takes it as is) for the logits
        self.E0 = np.concatenate([embed, np.zeros((1, embed.shape[1]), np.float32)])
        self.Et = self.E0[:-1].T
        self.At = None if A is None else np.ascontiguousarray(A.transpose(0, 2, 1))
        if A is not None:
            # a token id -> its row of E0 (the zero row for a token outside the subset; the last
            # entry stands for any id past the table's end or below 0)
            self.row = np.full(int(vocab.max()) + 2, len(vocab), np.int64)
            self.row[vocab] = np.arange(len(vocab))

    def propose(self, hidden: np.ndarray, ranks: int = 1, last: np.ndarray | None = None) -> np.ndarray:
        """hidden [S, D] (each sequence's last row) -> drafted tokens [S, K] (ranks > 1: each
        head's `ranks` likeliest, the likeliest first [S, K, ranks]). last [S]: each sequence's
        next token, the one its row's logits gave (the Hydra heads' first input)."""
        s, d = hidden.shape
        z = (hidden @ self.Wt).reshape(s, self.k, d) + self.b
        if self.At is not None:
            return self._chain(hidden, z, ranks, last)
        h = hidden[:, None, :] + z / (1.0 + np.exp(-z))                  # ResBlock: x + SiLU(.)
        return self._top(h.reshape(-1, d) @ self.Et, ranks).reshape(s, self.k, *(() if ranks == 1 else (ranks,)))

    def _chain(self, hidden, z, ranks, last):
        s = len(hidden)
        last = np.full(s, -1) if last is None else np.asarray(last, np.int64)
        prev = self.row[np.where((last < 0) | (last >= len(self.row)), len(self.row) - 1, last)]
        out = []
        for k in range(self.k):
            zk = z[:, k] + self.E0[prev] @ self.At[k]
            h = hidden + zk / (1.0 + np.exp(-zk))
            top = self._top(h @ self.Et, ranks, rows=True)             # subset rows [S] / [S, R]
            out.append(self.vocab[top])
            prev = top if ranks == 1 else top[:, 0]
        return np.stack(out, 1)

    def _top(self, logits, ranks, rows=False):
        """Each row's likeliest token (ranks 1), or its `ranks` likeliest, best first: as token
        ids, or (rows) as rows of the subset."""
        if ranks == 1:
            top = logits.argmax(1)
        else:
            top = np.argpartition(-logits, ranks - 1, axis=1)[:, :ranks]
            order = np.argsort(-np.take_along_axis(logits, top, 1), axis=1, kind="stable")
            top = np.take_along_axis(top, order, 1)
        return top if rows else self.vocab[top]


class StepCosts:
    """Seconds of a decode step of n rows (n = 1 .. max_rows) on this device: seeded from the
    profile measured at start where there is one (runner.profile_batches), then an average of the
    steps that ran (the cost under today's contention and context lengths, Ghidorah §III-C3). A
    row count not seen yet costs what the largest count below it costs: optimistic, so that the
    chooser tries it once and learns. So does one not seen for STALE steps whose cost is above
    that: a slow step (a busy moment) would otherwise keep the chooser from ever trying that many
    rows again, and so from learning that they pay (measured: one run drafted almost nothing
    after a 2-row step had once taken 55 ms, where 2 rows take ~14); its next step is learned
    afresh."""

    STALE = 256

    def __init__(self, max_rows: int, profile: dict | None = None, weight: float = 0.2):
        self.max_rows, self.weight = max_rows, weight
        self.s = [None] * (max_rows + 1)
        self.at = [None] * (max_rows + 1)      # the step at which each count was last observed
        self.steps = 0
        for n, sec in (profile or {}).items():
            if 1 <= n <= max_rows:
                self.s[n] = float(sec)

    def observe(self, n: int, seconds: float):
        self.steps += 1
        if 1 <= n <= self.max_rows:
            old = None if self._stale(n) else self.s[n]
            self.s[n] = seconds if old is None else old + self.weight * (seconds - old)
            self.at[n] = self.steps

    def _stale(self, n: int) -> bool:
        return self.at[n] is not None and self.steps - self.at[n] > self.STALE

    def table(self) -> list:
        out, last = [0.0], None
        for n in range(1, self.max_rows + 1):
            s = self.s[n]
            if s is not None and not (self._stale(n) and last is not None and s > last):
                last = s
            out.append(last if last is not None else 1.0)
        return out


class Speculator:
    """The drafts of a decode batch's sequences (actors/engine.py asks before each decode step)."""

    def __init__(self, mode: str, max_rows: int, draft_max: int, profile: dict | None = None,
                 heads: Heads | None = None, ranks: int = 1, reactive_first: bool = False):
        """ranks: the heads' candidates per head; above 1, their drafts are trees (Tree) of at
        most draft_max nodes, chosen best first by the running acceptance of each rank.
        reactive_first (the agent policy's): in a step with reactive rows, only they draft, as
        many rows as make their own tokens a second grow (Agent.xpu §4.5 ②: a proactive row's
        drafts would slow the reactive ones for tokens no one waits for); elsewhere every
        sequence's, for the step's tokens a second."""
        self.mode = check_mode(mode)
        self.reactive_first = reactive_first
        self.max_rows, self.draft_max, self.heads, self.ranks = max_rows, draft_max, heads, ranks
        # a rank's chance to be accepted once its parent was: rank 0 is each sequence's heads
        # rate; the others are the service's (few trials a sequence), averaged slowly: a step
        # tries several and most miss
        self.side = [Acceptance(prior=SIDE_PRIOR, rate=SIDE_PRIOR, weight=0.03) for _ in range(ranks)]
        self.trees = self.side_accepted = 0
        # acceptance by draft source (Speculation.by_n's keys), over every sequence: a new
        # sequence's expectation
        self.by_n: dict = {}
        self.heads_s = None                 # seconds the heads take a step (an average)
        self.costs = StepCosts(max_rows, profile)
        self.drafted = self.accepted = self.steps = 0     # the service's, for status and metrics

    def drafts(self, batch: list, context: int) -> list:
        """[drafted tokens] per sequence of the batch (Sequence: policies/request.py)."""
        found, rates, ask = [], [], []
        cost = self.costs.table()
        mine = [True] * len(batch)                     # the rows whose tokens the step is for
        if self.reactive_first and any(s.priority == "reactive" for s in batch):
            mine = [s.priority == "reactive" for s in batch]
        for s, m in zip(batch, mine):
            mode = self.mode if s.speculate is None else s.speculate
            if mode == "off" or self.mode == "off" or not m:
                found.append([])
                rates.append(0.0)
                continue
            if s.spec is None:
                s.spec = Speculation(mode, service=self.by_n)
                if self.heads is not None and HEADS not in self.by_n:
                    p = self.heads.prior
                    s.spec.by_n[HEADS] = Acceptance(prior=p, rate=p)
            sp = s.spec
            # the rows after the last token's (Request.lag: rows fed again come before it)
            room = min(self.draft_max, context - 1 - (s.rows - 1) - 1,
                       s.params.max_tokens - len(s.tokens) - 1)
            # what a grammar forces next (a schema's keys, a tool call's punctuation) is accepted
            # whatever the model says; else the lookup (the loop cuts it where the grammar would
            # refuse a token); else the heads, below
            forced = s.constraint.forced()[:max(room, 0)] if s.constraint is not None else []
            draft, sp.n = (forced, FORCED) if forced else ([], 0)
            if not forced and mode != "heads":
                sp.lookup.extend(s.ids)
                draft, sp.n = sp.lookup.propose(room)
                pred = getattr(s, "prediction", None)
                if pred and room > 0:            # the prediction's, unless the lookup's is longer
                    more, n = predicted(sp, pred, s.tokens, s.ids, room)
                    if more and (n == PREDICTED or PREDICTED - n >= sp.n):   # (its n-gram's length)
                        draft, sp.n = more, n
            # the heads where the lookup found nothing, or where they have been accepted more
            # often than drafts from an n-gram this long
            if mode != "lookup" and not forced and self.heads is not None and sp.hidden is not None \
                    and room > 0 and (not draft or sp.n != PREDICTED and sp.rate(HEADS) > sp.rate()) \
                    and (mode == "heads" or self._heads_pay(cost, sp.rate(HEADS), room, len(batch))):
                ask.append((len(found), room))
            found.append(draft)
            # lookup: drafted wherever found, while the step has rows
            rates.append(1.0 if mode == "lookup" or forced else sp.rate())
        gains = [chain_gains(r, len(f)) for r, f in zip(rates, found)]
        if ask:
            self._ask_heads(batch, ask, found, rates, gains)
        fixed = sum(1 + s.lag for s in batch)          # each sequence's rows before its drafts
        ks = _spread(choose_rows(cost, [g for g, m in zip(gains, mine) if m], self.max_rows, MARGIN, fixed),
                     mine)
        # a drafter asked for by name (lookup, heads) drafts whenever it has a draft, as rows allow:
        # the measured step costs decide only for auto (and a step's costs measured on a busy
        # machine would otherwise decide what a test sees)
        named = [m and (self.mode if s.speculate is None else s.speculate) in ("lookup", "heads")
                 for s, m in zip(batch, mine)]
        spare = min(self.max_rows, len(cost) - 1) - fixed - sum(k for k, n in zip(ks, named) if not n)
        for i, n in enumerate(named):
            if n:
                ks[i] = max(0, min(len(gains[i]), spare))
                spare -= ks[i]
        return [f[:k] if not isinstance(f, tuple) else Tree.laid_out(*(x[:k] for x in f)) if k else []
                for f, k in zip(found, ks)]

    def _ask_heads(self, batch: list, ask: list, found: list, rates: list, gains: list):
        """The heads' drafts for the sequences in `ask` [(index, room)]: a chain of each head's
        likeliest token, or (ranks > 1, no grammar) the candidates of a tree, best first, as
        (tokens, parents, ranks) with their chances in `gains`."""
        t0 = time.perf_counter()
        top = self.heads.propose(np.stack([batch[i].spec.hidden for i, _ in ask]), self.ranks,
                                 np.array([batch[i].tokens[-1] if batch[i].tokens else -1 for i, _ in ask]))
        dt = time.perf_counter() - t0
        self.heads_s = dt if self.heads_s is None else self.heads_s + 0.2 * (dt - self.heads_s)
        for (i, room), t in zip(ask, top):
            s = batch[i]
            s.spec.n = HEADS
            rates[i] = s.spec.rate()
            if self.ranks == 1 or s.constraint is not None:
                found[i] = [int(x) for x in (t if self.ranks == 1 else t[:, 0])[:room]]
                gains[i] = chain_gains(rates[i], len(found[i]))
                continue
            # a tree's depth: as a chain's; its nodes: as the context's room (draft_max at most)
            depth = min(room, s.params.max_tokens - len(s.tokens) - 1)
            rank_rates = [rates[i]] + [a.rate for a in self.side[1:]]
            tokens, parents, ranks, chances = tree_candidates(t, rank_rates, depth, room)
            found[i], gains[i] = (tokens, parents, ranks), chances

    def _heads_pay(self, cost: list, rate: float, room: int, rows: int) -> bool:
        """Whether running the heads for one more sequence of a step of `rows` rows can pay for
        itself: the best draft length at their acceptance rate gives more tokens a second than
        the step without, counting the heads' own time (measured) as part of the step.
        cost: the step costs' table (StepCosts.table)."""
        if rows >= len(cost) - 1:
            return False
        extra = self.heads_s or 0.0
        plain = rows / cost[rows] * (1 + MARGIN)
        return any((rows - 1 + expected(rate, k)) / (cost[rows + k] + extra) > plain
                   for k in range(1, min(room, len(cost) - 1 - rows) + 1))

    def verified(self, seq, drafted: int, accepted: int, trials: list | None = None):
        """trials (a tree's): [(rank, accepted)] of each node whose parent was accepted; rank 0
        counts for the sequence's rate, the others for the service's rate of their rank."""
        if seq.spec is not None:
            service = self.by_n.setdefault(seq.spec.n, Acceptance(weight=0.05)) if drafted else None
            if trials is None:
                seq.spec.update(drafted, accepted)
                if service is not None:
                    service.update(drafted, accepted)
            else:
                hits = [hit for r, hit in trials if r == 0]
                seq.spec.update_tree(drafted, accepted, hits)
                service.observe(len(hits), sum(hits))
        for r in range(1, self.ranks):
            hits = [hit for rank, hit in trials or () if rank == r]
            if hits:
                self.side[r].observe(len(hits), sum(hits))
        if trials is not None:
            self.trees += 1
            self.side_accepted += sum(hit for r, hit in trials if r > 0)
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1

    def describe(self) -> dict:
        return {"mode": self.mode, "draft_max": self.draft_max, "heads": self.heads is not None,
                "tree": {"ranks": self.ranks, "steps": self.trees, "side_accepted": self.side_accepted,
                         "side_tried": sum(a.drafted for a in self.side[1:]),
                         "side_rates": [round(a.rate, 3) for a in self.side[1:]]},
                "drafted": self.drafted,
                "accepted": self.accepted, "verify_steps": self.steps,
                "step_ms": [round(1e3 * c, 2) for c in self.costs.table()[1:]]}


@dataclass
class Speculation:
    """One sequence's drafting state (actors/engine.py keeps it on the Sequence)."""
    mode: str
    lookup: PromptLookup = field(default_factory=PromptLookup)
    # acceptance by the length of the n-gram that found the draft (a longer match predicts more)
    by_n: dict = field(default_factory=dict)
    # the service's acceptance by the same sources (Speculator.by_n): where this sequence has
    # none yet, and what an unused one drifts back to
    service: dict = field(default_factory=dict)
    n: int = 0                                    # this step's
    hidden: object = None                         # the last row's final hidden state (heads)
    aligned: int = 0                              # the reply's leading tokens the prediction has
    cursor: int = 0                               # where in the prediction the reply is (predicted)
    drafted: int = 0
    accepted: int = 0
    predicting: bool = False                      # the request has a prediction; its drafts':
    drafted_predicted: int = 0
    accepted_predicted: int = 0

    def rate(self, n: int | None = None) -> float:
        """The acceptance rate of drafts from this step's source (or `n`'s)."""
        n = self.n if n is None else n
        a = self.by_n.get(n)
        return a.rate if a is not None else self.prior(n)

    def prior(self, n: int) -> float:
        """What drafts from source n are expected to do before this sequence has tried them: the
        service's running rate for that source (on a device where a verifying step costs several
        plain ones, a fixed prior below the break-even never lets a sequence try, and learn)."""
        s = self.service.get(n)
        return s.rate if s is not None else Acceptance.prior

    def _mine(self, n: int) -> Acceptance:
        if n not in self.by_n:
            p = self.prior(n)
            self.by_n[n] = Acceptance(prior=p, rate=p)
        return self.by_n[n]

    def _drift(self, keep: int | None):
        for n, a in self.by_n.items():
            if n != keep:
                a.prior = self.prior(n)
                a.update(0, 0)              # unused: drifts back to the prior

    def update(self, drafted: int, accepted: int):
        self.drafted += drafted
        self.accepted += accepted
        if self.n <= PREDICTED:
            self.drafted_predicted += drafted
            self.accepted_predicted += accepted
        self._drift(self.n if drafted else None)
        if drafted:
            self._mine(self.n).update(drafted, accepted)

    def update_tree(self, drafted: int, accepted: int, hits: list):
        """A tree's verification: `drafted` nodes, `accepted` on the path; hits: whether each of
        its rank-0 nodes whose parent was accepted was accepted too."""
        self.drafted += drafted
        self.accepted += accepted
        self._drift(self.n)
        self._mine(self.n).observe(len(hits), sum(hits))

    def usage(self) -> dict:
        """OpenAI's names (its Predicted Outputs): drafted tokens the model accepted, and those
        it did not; with a prediction, only the prediction's drafts (as OpenAI counts them)."""
        d, a = (self.drafted_predicted, self.accepted_predicted) if self.predicting else \
            (self.drafted, self.accepted)
        return {"accepted_prediction_tokens": a, "rejected_prediction_tokens": d - a}
