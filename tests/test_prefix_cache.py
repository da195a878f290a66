"""The prefix cache's bookkeeping (memory/blocks.py) through the policies' admission: pure, no Ray.
The served path (a cached prefix gives the cold request's tokens) is in test_service.py."""
from __future__ import annotations

import socllm.memory.blocks as blocks
from socllm.memory.blocks import BlockPool
from socllm.policies.agent import AgentPolicy
from socllm.policies.request import Request
from socllm.policies.sampling import SamplingParams
from socllm.policies.scheduler import FCFS

BR = 16


def req(i, prompt, max_tokens=8, **kw):
    return Request(i, list(prompt), SamplingParams(max_tokens=max_tokens), **kw)


def run_prefill(policy, r):
    """What the engine's loop does for a request the policy admitted: its rows computed, its full
    blocks named, a token sampled."""
    r.computed = r.rows
    policy.kv.publish(r.blocks, r.names, r.ids, r.computed)
    r.tokens.append(7)


def served(policy, r):
    policy.add(r)
    assert r in policy.schedule().prefill
    run_prefill(policy, r)
    return r


def test_a_second_request_with_the_same_prefix_prefills_only_the_rest():
    s = FCFS(4, 10_000, BlockPool(20, BR))
    a = served(s, req(1, range(40)))
    s.finish(a)                                   # its blocks stay cached, unheld
    assert s.kv.n_used == 0
    assert s.kv.n_cached == 3                     # and its partly filled tail block (8 rows)
    b = req(2, [*range(35), 99, 98, 97, 96, 95])  # the first 35 tokens shared: 2 full blocks
    s.add(b)                                      # and 3 rows of a's tail block, taken over
    assert s.schedule().prefill == [b]
    assert b.computed == b.cached == 35 and b.blocks[:2] == a_blocks(s, range(32))
    assert b.usage()["prompt_tokens_details"] == {"cached_tokens": 35}
    assert (s.kv.queries, s.kv.hits) == (80, 35)


def a_blocks(s, tokens):
    """The blocks the cache holds for these leading tokens (a fresh lookup, released again)."""
    table, names = [], []
    s.kv.match(table, names, list(tokens) + [0], len(tokens) + 1)
    found = list(table)
    s.kv.release(table, names)
    return found


def test_the_last_prompt_row_is_always_computed():
    s = FCFS(4, 10_000, BlockPool(20, BR))
    s.finish(served(s, req(1, range(32))))
    b = req(2, range(32))                         # the very same prompt: its logits are needed
    s.add(b)
    s.schedule()
    assert b.computed == 31                       # all but the last row (block 2 taken over)


def test_a_hit_is_checked_token_by_token(monkeypatch):
    monkeypatch.setattr(blocks, "chain", lambda parent, tokens: 42)   # every block collides
    s = FCFS(4, 10_000, BlockPool(20, BR))
    s.finish(served(s, req(1, range(40))))
    b = req(2, range(100, 140))
    s.add(b)
    s.schedule()
    assert b.computed == 0 and b.cached == 0


def test_requests_running_at_once_share_blocks_by_reference():
    s = FCFS(4, 10_000, BlockPool(20, BR))
    a = served(s, req(1, range(40)))
    b = served(s, req(2, [*range(32), *range(50, 60)]))
    assert b.blocks[:2] == a.blocks[:2] and b.cached == 32
    assert s.kv.refs[a.blocks[0]] == 2
    s.finish(a)
    assert s.kv.refs[b.blocks[0]] == 1 and b.blocks[0] not in s.kv.free   # b still holds it


def test_a_preempted_request_keeps_shared_blocks_alive_and_hits_them_again():
    s = FCFS(4, 10_000, BlockPool(6, BR))        # 96 rows
    a = served(s, req(1, range(40), max_tokens=40))
    b = served(s, req(2, [*range(32), 70, 71], max_tokens=40))
    shared = a.blocks[:2]
    while not s.waiting:                          # both decode until the pool runs dry
        batch = s.schedule()
        for r in batch.decode:
            r.computed += 1
            s.kv.publish(r.blocks, r.names, r.ids, r.computed)
            r.tokens.append(len(r.tokens))
    victim = s.waiting[0]
    assert victim is b and victim.computed == 0 and victim.blocks == []
    assert a.blocks[:2] == shared and all(s.kv.refs[x] == 1 for x in shared)
    s.finish(a)
    s.schedule()                                  # b comes back: its full blocks are cached
    assert b in s.running and b.computed >= 32 and b.blocks[:2] == shared


