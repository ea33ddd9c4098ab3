"""Protocol 1.1 between the two cores, through an in-memory relay: restarts of either side, refused
commits, the end of a job, work bounds. Each test reproduces a fault found against protocol 1.0."""

from __future__ import annotations

import numpy as np

from edge_client.core import DeviceCore
from edge_client.trainer import NumpyTrainer
from schemas.frame import Frame, FrameKind, encode_frame
from schemas.messages import Control, DeviceStatus, Notice
from tests.helpers import Relay, blobs, read_commit, small_server


def device(name: str, incarnation: int, seed: int = 0) -> DeviceCore:
    return DeviceCore("t", name, blobs(seed=seed + 1), NumpyTrainer(), seed=seed, incarnation=incarnation)


def rejected(server) -> dict[str, int]:
    return dict(server.traffic.rejected)


def test_a_rebooted_device_loses_no_commit_and_its_old_commits_stay_refused() -> None:
    """1.0: a device restarted with the same id began again at seq 1 and every commit was refused
    as replayed until it passed the old high-water mark (35 lost in one run)."""
    server = small_server(pace="asp", rounds=10**6)
    relay = Relay(server)
    relay.start()
    first = device("d1", incarnation=101)
    relay.connect(first)
    relay.train(rounds=12)
    old_seq = first.seq
    assert old_seq >= 12
    old_commit = first.sent  # what a listener could have captured
    # The gateway reboots: no state survives but its id. Its last will comes late, after the new hello.
    reborn = device("d1", incarnation=202, seed=5)
    relay.connect(reborn)
    relay.flush()
    assert reborn.control is not None and reborn.control.seq_base == old_seq
    applied = server.traffic.applied
    relay.train(rounds=10)
    assert server.traffic.applied == applied + 10 and rejected(server) == {}  # not one commit lost
    assert server.registry.record("d1").highest_seq == old_seq + 10 == reborn.seq
    will = DeviceStatus(device="d1", state="offline", incarnation=101).to_bytes()
    server.on_message(server.topics.status("d1"), will, relay.now)
    assert "d1" in server.registry.active()  # an earlier boot's will does not take the new one offline
    # A commit of the earlier incarnation, replayed, is refused.
    assert old_commit is not None
    replay = encode_frame(
        Frame(
            kind=FrameKind.COMMIT,
            base_version=0,
            tensors=old_commit.tensors,
            device="d1",
            seq=old_commit.seq,
            samples=1,
            steps=1,
        )
    )
    out = server.on_message(server.topics.grad("d1"), replay, relay.now)
    assert [Notice.from_bytes(p.payload).reason.value for p in out if "/notice/" in p.topic] == ["replayed"]


def relay_commits(relay: Relay, core: DeviceCore) -> list[bytes]:
    """The commit frames ``core`` sends from now on (one step at a time until one goes out)."""
    out: list[bytes] = []
    while not out:
        messages = core.step()
        relay.send(core, messages)
        out = [m.payload for m in messages if m.topic == core.topics.grad(core.device)]
        relay.flush()
    return out


def test_a_control_left_for_an_earlier_boot_is_ignored() -> None:
    core = device("d1", incarnation=5)
    stale = Control(
        device="d1",
        run=3,
        incarnation=4,
        push_every=2,
        lr=0.1,
        batch_size=8,
        wait_for_params=False,
        max_uncommitted_steps=16,
        seq_base=40,
    )
    core.on_message(core.topics.ctrl("d1"), stale.to_bytes())
    assert core.control is None and core.seq == 0


def test_a_refused_commit_releases_a_bsp_device_and_its_work_goes_into_the_next_commit() -> None:
    """1.0: a bsp device whose commit was refused waited for parameters until the round deadline,
    and the refused progress was lost (the device had already rebased)."""
    server = small_server(pace="bsp", rounds=10**6, max_commit_rate=1.0, max_commit_burst=1)
    relay = Relay(server)
    relay.start()
    core = device("d1", incarnation=9)
    relay.connect(core)
    relay.train(rounds=1)  # the burst of one commit is spent
    assert core.waiting is False and server.store.version == 1
    for _ in range(core.control.push_every):
        relay.send(core, core.step())
    assert core.waiting and core.sent is not None
    refused = core.sent
    relay.flush()  # refused as rate_limited (carried): the notice releases the device
    assert rejected(server) == {"rate_limited": 1} and not core.waiting and core.ready
    assert core.steps == refused.steps and core.samples == refused.samples
    relay.now += 1.5  # the bucket refills
    (payload,) = relay_commits(relay, core)
    frame = read_commit(payload)
    assert frame.steps == 2 * refused.steps  # the refused commit's steps go out with push_every new ones
    assert server.store.version == 2


