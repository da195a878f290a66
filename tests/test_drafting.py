"""Speculative decoding's pure decisions (policies/drafting.py): the n-gram drafter, the width
chooser against brute force on synthetic step-cost profiles, acceptance bookkeeping."""
from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from socllm.policies.drafting import (Acceptance, PromptLookup, Speculation, StepCosts, check_mode,
                                      choose, expected)


def _naive(ids: list, k: int, max_n: int = 3) -> tuple:
    """The spec of PromptLookup.propose, by scanning: the longest suffix (<= max_n) that occurred
    earlier, its latest occurrence, what followed it."""
    for n in range(min(max_n, len(ids)), 0, -1):
        suffix = ids[len(ids) - n:]
        for start in range(len(ids) - 1, n - 1, -1):      # continuation starts here
            if start < len(ids) and ids[start - n:start] == suffix:
                return ids[start:start + k], n
    return [], 0


def test_lookup_drafts_what_followed_the_latest_longest_match():
    p = PromptLookup()
    ids = [5, 6, 7, 8, 9, 5, 6, 7]
    p.extend(ids)
    assert p.propose(3) == ([8, 9, 5], 3)
    ids = ids + [1]                                 # no earlier "6 7 1", "7 1" or "1"
    p.extend(ids)
    assert p.propose(3) == ([], 0)
    ids = ids + [5, 6]                              # "1 5 6" no; "5 6": latest at 5 -> 7, 1, 5
    p.extend(ids)
    assert p.propose(3) == ([7, 1, 5], 2)
    assert p.propose(0) == ([], 0)


def test_lookup_equals_a_scan_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(30):
        ids = [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 60)))]
        p = PromptLookup()
        grown = []
        for t in ids:                              # grown a token at a time, as decoding does
            grown = grown + [t]
            p.extend(grown)
            assert p.propose(4) == _naive(grown, 4), (trial, grown)


def _brute(cost, rates, limits, max_rows):
    """The best drafts per sequence by trying them all: tokens a second, ties to fewer rows."""
    best, pick = -1.0, None
    for ks in itertools.product(*[range(min(lim, max_rows) + 1) for lim in limits]):
        rows = len(rates) + sum(ks)
        if rows > min(max_rows, len(cost) - 1):
            continue
        v = sum(expected(r, k) for r, k in zip(rates, ks)) / cost[rows]
        if v > best + 1e-12:
            best, pick = v, list(ks)
    return best, pick


@pytest.mark.parametrize("shape", ["flat then steep", "linear", "steps", "gpu-like"])
def test_the_chooser_finds_the_best_width_of_one_sequence(shape):
    n = np.arange(17, dtype=float)
    cost = {"flat then steep": np.where(n <= 8, 1.0 + 0.02 * n, 1.0 + 0.5 * (n - 8)),
            "linear": 1.0 + 0.35 * n,
            "steps": 1.0 + 0.6 * np.ceil(n / 4),              # wave quantization: flat in 4s
            "gpu-like": 1.0 + 0.02 * n}[shape]
    cost[0] = 0
    for rate in (0.1, 0.4, 0.7, 0.9, 0.98):
        best, _ = _brute(list(cost), [rate], [15], 16)
        ks = choose(list(cost), [rate], [15], 16)
        got = expected(rate, ks[0]) / cost[1 + ks[0]]
        assert got == pytest.approx(best, rel=1e-9), (shape, rate, ks)


def test_the_chooser_shares_rows_between_sequences_and_respects_limits():
    cost = [0] + [1.0 + 0.05 * k for k in range(1, 9)]
    rates, limits = [0.9, 0.2, 0.6], [4, 4, 1]
    ks = choose(cost, rates, limits, 8)
    assert all(k <= lim for k, lim in zip(ks, limits)) and 3 + sum(ks) <= 8
    best, _ = _brute(cost, rates, limits, 8)
    got = sum(expected(r, k) for r, k in zip(rates, ks)) / cost[3 + sum(ks)]
    assert got >= 0.98 * best
    assert ks[0] >= ks[1]                          # the likelier drafts get the rows
    # a step that is already full drafts nothing; costs that double per row draft nothing
    assert choose(cost, [0.9] * 8, [4] * 8, 8) == [0] * 8
    assert choose([0, 1, 2, 4, 8], [0.9], [3], 8) == [0]
    # a row that promises less than the margin is not added
    assert choose([0, 1.0, 1.1], [0.12], [1], 2) == [1] and choose([0, 1.0, 1.1], [0.12], [1], 2, 0.05) == [0]


