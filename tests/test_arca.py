"""Ghidorah's ARCA partition (§III-C3, policies/arca.py) as a policy: the solo share, the climb
on synthetic step-time profiles, the bands of context a step takes its share from."""
from __future__ import annotations

import pytest

from socllm.policies.arca import (SHARE_UNITS, band_of, climb, positions, share_key, solo_share,
                                  start_step)


def test_the_solo_share_gives_each_processor_work_in_proportion_to_its_speed():
    assert solo_share(1.0, 3.0) == pytest.approx(0.25)      # a CPU 3x slower: a quarter
    assert solo_share(2.0, 2.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        solo_share(0.0, 1.0)


@pytest.mark.parametrize("best", [0, 2, 5, SHARE_UNITS])
def test_the_climb_reaches_the_fastest_share_of_a_valley_from_either_side(best):
    """A convex profile (a split's time falls while the CPU takes work off the GPU, then rises
    as the CPU becomes the slower side): from any start the climb ends at its minimum, timing
    each share once and only those on its way."""
    calls = []

    def t(k):
        calls.append(k)
        return 10.0 + (k - best) ** 2
    for start in range(SHARE_UNITS + 1):
        calls.clear()
        k, s, seen = climb(t, start, 0, SHARE_UNITS)
        assert (k, s) == (best, 10.0)
        assert sorted(calls) == sorted(set(calls)) == sorted(seen)
        assert len(seen) <= abs(start - best) + 3


def test_the_climb_stops_where_neither_neighbour_is_faster():
    """ARCA is a local search: a valley beyond a ridge is not reached (the profile under
    contention is what is measured; no share is timed without a reason)."""
    profile = [5.0, 4.0, 6.0, 1.0, 1.0]          # start 1: both neighbours are slower
    k, s, seen = climb(lambda j: profile[j], 1, 0, 4)
    assert (k, s) == (1, 4.0) and set(seen) == {0, 1, 2}
    k, s, _ = climb(lambda j: profile[j], 2, 0, 4)
    assert (k, s) == (3, 1.0)                     # ties do not move it further
    with pytest.raises(ValueError):
        climb(lambda j: 0.0, 5, 0, 4)


def test_the_start_leaves_both_processors_some_work_and_keys_name_a_share():
    assert start_step(0.0, 8) == 1 and start_step(1.0, 8) == 7 and start_step(0.3, 8) == 2
    assert share_key(0.25) == 256 and share_key(0.0) == 0
    with pytest.raises(ValueError):
        share_key(1.5)


def test_steps_take_the_share_of_the_band_timed_nearest_their_context():
    assert positions(2048, 9) == (128, 1024) and positions(512, 9) == (128,)
    assert positions(64, 9) == (55,)             # a tiny context: timed where it fits
    bands = [(128, 0.25), (1024, 0.0)]
    assert band_of(bands, 0) == 0.25 and band_of(bands, 300) == 0.25
    assert band_of(bands, 400) == 0.0 and band_of(bands, 5000) == 0.0    # sqrt(128 * 1024) ~ 362
    assert band_of([(128, 0.5)], 9999) == 0.5
