"""The request table's pure parts: the FCFS policy's admission, stop strings, priorities; and
auto's online-prepare rule (no NPU graph compiled inside a request)."""
from __future__ import annotations

import pytest

from socllm.memory.blocks import BlockPool
from socllm.policies.request import Request, StopText
from socllm.policies.sampling import SamplingParams
from socllm.policies.scheduler import FCFS


def req(i, n_prompt, max_tokens, **kw):
    return Request(i, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens), **kw)


def fcfs(max_seqs=8, blocks=100, context=10_000):
    return FCFS(max_seqs, context, BlockPool(blocks, block_rows=16))


def test_fcfs_admits_in_arrival_order_up_to_max_seqs():
    s = fcfs(max_seqs=2)
    for i in range(4):
        s.add(req(i, 10, 10))
    b = s.schedule()
    assert [r.id for r in b.prefill] == [0, 1] and [r.id for r in s.waiting] == [2, 3]
    for r in b.prefill:                      # the runner prefilled them and sampled a token
        r.computed, r.tokens = 10, [1]
    b = s.schedule()
    assert not b.prefill and [r.id for r in b.decode] == [0, 1]
    s.finish(s.running[0])
    assert [r.id for r in s.schedule().prefill] == [2]


def test_a_short_request_holds_only_its_blocks_and_grows_by_blocks():
    s = fcfs()
    r = req(1, 16, 400)
    s.add(r)
    s.schedule()
    assert len(r.blocks) == 1 and s.kv.n_used == 1           # 16 rows: one block, not 400 rows
    r.computed, r.tokens = 16, [5]
    s.schedule()                                              # feeding token 17 needs block 2
    assert len(r.blocks) == 2
    s.finish(r)
    assert s.kv.n_used == 0 and r.blocks == []


def test_a_request_that_does_not_fit_now_waits_then_runs():
    s = fcfs(blocks=4)                                        # 64 rows
    big, small = req(1, 48, 10), req(2, 30, 10)
    s.add(big)
    s.add(small)
    assert [r.id for r in s.schedule().prefill] == [1]       # 3 blocks held, 2 more do not fit
    assert list(s.waiting) == [small]
    s.finish(big)                                            # its blocks are free again
    assert s.schedule().prefill == [small]


def test_a_request_that_could_never_fit_is_refused_at_once():
    s = fcfs(blocks=4, context=1000)
    with pytest.raises(ValueError, match="context holds 64"):
        s.add(req(1, 50, 20))
    with pytest.raises(ValueError, match="context holds 40"):
        FCFS(8, 40, BlockPool(100)).add(req(1, 30, 20))
    assert not s.waiting and not s.running


def test_later_smaller_requests_do_not_jump_the_queue():
    s = fcfs(blocks=6)
    s.add(req(1, 60, 10))
    s.add(req(2, 50, 10))
    s.add(req(3, 5, 5))
    assert [r.id for r in s.schedule().prefill] == [1]
    assert s.schedule().prefill == [s.running[0]]            # 3 would fit, but 2 is first


def test_a_dry_pool_preempts_the_newest_request_which_resumes_later():
    s = fcfs(blocks=3)
    a, b = req(1, 16, 30), req(2, 16, 30)
    s.add(a)
    s.add(b)
    s.schedule()
    for r in (a, b):
        r.computed, r.tokens = 16, [7]
    batch = s.schedule()                 # both need a 2nd block, one is free: b gives way
    assert batch.decode == [a] and batch.preempted == [b] and list(s.waiting) == [b]
    assert b.blocks == [] and b.computed == 0 and not b.prefilled
    s.finish(a)
    batch = s.schedule()
    assert batch.prefill == [b] and len(b.blocks) == 2        # prompt + its token: 17 rows


def test_cancelling_a_waiting_request_removes_it():
    s = fcfs(max_seqs=1)
    a, b = req(1, 5, 5), req(2, 5, 5)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(b)
    s.finish(a)
    assert not s.waiting and not s.running and s.kv.n_used == 0


def test_priority_is_checked_and_stored():
    assert req(1, 3, 3, priority="reactive").priority == "reactive"
    with pytest.raises(ValueError, match="priority"):
        req(1, 3, 3, priority="urgent")


@pytest.mark.parametrize("stop", [["\n\n", 3], [""], ["a"] * 5, 7])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(ValueError, match="stop"):
        req(1, 3, 3, stop=stop)


def test_stop_text_cuts_before_the_stop_string_across_pieces():
    st = StopText(("END",))
    out = [st.feed(p) for p in ["Hello E", "N", "D and more"]]
    assert "".join(out) == "Hello " and st.hit == "END"
    assert st.feed("later") == "" and st.flush() == ""
    st = StopText(("b", "xa", "a"))           # the first in the text; at one place, the first given
    assert st.feed("xxab") == "x" and st.hit == "xa"


def test_stop_text_releases_a_false_start():
    st = StopText(("\n\n",))
    assert st.feed("a\n") == "a"            # "\n" may start the stop string: held back
    assert st.feed("b") == "\nb" and not st.hit
    assert st.feed("c\n") == "c" and st.flush() == "\n"


def test_ended_requests_report_usage():
    r = req(1, 7, 5)
    r.tokens = [1, 2, 3]
    r.end("cancelled", "cancelled")
    assert r.ended and r.usage() == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
