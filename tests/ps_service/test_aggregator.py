"""Site aggregators and the server's side of site commits: checked as commits, taken or refused
whole, never applied twice, kept in checkpoints; and a bsp job over sites is the job without."""

from __future__ import annotations

import numpy as np
import pytest

from edgeps.scenario import Scenario
from edgeps.simulator import Simulation
from ps_service.site.aggregator import WAIT_S, SiteAggregator
from ps_service.site.config import SiteConfig
from ps_service.update import SiteUpdate
from schemas.frame import decode_frame
from schemas.messages import DeviceStatus, Notice, RejectReason
from schemas.sitecommit import encode_site_commit, parse_site_commit
from tests.helpers import INCARNATION, commit_bytes, hello, small_server


def site_server(devices=("a", "b", "c"), **overrides):
    """A small job that takes site s's site commits, for ``devices``."""
    return small_server(site_devices={"s": frozenset(devices)}, **overrides)


def site_of(server, devices=("a", "b"), now: float = 0.0, **config) -> SiteAggregator:
    """A server that started with ``devices`` online, and site s's aggregator that read what its
    site broker would hand it: the parameters, barrier and controls, and the devices' statuses."""
    server.start(now)
    for device in devices:
        hello(server, device, now=now)
    return aggregator_of(server, devices, now, **config)


def aggregator_of(server, devices, now: float, **config) -> SiteAggregator:
    """A new aggregator of site s (``config`` overrides), reading what the site broker holds retained for it."""
    aggregator = SiteAggregator(SiteConfig(**{"job": "t", "site": "s", "flush_s": 1.0, **config}))
    retained = [*server.last_broadcast, *server.barrier(now, force=True), *(server.control(d) for d in devices)]
    for message in retained:
        aggregator.on_message(message.topic, message.payload, now)
    for device in devices:
        body = DeviceStatus(device=device, state="online", samples=10, incarnation=INCARNATION).to_bytes()
        aggregator.on_message(server.topics.status(device), body, now)
    aggregator.settled()
    return aggregator


def deliver(server, messages, now: float):
    """The aggregator's site commits to the server; what the server publishes back."""
    out = []
    for message in messages:
        if "/part/" in message.topic:
            out += server.on_message(message.topic, message.payload, now)
    return out


def notices(messages):
    return [Notice.from_bytes(m.payload) for m in messages if "/notice/" in m.topic]


def test_a_round_of_a_site_is_one_site_commit_and_the_same_version_as_direct_commits() -> None:
    direct, summed = site_server(), site_server()
    aggregator = site_of(summed)
    direct.start(0.0)
    for device in ("a", "b"):
        hello(direct, device)
    for i, device in enumerate(("a", "b")):
        payload = commit_bytes(direct, device, 1, scale=0.1 * (i + 1))
        direct.on_message(direct.topics.grad(device), payload, 1.0)
        assert aggregator.on_message(summed.topics.grad(device), payload, 1.0, token=device) == []
    assert aggregator.settled() == []  # held: nothing acknowledged before the site commit is out
    up = aggregator.flush(1.0)  # both of the site's devices committed: due at once
    assert [m.topic for m in up] == ["edgeps/t/part/s"] and sorted(aggregator.settled()) == ["a", "b"]
    deliver(summed, up, 1.1)
    assert summed.store.version == direct.store.version == 1
    assert summed.traffic.applied == direct.traffic.applied == 2
    for name, values in direct.store.params().items():
        np.testing.assert_allclose(summed.store.params()[name], values, rtol=1e-6, atol=1e-7)
    assert len(up[0].payload) <= len(commit_bytes(direct, "a", 2)) + 400  # one commit's size for two, and a header


def test_a_site_commit_goes_out_after_flush_s_without_a_straggler() -> None:
    server = site_server()
    aggregator = site_of(server)
    aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    assert aggregator.flush(1.5) == [] and aggregator.next_deadline() == 2.0
    up = aggregator.flush(2.0)
    deliver(server, up, 2.0)
    assert server.pace.committed() == ["a"] and server.waiting_for() == ["b"]