def test_acceptance_rate_follows_runs_and_drifts_back_when_unused():
    a = Acceptance()
    for _ in range(20):
        a.update(4, 4)                             # every draft accepted
    assert a.rate > 0.95 and (a.drafted, a.accepted, a.steps) == (80, 80, 20)
    for _ in range(20):
        a.update(4, 0)                             # every first draft rejected
    assert a.rate < 0.05
    for _ in range(200):
        a.update(0, 0)
    assert abs(a.rate - a.prior) < 0.01


def test_a_sequence_keeps_acceptance_by_match_length_and_reports_openai_usage():
    s = Speculation("auto")
    s.n = 3
    s.update(4, 4)
    s.n = 1
    s.update(4, 0)
    assert s.by_n[3].rate > s.by_n[1].rate
    assert s.usage() == {"accepted_prediction_tokens": 4, "rejected_prediction_tokens": 4}


def test_step_costs_start_from_the_profile_and_learn():
    c = StepCosts(4, {1: 0.010, 2: 0.012})
    assert c.table() == [0.0, 0.010, 0.012, 0.012, 0.012]     # unseen: as the largest below
    for _ in range(50):
        c.observe(3, 0.030)
    assert c.table()[3] == pytest.approx(0.030, rel=1e-3) and c.table()[4] == c.table()[3]
    assert StepCosts(2).table() == [0.0, 1.0, 1.0]


def test_a_row_count_that_once_ran_slow_is_tried_again_later():
    """One slow 2-row step must not keep 2-row steps from being tried for good: after STALE
    steps without one, 2 rows cost what 1 row costs again (optimistic, as an unseen count), and
    the next 2-row step is learned afresh, not averaged into the old one."""
    c = StepCosts(4, {1: 0.010, 2: 0.012})
    for _ in range(10):
        c.observe(2, 0.055)
    assert c.table()[2] > 0.04
    for _ in range(StepCosts.STALE):
        c.observe(1, 0.010)
    assert c.table()[2] > 0.04                     # not yet stale
    c.observe(1, 0.010)
    assert c.table()[2] == c.table()[1] == pytest.approx(0.010)
    c.observe(2, 0.013)
    assert c.table()[2] == pytest.approx(0.013)    # afresh
    assert c.table()[3] == c.table()[2]


def test_modes_are_checked():
    assert check_mode("lookup") == "lookup"
    with pytest.raises(ValueError, match="speculate"):
        check_mode("medusa")


def test_heads_draft_each_heads_most_likely_token_of_the_subset():
    from socllm.policies.drafting import Heads
    rng = np.random.default_rng(1)
    K, D, V = 3, 16, 40
    W, b = rng.normal(0, 0.3, (K, D, D)).astype(np.float32), rng.normal(0, 0.1, (K, D)).astype(np.float32)
    vocab = rng.choice(1000, V, replace=False)
    embed = rng.normal(0, 1, (V, D)).astype(np.float32)
    heads = Heads(W, b, vocab, embed)
    x = rng.normal(0, 1, (5, D)).astype(np.float32)
    got = heads.propose(x)
    for s in range(5):
        for k in range(K):
            z = W[k] @ x[s] + b[k]
            h = x[s] + z / (1 + np.exp(-z))
            assert got[s, k] == vocab[np.argmax(embed @ h)]
    zero = Heads(np.zeros_like(W), np.zeros_like(b), vocab, embed)     # identity heads: the
    assert (zero.propose(x) == vocab[np.argmax(x @ embed.T, 1)][:, None]).all()   # LM head's pick