def test_eviction_takes_blank_blocks_then_never_hit_ones_and_never_a_held_one():
    s = FCFS(4, 10_000, BlockPool(10, BR))
    sys_prompt = list(range(1000, 1032))           # two blocks every request starts with
    s.finish(served(s, req(1, [*sys_prompt, *range(16), 5])))
    s.finish(served(s, req(2, [*sys_prompt, *range(200, 216), 5])))   # hits the system prompt
    held = served(s, req(3, [*sys_prompt, 3]))                         # holds it now
    # cached: the system prompt (hit, held), request 1's and 2's third block and one-row tail
    # block (never hit); 3 blocks blank
    assert s.kv.n_cached == 4 and len(s.kv.free) == 3
    big = req(4, range(500, 500 + 5 * BR))         # needs 5 blocks: 3 blank and 2 idle ones
    s.add(big)
    assert s.schedule().prefill == [big]
    assert s.kv.evicted == 2 and held.blocks[:2] == a_blocks(s, sys_prompt)
    assert set(held.blocks).isdisjoint(big.blocks)


def test_blocks_that_were_hit_are_evicted_after_those_that_were_not():
    kv = BlockPool(4, BR)
    s = FCFS(4, 10_000, kv)
    s.finish(served(s, req(1, [*range(16), 1])))          # block of tokens 0..15
    s.finish(served(s, req(2, [*range(16), 2])))          # hits it
    s.finish(served(s, req(3, [*range(100, 116), 3])))    # a block never hit, released later
    s.add(big := req(4, range(300, 300 + 2 * BR + 1)))    # 3 blocks: 2 blank... and one idle
    s.schedule()
    assert a_blocks(s, range(16)) != [] and a_blocks(s, range(100, 116)) == []


def _runs(table: list) -> int:
    """How many runs of consecutive ascending block ids a block table is."""
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:]))


def test_sequences_growing_at_once_each_take_a_run_of_blocks():
    """Four sequences take their prompt's 2 blocks, then grow a block each in turn (decode
    steps of a batch): each table is one run, no two runs collide, and the runs start near
    the start of the region (the pages touched stay few)."""
    kv = BlockPool(200, BR)
    tables = [[] for _ in range(4)]
    for t in tables:
        kv.grow(t, 2 * BR)
    for rows in range(3 * BR, 9 * BR + 1, BR):          # 7 more blocks each, interleaved
        for t in tables:
            kv.grow(t, rows)
    assert [_runs(t) for t in tables] == [1, 1, 1, 1], tables
    assert len({b for t in tables for b in t}) == 36 and max(max(t) for t in tables) < 64


def test_blocks_evicted_in_lru_order_come_back_as_ascending_runs():
    """With no blank block left, a new sequence takes the least recently released sequence's
    blocks from the first of its run on, and grows into the next of them: its table is a run
    again, not that run backwards (a release hands its blocks back tail first)."""
    kv = BlockPool(32, BR)
    old = [[] for _ in range(4)]
    for t in old:
        kv.grow(t, 8 * BR)
    ids = list(range(8 * BR))
    for k, t in enumerate(old):
        names = []
        kv.publish(t, names, [k * 1000 + i for i in ids], 8 * BR)    # named: cached on release
        kv.release(t, names)
    assert not kv.free and kv.n_cached == 32
    new = []
    kv.grow(new, 3 * BR)
    for rows in range(4 * BR, 8 * BR + 1, BR):
        kv.grow(new, rows)
    assert _runs(new) == 1 and kv.evicted == 8, new


def test_the_cache_off_finds_nothing():
    s = FCFS(4, 10_000, BlockPool(20, BR, cache=False))
    s.finish(served(s, req(1, range(40))))
    b = req(2, range(40))
    s.add(b)
    s.schedule()
    assert b.computed == 0 and s.kv.n_cached == 0 and s.kv.stats()["hits"] == 0


def test_a_reactive_request_hits_the_cache_a_proactive_one_filled():
    s = AgentPolicy(4, 10_000, BlockPool(20, BR))
    s.finish(served(s, req(1, range(40), priority="proactive")))
    r = req(2, [*range(32), 9, 9], priority="reactive")
    s.add(r)
    assert r in s.schedule().prefill and r.cached == 32