def test_a_round_bigger_than_one_site_commit_goes_up_as_soon_as_every_device_committed(monkeypatch) -> None:
    import ps_service.site.aggregator

    monkeypatch.setattr(ps_service.site.aggregator, "MAX_SITE_COMMITS", 2)
    server = site_server()
    aggregator = site_of(server, devices=("a", "b", "c"))
    for device in ("a", "b"):
        aggregator.on_message(server.topics.grad(device), commit_bytes(server, device, 1), 1.0)
    assert len(aggregator.flush(1.0)) == 1  # full
    aggregator.on_message(server.topics.grad("c"), commit_bytes(server, "c", 1), 1.1)
    assert len(aggregator.flush(1.1)) == 1  # a and b went up already: the round is complete, not 1 s later


def test_the_aggregator_refuses_what_the_server_would_with_the_same_notices() -> None:
    server = site_server()
    aggregator = site_of(server)
    grad = server.topics.grad("a")
    out = aggregator.on_message(grad, b"garbage", 1.0, token=1)
    out += aggregator.on_message(grad, commit_bytes(server, "b", 1), 1.0, token=2)  # body names another device
    nan = commit_bytes(server, "a", 1, scale=float("nan"))
    out += aggregator.on_message(grad, nan, 1.0, token=3)
    # seq 1 was consumed by the NaN: a copy of it is counted without a notice, as the server does
    out += aggregator.on_message(grad, commit_bytes(server, "a", 1), 1.0, token=4)
    reasons = [n.reason for n in notices(out)]
    assert reasons == [RejectReason.MALFORMED, RejectReason.DEVICE_MISMATCH, RejectReason.NON_FINITE]
    assert aggregator.report.traffic.rejected["replayed"] == 1
    assert sorted(aggregator.settled()) == [1, 2, 3, 4] and not aggregator.held


def test_a_flooding_device_is_refused_at_its_site_with_a_notice_a_second() -> None:
    server = site_server()
    aggregator = site_of(server, max_commit_rate=10.0, max_commit_burst=5)
    out = []
    for seq in range(1, 41):  # 40 commits in 0.4 s: a burst of 5, then 10 a second
        out += aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq), 1.0 + seq / 100)
    assert aggregator.report.traffic.rejected["rate_limited"] == 32 and len(aggregator.held) == 8  # 5, and 3.9 refilled
    assert [n.reason for n in notices(out)] == [RejectReason.RATE_LIMITED]  # one notice in that second


def test_a_commit_before_what_it_is_checked_against_waits_then_is_refused() -> None:
    server = site_server()
    server.start(0.0)
    hello(server, "a")
    aggregator = SiteAggregator(SiteConfig(job="t", site="s"))
    assert aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 0.0, token=1) == []
    assert aggregator.settled() == [] and aggregator.next_deadline() == WAIT_S
    [notice] = notices(aggregator.on_tick(WAIT_S))
    assert notice.reason is RejectReason.UNKNOWN_DEVICE and aggregator.settled() == [1]


def test_a_commit_delivered_again_goes_up_alone_and_a_copy_is_not_applied_twice() -> None:
    server = site_server(rounds=50)
    aggregator = site_of(server)
    first = commit_bytes(server, "a", 1)
    aggregator.on_message(server.topics.grad("a"), first, 1.0)
    aggregator.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 1.0)
    up = aggregator.flush(1.0)
    deliver(server, up, 1.0)
    assert server.store.version == 1
    # the aggregator restarts before acknowledging: the broker delivers a's commit again (DUP)...
    again = aggregator_of(server, ("a", "b"), 1.2)
    again.on_message(server.topics.grad("a"), first, 1.2, token="dup", duplicate=True)
    fresh = commit_bytes(server, "b", 2)
    again.on_message(server.topics.grad("b"), fresh, 1.2, token="new")
    up = again.flush(1.2)
    assert len(up) == 1 and again.held  # a's copy alone; b's fresh commit waits for its round
    out = deliver(server, up, 1.2)
    assert server.traffic.rejected["replayed"] == 1 and not notices(out)  # counted, silent, not applied
    assert server.traffic.applied == 2 and server.pace.committed() == []