def test_heads_run_only_where_they_can_pay_for_their_own_time():
    from socllm.policies.drafting import Speculator
    s = Speculator("auto", 8, 8, {1: 0.008, 2: 0.009, 3: 0.0095, 4: 0.010})
    s.heads_s = 0.001
    assert s._heads_pay(s.costs.table(), 0.6, 3, 1)              # 1.6 tokens in 10 ms against 1 in 8
    assert not s._heads_pay(s.costs.table(), 0.15, 3, 1)         # 1.15 in 10 ms: not worth it
    s.heads_s = 0.0
    assert s._heads_pay(s.costs.table(), 0.3, 3, 1)              # free heads: 1.3 in 9 ms
    assert not s._heads_pay(s.costs.table(), 0.15, 3, 1)         # 1.15 in 9 ms: within the margin of 1 in 8
    assert not s._heads_pay(s.costs.table(), 0.9, 3, 8)          # a full step has no row for them


def test_heads_give_each_heads_likeliest_tokens_in_order():
    from socllm.policies.drafting import Heads
    rng = np.random.default_rng(2)
    K, D, V = 3, 16, 40
    heads = Heads(rng.normal(0, 0.3, (K, D, D)).astype(np.float32),
                  rng.normal(0, 0.1, (K, D)).astype(np.float32), rng.choice(1000, V, replace=False),
                  rng.normal(0, 1, (V, D)).astype(np.float32))
    x = rng.normal(0, 1, (4, D)).astype(np.float32)
    top = heads.propose(x, 3)
    assert top.shape == (4, K, 3) and (top[:, :, 0] == heads.propose(x)).all()
    z = (x @ heads.Wt).reshape(4, K, D) + heads.b
    logits = (x[:, None, :] + z / (1 + np.exp(-z))) @ heads.Et
    want = heads.vocab[np.argsort(-logits, axis=2, kind="stable")[:, :, :3]]
    assert (top == want).all()


def test_hydra_heads_each_see_the_token_before_their_own():
    """Hydra's sequentially dependent heads: head 1 sees the row's next token, head k the token
    head k-1 drafted; a next token outside the subset is a zero embedding."""
    from socllm.policies.drafting import Heads
    rng = np.random.default_rng(3)
    K, D, V = 3, 16, 40
    W, b = rng.normal(0, 0.3, (K, D, D)).astype(np.float32), rng.normal(0, 0.1, (K, D)).astype(np.float32)
    A = rng.normal(0, 0.5, (K, D, D)).astype(np.float32)
    vocab = rng.choice(1000, V, replace=False)
    embed = rng.normal(0, 1, (V, D)).astype(np.float32)
    heads = Heads(W, b, vocab, embed, A=A)
    x = rng.normal(0, 1, (4, D)).astype(np.float32)
    outside = next(t for t in range(5000) if t not in set(vocab.tolist()))
    last = np.array([vocab[0], vocab[7], outside, 99999])
    got = heads.propose(x, last=last)
    for s in range(4):
        e = embed[list(vocab).index(last[s])] if last[s] in vocab else np.zeros(D, np.float32)
        for k in range(K):
            z = W[k] @ x[s] + A[k] @ e + b[k]
            tok = vocab[np.argmax(embed @ (x[s] + z / (1 + np.exp(-z))))]
            assert got[s, k] == tok
            e = embed[list(vocab).index(tok)]
    top = heads.propose(x, 2, last)
    assert top.shape == (4, K, 2) and (top[:, :, 0] == got).all()
    plain = Heads(W, b, vocab, embed, A=np.zeros_like(A))       # A = 0: Medusa's heads
    assert (plain.propose(x, last=last) == Heads(W, b, vocab, embed).propose(x)).all()


def _tree_brute(top, rates, depth, width):
    """Every node (a path of ranks) with its chance, the likeliest `width` of them."""
    K, R = top.shape
    nodes = [(np.prod([rates[r] for r in path]), path)
             for d in range(1, min(depth, K) + 1) for path in itertools.product(range(R), repeat=d)]
    return sorted(nodes, key=lambda n: -n[0])[:width]


