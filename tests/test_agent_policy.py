"""The agent policy alone (policies/agent.py, no Ray): queue order, the reactive-first batch cap
and its eviction rules, slot preemption, aging."""
from __future__ import annotations

from socllm.memory.blocks import BlockPool
from socllm.policies.agent import AgentPolicy
from socllm.policies.request import Request
from socllm.policies.sampling import SamplingParams


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def policy(max_seqs=8, blocks=100, b_rf=3, aging_s=30.0, profile=None):
    clock = Clock()
    return AgentPolicy(max_seqs, 10_000, BlockPool(blocks, block_rows=16), b_rf, aging_s, clock,
                       profile), clock


def req(i, clock, priority="proactive", prompt=8, max_tokens=16):
    return Request(i, list(range(prompt)), SamplingParams(max_tokens=max_tokens), priority=priority,
                   arrival=clock.t + i * 1e-3)


def prefill(p, reqs):
    """As the loop does: every admitted request's rows computed and one token sampled."""
    for r in reqs:
        r.computed, r.tokens = len(r.prompt), [1]


def admitted(p, reqs, prefilled=True) -> list:
    """reqs added and admitted in one schedule (and prefilled, as the loop would)."""
    for r in reqs:
        p.add(r)
    p.schedule()
    if prefilled:
        prefill(p, reqs)
    return reqs


def test_reactive_requests_prefill_first_and_proactive_prefill_waits_for_them():
    """§4.3 ⑤: proactive prefill is deferred while reactive work runs (these cores are shared),
    then goes on in arrival order."""
    p, clock = policy()
    early = [req(i, clock) for i in range(3)]
    late = req(3, clock, "reactive")
    for r in early + [late]:
        p.add(r)
    assert [r.id for r in p.schedule().prefill] == [3]
    prefill(p, [late])
    assert [r.id for r in p.schedule().prefill] == []       # it decodes: still deferred
    p.finish(late)
    assert [r.id for r in p.schedule().prefill] == [0, 1, 2]


def test_a_reactive_arrival_takes_the_next_chunk_and_the_proactive_resumes_where_it_stopped():
    p, clock = policy()
    long = req(0, clock, prompt=300)
    p.add(long)
    assert p.schedule().prefill == [long]
    long.computed = 128                       # one chunk done
    p.add(r := req(1, clock, "reactive"))
    assert p.schedule().prefill == [r] and long.computed == 128 and long in p.running
    p.finish(r)
    assert p.schedule().prefill == [long] and long.computed == 128


def test_an_aged_proactive_prefill_is_not_deferred():
    p, clock = policy(aging_s=30.0)
    old = req(0, clock)
    p.add(old)
    admitted(p, [req(1, clock, "reactive")])
    assert old in p.running and p.schedule().prefill == []
    clock.t += 31
    assert p.schedule().prefill == [old]


def test_homogeneous_batches_take_everyone():
    p, clock = policy(b_rf=3)
    reqs = admitted(p, [req(i, clock) for i in range(6)])
    assert p.schedule().decode == reqs


def test_a_mixed_batch_is_capped_evicting_longest_then_newest_proactive_rows():
    p, clock = policy(b_rf=3)
    pro = admitted(p, [req(i, clock, prompt=n) for i, n in enumerate([40, 8, 8, 100])])
    admitted(p, [req(9, clock, "reactive")])
    decode = p.schedule().decode
    # the reactive row, then 2 proactive: the shortest (8 rows), the older of the two
    assert sorted(r.id for r in decode) == [1, 2, 9]
    assert all(r in p.running and r.blocks for r in pro)   # evicted rows keep their KV


PROFILE = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013}       # a decode step of n rows at position 0


def test_the_step_model_learns_what_each_key_attended_costs():
    from socllm.policies.agent import StepModel
    m = StepModel(PROFILE)
    truth = lambda n, keys: PROFILE[n] + 5e-6 * (keys - n)
    for i in range(StepModel.WARM - 1):
        m.observe(1 + i % 4, 300 + 97 * i, truth(1 + i % 4, 300 + 97 * i))
    assert m.predict(1, 700) is None                       # not before WARM steps
    m.observe(2, 1500, truth(2, 1500))
    assert abs(m.per_key - 5e-6) < 1e-9
    assert abs(m.predict(3, 2100) - truth(3, 2100)) < 1e-9


def test_a_mixed_batch_takes_proactive_rows_only_while_their_lengths_keep_the_step_short():
    """§4.5 ②: a step's time grows with its rows' lengths as well as their number; a long
    proactive row is left out where b_rf alone (from the profile at position 0) would take it."""
    p, clock = policy(b_rf=3, blocks=400, profile=PROFILE)
    for i in range(40):                                    # steps as they ran: 5 µs a key
        p.observe(1 + i % 4, 200 + 50 * i, PROFILE[1 + i % 4] + 5e-6 * (200 + 50 * i - 1 - i % 4))
    short, long = admitted(p, [req(0, clock, prompt=99), req(1, clock, prompt=1299)])
    rx, = admitted(p, [req(2, clock, "reactive", prompt=699)])
    # alone: 10 ms + 699 keys = 13.5 ms (limit 16.9); with the short row 15.0; the long one 22.5
    assert sorted(r.id for r in p.schedule().decode) == [0, 2]
    p.finish(rx)
    assert sorted(r.id for r in p.schedule().decode) == [0, 1]       # one class: everyone
    q, clock = policy(b_rf=3, blocks=400, profile=PROFILE)           # no steps seen yet: b_rf
    admitted(q, [req(0, clock, prompt=99), req(1, clock, prompt=1299)])
    admitted(q, [req(2, clock, "reactive", prompt=699)])
    assert sorted(r.id for r in q.schedule().decode) == [0, 1, 2]


