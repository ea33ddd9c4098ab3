"""Sequence numbers: strict order for a device's own commits, an anti-replay window for commits that
came through several ingest workers; in both, no number is ever taken twice."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.registry import RECENT_SEQS, DeviceRegistry


def registry() -> DeviceRegistry:
    r = DeviceRegistry(None)
    r.set_online("d", 10, 1)
    return r


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(st.integers(1, 3 * RECENT_SEQS), max_size=4 * RECENT_SEQS), ordered=st.booleans())
def test_no_sequence_number_is_taken_twice(seqs, ordered) -> None:
    r = registry()
    taken = [s for s in seqs if r.check_seq("d", s, ordered) is None]
    assert len(taken) == len(set(taken))
    if ordered:
        assert taken == sorted(taken)


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(st.integers(1, 3 * RECENT_SEQS), max_size=4 * RECENT_SEQS), ordered=st.booleans())
def test_each_verdict_is_the_windows_rule(seqs, ordered) -> None:
    """``seq_fault``'s shortcut for a number above the highest gives what the rule itself gives."""
    r, recent, highest, floor = registry(), deque[int](maxlen=RECENT_SEQS), 0, 0
    for s in seqs:
        rule = "replayed" if s in recent or s == highest else None
        if rule is None and s < highest and (ordered or s <= floor):
            rule = "out_of_order"
        assert r.check_seq("d", s, ordered) == rule
        if rule is None:
            highest = max(highest, s)
            if len(recent) == RECENT_SEQS:
                floor = max(floor, recent[0])
            recent.append(s)


def test_the_window_takes_numbers_that_passed_one_another_and_nothing_below_its_floor() -> None:
    r = registry()
    assert r.check_seq("d", 5, ordered=False) is None
    assert r.check_seq("d", 4, ordered=False) is None  # passed by 5: taken
    assert r.check_seq("d", 4, ordered=False) == "replayed"
    assert r.check_seq("d", 3, ordered=True) == "out_of_order"  # a device's own commits stay in order
    for seq in range(6, 6 + RECENT_SEQS):
        assert r.check_seq("d", seq, ordered=False) is None
    # 4 and 5 left the recent numbers: the floor is 5, and 3 (never seen) can no longer be told from a replay
    assert r.check_seq("d", 3, ordered=False) == "out_of_order"
    assert r.check_seq("d", 5, ordered=False) == "out_of_order"