@pytest.mark.parametrize("rates", [[0.7, 0.2], [0.3, 0.25, 0.1], [0.9, 0.05]])
def test_tree_candidates_are_the_likeliest_paths_parents_first(rates):
    from socllm.policies.drafting import Tree, tree_candidates
    top = np.arange(4 * len(rates)).reshape(4, len(rates)) + 100
    for depth, width in ((4, 8), (2, 5), (3, 16)):
        tokens, parents, ranks, chances = tree_candidates(top, rates, depth, width)
        want = _tree_brute(top, rates, depth, width)
        assert sorted(chances, reverse=True) == chances
        assert chances == pytest.approx([c for c, _ in want])
        for i, p in enumerate(parents):                       # a node's path: its parent's + its rank
            assert p < i and chances[i] == pytest.approx((chances[p] if p >= 0 else 1) * rates[ranks[i]])
            d, a = 1, p
            while a >= 0:
                d, a = d + 1, parents[a]
            assert tokens[i] == top[d - 1, ranks[i]]
        t = Tree.laid_out(tokens, parents, ranks)
        # the chain of rank-0 nodes first, at their own positions; every node after its parent
        assert t.rank[:t.chain] == [0] * t.chain and t.parents[:t.chain] == list(range(-1, t.chain - 1))
        assert all(p < i for i, p in enumerate(t.parents)) and sorted(t.tokens) == sorted(tokens)


def test_a_trees_entries_name_the_prefix_and_each_nodes_ancestors():
    from socllm.policies.drafting import Tree
    t = Tree([7, 8, 9, 10, 11], [-1, 0, -1, 2, 0], [0, 0, 1, 0, 1])
    pos, at, ent = t.entries(40)
    assert t.chain == 2 and list(pos) == [41, 42, 41, 42, 42] and list(at) == [41, 42, 43, 44, 45]
    assert (ent[:2] == 0).all()                                  # chain nodes: keys 0 .. position
    assert [tuple(e) for e in ent[2:]] == [(41, 41, 0b100, 0), (41, 41, 0b1100, 0), (41, 41, 0b10001, 0)]
    assert t.child(-1, 9) == 2 and t.child(0, 11) == 4 and t.child(0, 9) is None
    assert t.in_place(-1) and t.in_place(1) and not t.in_place(2)
    assert t[:3].tokens == [7, 8, 9] and len(t[:9]) == 5
    with pytest.raises(ValueError):
        Tree([1, 2], [1, -1], [0, 0])                            # a parent after its child


def test_the_chooser_takes_a_trees_nodes_best_first_while_they_pay():
    from socllm.policies.drafting import choose_rows
    cost = [0] + [1.0 + 0.1 * k for k in range(1, 17)]
    chances = [0.6, 0.36, 0.2, 0.12, 0.05, 0.02]
    [k] = choose_rows(cost, [chances], 16)
    tokens = 1 + sum(chances[:k])
    assert tokens / cost[1 + k] == max((1 + sum(chances[:j])) / cost[1 + j] for j in range(7))
    # rows fed again count: a step of 15 rows already has room for one draft
    assert choose_rows(cost, [chances], 16, rows=15) == [1]


def test_a_new_sequence_expects_what_the_services_drafts_from_the_same_source_did():
    """A sequence's acceptance by source starts from (and drifts back to) the service's rate for
    that source: where a verifying step costs several plain ones (a GPU: 8 ms against 3), a fixed
    prior below the break-even would never let a sequence try drafts that pay."""
    from types import SimpleNamespace
    from socllm.policies.drafting import Speculator
    s = Speculator("auto", 8, 8)
    seqs = [SimpleNamespace(spec=Speculation("auto", service=s.by_n)) for _ in range(3)]
    for q in seqs[:2]:
        q.spec.n = 3
        for _ in range(40):                        # 3-gram lookups: 7 of 8 accepted
            s.verified(q, 8, 7)
    fresh = seqs[2].spec
    assert fresh.rate(3) == pytest.approx(s.by_n[3].rate) and s.by_n[3].rate > 0.8
    assert fresh.rate(1) == 0.5                    # a source no sequence drafted from yet
    fresh.n = 3
    s.verified(seqs[2], 8, 0)                      # its own miss, then unused: back up towards 0.8+
    low = fresh.rate(3)
    for _ in range(30):
        fresh.n = 1
        s.verified(seqs[2], 0, 0)
    assert low < fresh.rate(3) <= s.by_n[3].rate