def test_a_chats_next_turn_reuses_the_last_turns_partial_block_token_by_token():
    s = FCFS(4, 10_000, BlockPool(20, BR))
    turn1 = [*range(100, 150)]                     # 50 rows: 3 full blocks and 2 rows
    a = served(s, req(1, turn1))
    a.tokens += [7, 8, 9]                          # its reply
    a.computed = a.rows - 1
    s.kv.publish(a.blocks, a.names, a.ids, a.computed)
    tail = a.blocks[3]
    s.finish(a)
    turn2 = a.ids + [200, 201, 202]                # the history, then the next question
    b = req(2, turn2)
    s.add(b)
    s.schedule()
    assert b.cached == b.computed == 53 and b.blocks[3] == tail   # its rows 48..52 reused
    assert s.kv.n_cached == 0                      # taken over: nobody else can find it now


def test_a_held_block_is_never_taken_over():
    s = FCFS(4, 10_000, BlockPool(20, BR))
    a = served(s, req(1, range(40)))               # running: holds its blocks
    b = req(2, [*range(20), 77, 78, 79])
    s.add(b)
    s.schedule()
    assert b.computed == 16 and b.blocks[0] == a.blocks[0] and a.blocks[1] not in b.blocks


def test_past_its_bound_the_cache_lets_the_least_recently_released_never_hit_blocks_go():
    s = FCFS(4, 10_000, BlockPool(20, BR, cache_max=3))
    sys_prompt = list(range(1000, 1032))
    s.finish(served(s, req(1, [*sys_prompt, *range(32), 5])))      # 4 full blocks + a tail
    s.finish(served(s, req(2, [*sys_prompt, *range(200, 232), 5])))  # hits the system prompt
    # kept: 3 (the bound); the system prompt's two blocks, hit, outlast every never-hit one
    assert s.kv.n_cached == 3 and s.kv.evicted == 5
    assert len(a_blocks(s, sys_prompt)) == 2
    assert a_blocks(s, [*sys_prompt, *range(32)])[2:] == []          # request 1's went first
    assert s.kv.stats()["cached_blocks_max"] == 3


def test_trim_hands_over_the_written_free_blocks_below_the_top_of_the_stack():
    kv = BlockPool(20, BR, cache=False)
    s = FCFS(4, 10_000, kv)
    assert kv.trim(0) == []                        # nothing written yet: nothing to give back
    a, b = served(s, req(1, range(5 * BR))), served(s, req(2, range(2 * BR)))
    assert len(a.blocks) == 6                     # 80 rows, and the next token's row
    held, a_blocks_ = list(b.blocks), list(a.blocks)
    s.finish(a)                                    # released last block first: a's first on top
    assert kv.trim(2) == sorted(a_blocks_[2:])      # the two on top are the next taken: kept
    assert kv.trim(2) == []                        # handed over once
    assert kv.stats()["trimmed_blocks"] == 4
    c = served(s, req(3, range(BR)))               # a block taken is written again once freed
    c_blocks = list(c.blocks)
    s.finish(c)
    assert set(kv.trim(0)) == set(a_blocks_[:2]) | set(c_blocks)
    assert set(held).isdisjoint(a_blocks_ + c_blocks)      # a held block is never handed over


def test_dropping_the_cache_frees_every_kept_block_for_trim_and_no_held_one():
    """An idle service lets its whole prefix cache go (ServeConfig.prefix_cache_idle_s): every
    block kept for a later hit goes to the free stack, written, so trim hands it over; a block a
    running sequence holds keeps its name, and a later request finds it (and only it)."""
    s = FCFS(4, 10_000, BlockPool(20, BR))
    a = served(s, req(1, range(40)))               # 40 rows: 2 full blocks and a tail
    a_blocks_ = list(a.blocks)
    s.finish(a)
    b = served(s, req(2, [*range(100, 140)]))       # running: holds its blocks
    kept, held = s.kv.n_cached, list(b.blocks)
    assert kept == 3
    assert s.kv.drop_cached() == kept and s.kv.n_cached == 0
    assert s.kv.stats()["dropped_blocks"] == kept and s.kv.drop_cached() == 0
    given = s.kv.trim(0)
    assert set(a_blocks_) <= set(given) and set(held).isdisjoint(given)
    again = req(3, range(40))                      # a's prompt: found nowhere now
    s.add(again)
    s.schedule()
    assert again.cached == again.computed == 0
    c = req(4, [*range(100, 116), 5])               # b's first block: still named, still found
    s.add(c)
    s.schedule()
    assert c.computed == BR and c.blocks[0] == held[0]
