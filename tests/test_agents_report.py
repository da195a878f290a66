"""scripts/agents.py's report: preemption latency counted as Agent.xpu §4.4 ② defines it."""
from socllm.scripts.agents import preemption_latency, stats


def _reactive(arrival, queue, ttft, error=None, cls="reactive"):
    return {"class": cls, "arrival_s": arrival, "queue_s": queue, "ttft_s": ttft, "error": error}


def test_a_reactive_request_behind_another_reactive_prefill_is_queueing_not_preemption():
    recs = [_reactive(0.0, 0.010, 1.0),           # preempts proactive work
            _reactive(0.5, 0.600, 1.2),           # arrives while the first one prefills
            _reactive(2.0, 0.020, 0.3),           # the first one is decoding by then
            _reactive(2.1, 0.900, 1.0, error="x"),   # failed: left out
            _reactive(2.2, 5.000, 6.0, cls="proactive"),
            _reactive(3.0, None, 1.0),            # its timing left the service's table ...
            _reactive(3.5, 0.450, 0.9)]           # ... but the next one still queued behind it
    pre, behind = preemption_latency(recs)
    assert sorted(pre) == [0.010, 0.020] and sorted(behind) == [0.450, 0.600]
    s = stats(pre)
    assert s["n"] == 2 and s["max"] == 0.020 and stats([]) is None
