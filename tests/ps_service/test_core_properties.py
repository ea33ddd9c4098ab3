"""Random event sequences against the server core: the invariants hold whatever happens."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.aggregate import aggregate
from ps_service.update import Update
from tests.helpers import commit_bytes, hello, small_server

DEVICES = ["a", "b", "c"]

events = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), st.sampled_from(DEVICES), st.integers(0, 3)),  # seq offset: 0 = next
        st.tuples(st.just("stale"), st.sampled_from(DEVICES), st.integers(1, 3)),
        st.tuples(st.just("offline"), st.sampled_from(DEVICES), st.just(0)),
        st.tuples(st.just("online"), st.sampled_from(DEVICES), st.just(0)),
        st.tuples(st.just("tick"), st.just(""), st.floats(0.1, 3.0)),
        st.tuples(st.just("garbage"), st.sampled_from(DEVICES), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150)
@given(pace=st.sampled_from(["bsp", "acbsp", "asp", "ssp:1"]), script=events)
def test_no_commit_is_applied_twice_nothing_is_lost_and_the_model_stays_finite(pace, script) -> None:
    server = small_server(pace=pace, rounds=10**6, round_deadline_s=2.0)
    now = 0.0
    server.start(now)
    for device in DEVICES:
        hello(server, device)
    next_seq = dict.fromkeys(DEVICES, 1)
    accepted: set[tuple[str, int]] = set()
    for kind, device, arg in script:
        now += 0.1
        if kind == "commit":
            seq = max(1, next_seq[device] - arg)  # arg > 0 replays an older number
            before = sum(server.traffic.rejected.values())
            server.on_message(server.topics.grad(device), commit_bytes(server, device, seq), now)
            if sum(server.traffic.rejected.values()) == before:
                assert (device, seq) not in accepted, "a commit was accepted twice"
                accepted.add((device, seq))
            next_seq[device] = max(next_seq[device], seq + 1)
        elif kind == "stale":
            base = max(0, server.store.version - arg)
            seq = next_seq[device]
            next_seq[device] += 1
            server.on_message(server.topics.grad(device), commit_bytes(server, device, seq, base=base), now)
            accepted.add((device, seq))
        elif kind in ("offline", "online"):
            hello(server, device, state=kind)
        elif kind == "tick":
            now += arg
            server.on_tick(now)
        else:
            server.on_message(server.topics.grad(device), b"\x00garbage", now)
        # Every accepted commit is either applied or still buffered: none lost, none twice.
        assert server.traffic.applied + server.pace.pending == len(accepted)
        assert all(np.isfinite(v).all() for v in server.store.view().values())
    # Liveness: whatever happened, once everyone is online and commits, a new version follows.
    version = server.store.version
    for device in DEVICES:
        hello(server, device)
        server.on_message(server.topics.grad(device), commit_bytes(server, device, next_seq[device]), now + 1)
    assert server.store.version > version


@given(
    deltas=st.lists(st.tuples(st.sampled_from("xyz"), st.integers(1, 5), st.floats(-2, 2)), min_size=1, max_size=8),
    version=st.integers(0, 5),
)
def test_aggregate_ignores_the_order_of_updates(deltas, version) -> None:
    updates = [
        Update(d, i + 1, max(0, version - i % 3), 10, steps, {"w": np.float32([v, -v])})
        for i, (d, steps, v) in enumerate(deltas)
    ]
    sizes = {"x": 10, "y": 20, "z": 30}
    forward = aggregate(updates, version, sizes, max_extrapolation=3.0)
    backward = aggregate(list(reversed(updates)), version, sizes, max_extrapolation=3.0)
    np.testing.assert_allclose(forward.delta["w"], backward.delta["w"], rtol=1e-4, atol=1e-6)