def test_with_reactive_rows_in_a_step_only_they_draft_under_the_agent_policy():
    """Agent.xpu §4.5 ②: a reactive stream's step carries proactive rows only within its
    slowdown budget, so their drafts (more rows, for tokens no one waits for) are not added; the
    reactive row drafts for its own tokens a second. A batch of one class drafts as before."""
    from types import SimpleNamespace
    from socllm.policies.drafting import Speculator
    profile = {n: 0.010 + 0.0002 * n for n in range(1, 9)}      # rows nearly free: drafts pay

    def seq(priority):
        ids = [5, 6, 7, 8, 9] * 20                               # the lookup always finds a draft
        return SimpleNamespace(speculate=None, spec=None, rows=len(ids), lag=0, tokens=[], ids=ids,
                               params=SimpleNamespace(max_tokens=50), constraint=None, priority=priority)

    mixed = lambda: [seq("proactive"), seq("reactive"), seq("proactive")]
    plain = Speculator("auto", 8, 8, profile).drafts(mixed(), 4096)
    assert all(plain)                                           # every row drafts
    first = Speculator("auto", 8, 8, profile, reactive_first=True).drafts(mixed(), 4096)
    assert first[0] == [] == first[2] and len(first[1]) >= 2
    assert first[1] == [5, 6, 7, 8, 9][:len(first[1])]           # the lookup's continuation
    alone = Speculator("auto", 8, 8, profile, reactive_first=True).drafts([seq("proactive")] * 2, 4096)
    assert all(alone)


def test_a_steps_rows_feed_lagging_rows_again_then_each_draft_at_its_place():
    from types import SimpleNamespace
    from socllm.policies.drafting import Tree, step_rows
    # a: 10 rows, the last 2 fed again (a tree's path off its chain), a chain draft;
    # b: 6 rows, a tree draft
    a = SimpleNamespace(rows=10, lag=2, tokens=[1, 2, 3, 4], slot=0)
    b = SimpleNamespace(rows=6, lag=0, tokens=[7, 8], slot=1)
    tree = Tree([50, 51, 52], [-1, 0, -1], [0, 0, 1])
    rows, (at, ent) = step_rows([a, b], [[40, 41], tree])
    assert rows == [(2, 7, 0), (3, 8, 0), (4, 9, 0), (40, 10, 0), (41, 11, 0),
                    (8, 5, 1), (50, 6, 1), (51, 7, 1), (52, 6, 1)]
    assert list(at) == [7, 8, 9, 10, 11, 5, 6, 7, 8]          # the side node writes past the chain
    assert (ent[:8] == 0).all() and list(ent[8]) == [6, 6, 0b100, 0]
    rows, tree_arg = step_rows([a, b], [[40], []])
    assert tree_arg is None and len(rows) == 5


def _toy_model(V: int = 3):
    """A toy model over V tokens: the next token's distribution after any prefix (fixed per
    prefix, none near zero)."""
    cache = {}

    def cond(prefix: tuple) -> np.ndarray:
        if prefix not in cache:
            seed = sum((t + 1) * 7 ** i for i, t in enumerate(prefix)) + 11 * len(prefix)
            cache[prefix] = np.random.default_rng(seed).dirichlet(np.full(V, 4.0))
        return cache[prefix]
    return cond


def test_tree_verification_samples_plain_decodings_distribution():
    """Speculative sampling's distribution through draft trees (policies/drafting.py walk): three
    tokens generated by steps that each verify a fixed tree (point-mass drafts, some never right),
    every row sampled from the model's distribution after exactly its path, against the model's
    own joint distribution of three tokens: a chi-square test over 27 cells and 30,000 seeds'
    worth of draws (p > 0.001); one that samples a node's row as if it followed the root's
    context fails it."""
    from socllm.policies.drafting import Tree, walk
    V, N, cond = 3, 30000, _toy_model()
    tree = Tree([0, 2, 1, 0, 1], [-1, 0, -1, 2, 1], [0, 0, 1, 0, 0])
    rng = np.random.default_rng(5)

    def generate(wrong: bool) -> tuple:
        out = []
        while len(out) < 3:
            def sample(node, base=tuple(out)):
                path, a = [], node
                while a >= 0:
                    path.append(tree.tokens[a])
                    a = tree.parents[a]
                ctx = base if wrong else base + tuple(path[::-1])
                tok = int(rng.choice(V, p=cond(ctx)))
                out.append(tok)
                return None if len(out) == 3 else tok
            walk(tree, sample)
        return tuple(out)

    want = np.array([cond(())[a] * cond((a,))[b] * cond((a, b))[c]
                     for a in range(V) for b in range(V) for c in range(V)]) * N
    assert want.min() > 5
    for wrong, ok in ((False, True), (True, False)):
        counts = collections.Counter(generate(wrong) for _ in range(N))
        got = np.array([counts[(a, b, c)] for a in range(V) for b in range(V) for c in range(V)])
        chi2 = float(((got - want) ** 2 / want).sum())
        assert (chi2 < 54.05) == ok, (wrong, chi2)       # df 26: p = 0.001 at 54.05