def test_a_reactive_request_preempts_the_newest_proactive_when_every_slot_is_taken():
    p, clock = policy(max_seqs=2)
    pro = admitted(p, [req(i, clock) for i in range(2)], prefilled=False)   # both prefilling
    p.add(rx := req(5, clock, "reactive"))
    b = p.schedule()
    assert b.preempted == [pro[1]] and rx in p.running and not pro[1].blocks
    assert p.queues()["waiting_proactive"] == [1]


def test_a_reactive_request_takes_a_slot_from_the_decode_batch_when_all_decode():
    p, clock = policy(max_seqs=2)
    pro = admitted(p, [req(i, clock) for i in range(2)])                  # both decoding
    p.add(rx := req(5, clock, "reactive"))
    b = p.schedule()
    assert b.preempted == [pro[1]] and b.decode == [pro[0]] and rx in p.running
    assert pro[1].computed == 0 and not pro[1].blocks       # prefills prompt and tokens again


def test_aged_proactive_requests_jump_the_proactive_queue_and_bypass_the_cap():
    p, clock = policy(b_rf=1, aging_s=30.0)
    old = req(0, clock)
    p.add(old)
    clock.t += 10
    young = [req(i, clock) for i in (1, 2)]
    for r in young:
        p.add(r)
    clock.t += 25                              # old is 35 s old, the others 25
    assert p.schedule().prefill[0] is old
    prefill(p, [old, *young])
    rx, = admitted(p, [req(3, clock, "reactive")])
    decode = p.schedule().decode
    assert rx in decode and old in decode and not any(r in decode for r in young)


def test_a_proactive_request_that_decodes_is_not_aged_however_old():
    """Aging guards against postponement: a decoding row with a recent token stays capped; one
    with none for aging_s is promoted."""
    p, clock = policy(b_rf=1, aging_s=30.0)
    old, = admitted(p, [req(0, clock)])
    clock.t += 35
    old.last_token = clock.t - 1                # it decoded a second ago
    rx, = admitted(p, [req(3, clock, "reactive")])
    assert p.schedule().decode == [rx]
    clock.t += 30                               # 31 s without a token: left out, promoted
    assert sorted(r.id for r in p.schedule().decode) == [0, 3]


def test_finish_frees_blocks_from_either_queue():
    p, clock = policy(max_seqs=1)
    a, b = req(0, clock), req(1, clock, "reactive")
    p.add(a)
    p.schedule()
    p.add(b)
    p.finish(a)
    assert p.kv.n_used == 0
    p.schedule()
    p.finish(b)
    assert p.kv.n_used == 0 and not p.running and not p.queues()["waiting"]


def test_b_rf_is_the_largest_batch_within_the_reactive_slowdown():
    from socllm.policies.agent import B_RF, b_rf_from_profile
    profile = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.0124, 5: 0.013, 6: 0.0121, 8: 0.020}
    assert b_rf_from_profile(profile, slowdown=0.25) == 4       # 5 exceeds 12.5 ms: 6 never counts
    assert b_rf_from_profile(profile, slowdown=1.0) == 8
    assert b_rf_from_profile({1: 0.01, 2: 0.02}, slowdown=0.25) == 1
    assert b_rf_from_profile({}) == B_RF


def test_a_proactive_first_chunk_runs_whole_only_where_it_took_at_most_the_bound():
    """Agent.xpu §4.4 ②: no proactive work that cannot stop midway may take longer than a reactive
    arrival is allowed to wait (PREEMPT_BOUND_S). A prompt's first chunk on the NPU's static
    graph cannot stop between layers: the engine runs it whole only where the runner timed such
    chunks at most at the bound; else, and for a chunk past the prompt's start, spans."""
    from types import SimpleNamespace as NS

    from socllm.actors.engine import Engine
    from socllm.policies.agent import PREEMPT_BOUND_S
    asked = []

    def engine(took):
        def whole_chunk_s(n, slot):
            asked.append((n, slot))
            return took
        return NS(config=NS(prefill_chunk=128), scheduler=NS(bound_s=AgentPolicy.bound_s),
                  runner=NS(whole_chunk_s=whole_chunk_s))
    seq = NS(computed=0, embed=None, prompt=list(range(90)), tokens=[], slot=3)
    assert AgentPolicy.bound_s == PREEMPT_BOUND_S
    assert Engine._whole_within_bound(engine(0.8 * PREEMPT_BOUND_S), seq)
    assert not Engine._whole_within_bound(engine(1.2 * PREEMPT_BOUND_S), seq)
    assert not Engine._whole_within_bound(engine(None), seq)        # never timed
    assert asked == [(90, 3)] * 3
    seq.prompt = list(range(300))                                    # its first chunk's rows
    assert Engine._whole_within_bound(engine(0.01), seq) and asked[-1] == (128, 3)
    seq.computed = 128                                               # past the prompt's start
    assert not Engine._whole_within_bound(engine(0.01), seq) and len(asked) == 4
    seq.computed, seq.embed = 0, "mean"                              # embeddings: the base's
    assert not Engine._whole_within_bound(engine(0.01), seq)