def test_a_site_commit_naming_a_used_sequence_number_is_refused_whole() -> None:
    server = site_server()
    aggregator = site_of(server)
    server.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)  # a's seq 1, directly
    aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    aggregator.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 1.0)
    out = deliver(server, aggregator.flush(1.0), 1.0)
    by_device = {n.device: n.reason for n in notices(out)}
    assert by_device == {"a": RejectReason.REPLAYED, "b": RejectReason.UNPROCESSABLE}
    assert server.store.version == 0 and server.pace.committed() == ["a"]  # b's work is not in the model


@pytest.mark.parametrize("what", ["garbage", "other site", "future", "non-finite", "retained", "unknown device"])
def test_a_bad_site_commit_is_counted_and_changes_nothing(what) -> None:
    server = site_server()
    aggregator = site_of(server)
    aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    aggregator.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 1.0)
    [message] = aggregator.flush(1.0)
    header, tensors = parse_site_commit(message.payload, server.store.shapes, 1 << 20)
    payload, topic, retained = message.payload, message.topic, False
    if what == "garbage":
        payload = payload[:40]
    elif what == "other site":
        topic = server.topics.part("elsewhere")
    elif what == "future":
        payload = encode_site_commit(header.model_copy(update={"version": 5}), tensors)
    elif what == "non-finite":
        payload = encode_site_commit(header, {**tensors, "dense0.b": np.full_like(tensors["dense0.b"], np.inf)})
    elif what == "retained":
        retained = True
    else:
        entry = header.commits[0].model_copy(update={"device": "stranger"})
        payload = encode_site_commit(header.model_copy(update={"commits": [entry, header.commits[1]]}), tensors)
    before = server.store.params()
    server.on_message(topic, payload, 1.0, retained=retained)
    assert server.store.version == 0 and server.pace.pending == 0 and sum(server.traffic.rejected.values()) >= 1
    for name, values in before.items():
        np.testing.assert_array_equal(server.store.params()[name], values)


def test_a_site_speaks_only_for_the_devices_the_deployment_gave_it() -> None:
    """The audit: pinning was first-come (site sa named site sb's device first: 119 of sb's site commits
    refused in 25 s, the pin kept in checkpoints), and a site could speak for a device connected to the
    core directly (its sequence jumped to 2^50). Now the map is the deployment's (``--site NAME=DEV,DEV``,
    the one broker init made the ACLs from)."""
    server = small_server(site_devices={"s": frozenset({"a", "b"}), "s2": frozenset({"c"})})
    ours = site_of(server, devices=("a", "b", "c", "d"))  # d commits to the core directly
    other = aggregator_of(server, ("a", "b", "c", "d"), 0.0, site="s2")
    for device in ("a", "b", "d"):  # s2 speaks first, for s's devices and the direct one
        other.on_message(server.topics.grad(device), commit_bytes(server, device, 1 << 50), 1.0)
    by_device = {n.device: n.reason for n in notices(deliver(server, other.flush(2.0), 1.0))}
    assert by_device == {
        "a": RejectReason.DEVICE_MISMATCH,
        "b": RejectReason.DEVICE_MISMATCH,
        "d": RejectReason.DEVICE_MISMATCH,
    }
    assert server.registry.record("d").highest_seq == 0  # d's own numbers are untouched
    for device in ("a", "b"):  # s's own site commit is taken, first or not
        ours.on_message(server.topics.grad(device), commit_bytes(server, device, 1), 1.0)
    deliver(server, ours.flush(2.0), 2.0)
    assert server.pace.committed() == ["a", "b"]


def test_the_server_takes_site_commits_only_from_its_sites() -> None:
    server = small_server()
    aggregator = site_of(server)
    assert not any("/part/" in topic for topic in server.subscriptions())
    for device in ("a", "b"):
        aggregator.on_message(server.topics.grad(device), commit_bytes(server, device, 1), 1.0)
    deliver(server, aggregator.flush(1.0), 1.0)
    assert server.pace.pending == 0 and server.traffic.rejected == {"unknown_device": 1}