def test_a_redelivered_commit_is_counted_but_not_noticed_so_its_work_is_not_sent_twice() -> None:
    """A server restarted between its checkpoint and its acknowledgement gets a commit it holds
    again (the broker redelivers it). Noticed as ``replayed``, a bsp device still waiting on that
    commit carried its work into the next one: the same steps in the model twice."""
    server = small_server(pace="bsp", rounds=10**6, min_devices=2)
    relay = Relay(server)
    relay.start()
    a, b = device("a", incarnation=1), device("b", incarnation=2, seed=3)
    relay.connect(a)
    relay.connect(b)
    (payload,) = relay_commits(relay, a)  # a waits for the round, which waits for b
    assert a.waiting and server.pace.committed() == ["a"]
    relay.send(a, [type(relay.log[0])(a.topics.grad("a"), payload, qos=1)])  # the redelivered copy
    relay.flush()
    assert rejected(server) == {"replayed": 1}
    assert not [m for m in relay.log if m.topic == a.topics.notice("a")] and a.waiting and a.steps == 0
    relay_commits(relay, b)
    assert server.store.version == 1
    (again,) = relay_commits(relay, a)
    assert read_commit(again).steps == a.control.push_every  # new work only


def test_a_commit_refused_for_its_content_releases_the_device_but_is_not_carried() -> None:
    server = small_server(pace="bsp", rounds=10**6)
    relay = Relay(server)
    relay.start()
    core = device("d1", incarnation=9)
    relay.connect(core)
    for _ in range(core.control.push_every - 1):
        relay.send(core, core.step())
    core._anchor = {k: np.full_like(v, np.nan) for k, v in core._anchor.items()}  # a commit of NaN (a device
    # whose own loss goes non-finite stops instead: test_core's diverging device)
    relay.send(core, core.step())
    relay.flush()
    assert rejected(server) == {"non_finite": 1} and not core.waiting and core.steps == 0


def test_commits_after_the_last_version_are_refused_counted_and_noticed() -> None:
    """1.0 dropped them silently: sent = applied + rejected did not hold at the end of a job."""
    server = small_server(pace="asp", rounds=3)
    relay = Relay(server)
    relay.start()
    devices = [device(f"d{i}", incarnation=i + 1, seed=i) for i in range(3)]
    for core in devices:
        relay.connect(core)
    relay.train(rounds=3)
    for core in devices:  # they go on until they read the finished barrier
        if core.ready:
            relay.send(core, relay_commits_now(core))
    relay.flush()
    sent = sum(core.seq for core in devices)
    assert server.finished and server.traffic.commits == sent
    assert server.traffic.applied + sum(server.traffic.rejected.values()) == sent
    assert set(server.traffic.rejected) <= {"finished"}
    assert all(core.finished for core in devices)


def relay_commits_now(core: DeviceCore) -> list:
    out: list = []
    for _ in range(core.control.push_every):
        if core.ready:
            out += core.step()
    return out


def test_acbsp_bounds_the_local_work_a_device_holds_before_the_start_quorum() -> None:
    """1.0: a fast device trained on while the start quorum waited: 2078 uncommitted steps."""
    server = small_server(pace="acbsp", rounds=10**6, min_devices=2, push_every=3)
    relay = Relay(server)
    relay.start()
    core = device("d1", incarnation=1)
    relay.connect(core)
    steps = 0
    while core.ready and steps < 10_000:
        relay.send(core, core.step())
        relay.flush()
        steps += 1
    assert not core.ready and core.steps == core.control.max_uncommitted_steps == 8 * 3
    relay.connect(device("d2", incarnation=2, seed=1))  # the quorum: the round closes
    relay.train(rounds=1)
    assert core.ready


def test_a_fresh_server_is_followed_by_devices_that_hold_a_newer_version_of_an_earlier_run() -> None:
    """1.0: a server started again without its checkpoint published version 0; devices whose
    replicas were at version 57 ignored it and every commit was future_version, forever."""
    old = small_server(pace="bsp", rounds=10**6, run=1)
    relay = Relay(old)
    relay.start()
    core = device("d1", incarnation=3)
    relay.connect(core)
    relay.train(rounds=6)
    assert core.server_version == 6
    new = small_server(pace="bsp", rounds=10**6, run=2)  # same job, new run: version 0 again
    relay.server = new
    relay._from_server(new.start(relay.now))
    for topic, payload in list(relay.retained.items()):  # the new server reads the retained statuses
        if "/status/" in topic:
            relay._from_server(new.on_message(topic, payload, relay.now, retained=True))
    relay.flush()
    assert core.run == 2 and core.server_version == 0
    relay.train(rounds=3)
    assert new.store.version == 3 and rejected(new) == {}


def test_a_retained_commit_is_refused() -> None:
    """1.0 applied a commit that a device had left retained on its grad topic, in the next run."""
    server = small_server(pace="asp", rounds=10**6)
    relay = Relay(server)
    relay.start()
    core = device("d1", incarnation=3)
    relay.connect(core)
    relay.flush()
    frame = Frame(
        kind=FrameKind.COMMIT,
        base_version=0,
        device="d1",
        seq=1,
        samples=1,
        steps=1,
        tensors={n: np.full(s, 1e30, np.float32) for n, s in server.store.shapes.items()},
    )
    out = server.on_message(server.topics.grad("d1"), encode_frame(frame), 0.0, retained=True)
    assert [Notice.from_bytes(p.payload).reason.value for p in out] == ["retained"]
    assert server.store.version == 0