def test_a_prediction_drafts_in_step_then_by_its_ngrams():
    """policies/drafting.predicted: while the reply has followed the prediction token for token,
    its next tokens (source PREDICTED); once they differ, what followed the sequence's longest
    suffix inside the prediction (an n-gram source); nothing where the suffix is not in it."""
    from socllm.policies.drafting import PREDICTED, Prediction, Speculation, predicted
    pred = Prediction([5, 6, 7, 8, 9, 10, 11])
    sp = Speculation("auto")
    assert predicted(sp, pred, [], [1, 2], 3) == ([5, 6, 7], PREDICTED)
    assert predicted(sp, pred, [5, 6], [1, 2, 5, 6], 3) == ([7, 8, 9], PREDICTED)
    # the reply wrote 99 where 7 was predicted, then 8 again: it goes on from the prediction's 8
    assert predicted(sp, pred, [5, 6, 99, 8], [1, 2, 5, 6, 99, 8], 2) == ([9, 10], PREDICTED - 1)
    assert predicted(sp, pred, [5, 6, 99, 9, 10], [1, 5, 6, 99, 9, 10], 4) == ([11], PREDICTED - 2)
    assert predicted(sp, pred, [42], [1, 42], 3) == ([], 0)


def test_a_prediction_left_is_rejoined_where_the_reply_is_not_at_its_last_copy():
    """A prediction whose lines repeat (code, a table): once the reply has left it, its n-gram is
    looked up from the place the reply had reached on, so the next line drafted is the one after
    the edited line, not the prediction's last copy of it."""
    from socllm.policies.drafting import PREDICTED, Prediction, Speculation, predicted
    pred = Prediction([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 7])
    sp = Speculation("auto")
    assert predicted(sp, pred, [1, 2, 3], [0, 1, 2, 3], 1) == ([9], PREDICTED)
    # the first line's 9 became 55; the reply goes on with the second line
    assert predicted(sp, pred, [1, 2, 3, 55, 1], [0, 1, 2, 3, 55, 1], 3) == ([2, 3, 8], PREDICTED - 1)
    assert predicted(sp, pred, [1, 2, 3, 55, 1, 2, 3, 8], [0, 1, 2, 3, 55, 1, 2, 3, 8], 4) == (
        [1, 2, 3, 7], PREDICTED - 3)
    # a reply that goes back to a line it passed gets the nearest copy before
    assert predicted(sp, pred, [1, 2, 3, 55, 1, 2, 3, 8, 3, 9], [3, 9], 2) == ([1, 2], PREDICTED - 2)


def test_with_a_prediction_its_usage_counts_only_the_predictions_drafts():
    """OpenAI's accepted/rejected_prediction_tokens: with a prediction, the tokens it drafted;
    without one, every drafter's (what the fields mean here for a request with none)."""
    from socllm.policies.drafting import PREDICTED, Prediction, Speculation, predicted
    sp = Speculation("auto")
    sp.n = 2
    sp.update(4, 3)                                   # a prompt lookup's draft
    assert sp.usage() == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}
    predicted(sp, Prediction([5, 6, 7]), [], [1], 2)
    sp.n = PREDICTED
    sp.update(2, 2)
    sp.n = PREDICTED - 1
    sp.update(3, 1)
    assert sp.usage() == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 2}