def test_a_checkpoint_keeps_a_buffered_site_commit(tmp_path) -> None:
    server = site_server()
    aggregator = site_of(server, devices=("a", "b", "c"))
    hello(server, "c")
    for device in ("a", "b"):
        aggregator.on_message(server.topics.grad(device), commit_bytes(server, device, 1), 1.0)
    deliver(server, aggregator.flush(2.0), 2.0)  # c has not committed: the round stays open
    [held] = server.pace.buffered()
    assert isinstance(held, SiteUpdate)
    restored = site_server(run=server.run)
    restored.load_state(server.to_state(3.0), server.history, 3.0)
    [again] = restored.pace.buffered()
    assert again.entries == held.entries and again.part.steps == held.part.steps
    for out in (server, restored):
        out.on_message(out.topics.grad("c"), commit_bytes(out, "c", 1), 4.0)
    for name, values in server.store.params().items():
        np.testing.assert_array_equal(restored.store.params()[name], values)
    assert restored.store.version == 1 and restored.traffic.applied == 3


def test_a_bsp_job_over_sites_makes_the_models_of_the_job_without() -> None:
    """Three sites of two devices each, in the simulator: the same models, to float rounding, with
    half the bytes up (the site commits of two devices each)."""
    runs = {}
    for sites in (0, 3):
        scenario = Scenario(devices=6, sites=sites, duration_s=1000, rounds=8, slow_fraction=0.0, hidden=(16,))
        simulation = Simulation(scenario, "bsp")
        runs[sites] = (simulation.run(), simulation.server.store.params())
    (flat, flat_params), (summed, summed_params) = runs[0], runs[3]
    for name, values in flat_params.items():
        np.testing.assert_allclose(summed_params[name], values, rtol=1e-4, atol=1e-6)
    assert summed.commits == flat.commits == 6 * 8
    assert summed.bytes_up < 0.55 * flat.bytes_up


def test_the_aggregator_follows_a_new_run_and_ignores_what_an_earlier_one_left() -> None:
    """A site broker keeps the retained parameters and barrier of the job's last run (version 15); a new
    server starts a new run at version 0: site commits say version 0, or the server refuses them."""
    old = site_server(rounds=50, run=5)
    aggregator = site_of(old)
    for version in range(1, 16):
        for device in ("a", "b"):
            aggregator.on_message(old.topics.grad(device), commit_bytes(old, device, version), float(version))
        for message in deliver(old, aggregator.flush(float(version)), float(version)):  # its broadcasts
            aggregator.on_message(message.topic, message.payload, float(version))
    assert old.store.version == aggregator.job.version == 15
    new = site_server(run=6)
    for message in new.start(20.0):  # the new run's snapshot and barrier
        aggregator.on_message(message.topic, message.payload, 20.0)
    for message in old.last_broadcast:  # the earlier run's, delivered again (a resubscription)
        aggregator.on_message(message.topic, message.payload, 20.0)
    assert (aggregator.job.run, aggregator.job.version) == (6, 0)
    for device in ("a", "b"):
        hello(new, device, now=20.0)
        aggregator.on_message(new.topics.grad(device), commit_bytes(new, device, 20), 21.0)
    deliver(new, aggregator.flush(21.0), 21.0)
    assert new.store.version == 1 and not new.traffic.rejected


def test_an_ingest_worker_sends_one_commit_a_device_and_the_server_takes_them_out_of_order() -> None:
    """Two workers each hold one of a device's commits (asp); the second worker's site commit reaches the
    server first. The server takes both (an anti-replay window, not strict order) and still refuses a copy."""
    server = small_server(pace="asp", rounds=50, sites=frozenset({"s"}), sites_only=True)
    first, second = (site_of(server, devices=("a",), shared=True) for _ in range(2))
    first.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1), 1.0)
    second.on_message(server.topics.grad("a"), commit_bytes(server, "a", 2), 1.0)
    second.on_message(server.topics.grad("a"), commit_bytes(server, "a", 3), 1.0)
    late, early = first.flush(1.0), second.flush(1.0)
    assert len(early) == 2  # seq 2 and seq 3 in two site commits: one commit a device in each
    deliver(server, early, 1.1)
    deliver(server, late, 1.2)
    assert server.traffic.applied == 3 and not server.traffic.rejected
    deliver(server, late, 1.3)  # a copy of seq 1
    assert server.traffic.applied == 3 and server.traffic.rejected == {"replayed": 1}


def test_params_frame_is_read_for_shapes_and_version() -> None:
    server = site_server()
    aggregator = site_of(server)
    frame = decode_frame(server.last_broadcast[0].payload)
    assert aggregator.job.shapes == {n: v.shape for n, v in frame.tensors.items()} and aggregator.job.version == 0
