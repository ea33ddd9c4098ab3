"""One door (ps_service.door) for the server, site aggregators and ingest workers: the same verdict
on the same hostile commits, no input that stops an aggregator, sites trusted only as far as the
deployment says, and bounded memory. Each test is an attack of the issue-28 audit (its figures in
the docstrings), as a unit test; the same attacks over real deployments: ``edgeps bench attack``."""

from __future__ import annotations

import math

import numpy as np

from ps_service.config import DoorConfig
from ps_service.door import Door, Refusal
from ps_service.registry import DeviceRegistry
from ps_service.site.aggregator import WAIT_S
from ps_service.update import Update
from schemas.messages import MAX_SAFE_INT, MAX_U32, Barrier, RejectReason
from schemas.sitecommit import encode_site_commit, parse_site_commit
from tests.helpers import commit_bytes, hello, small_server
from tests.ps_service.test_aggregator import aggregator_of, deliver, notices, site_of, site_server
from tests.ps_service.test_core import _bad_commits

R = RejectReason


def hostile_commits(server):
    """The frame battery, and the audit's commits that crashed or fooled the scale-out paths."""
    return [
        *_bad_commits(server),
        ("malformed", "a", commit_bytes(server, "a", 2**53)),  # a seq no site commit can carry
        ("malformed", "a", commit_bytes(server, "a", 2**64 - 1)),
        ("future_version", "a", commit_bytes(server, "a", 20, base=MAX_SAFE_INT)),
        ("retained", "a", commit_bytes(server, "a", 21)),
        (None, "a", commit_bytes(server, "a", 22, scale=1e30)),  # taken: clipped when aggregated
        (None, "a", commit_bytes(server, "a", 23, samples=MAX_U32, steps=MAX_U32)),  # taken: bounded
    ]


def verdict(out) -> list[str]:
    return [n.reason.value for n in notices(out)]


def test_the_server_and_a_site_aggregator_give_the_same_verdict_on_the_same_hostile_commits() -> None:
    server = site_server(pace="bsp", devices=("a", "b"))
    aggregator = site_of(server, devices=("a", "b"))
    direct = small_server(pace="bsp")
    direct.start(0.0)
    for device in ("a", "b"):
        hello(direct, device)
    cases = hostile_commits(server)
    now = 1.0
    for reason, device, payload in cases:
        retained = reason == "retained"
        at_server = direct.on_message(direct.topics.grad(device), payload, now, retained=retained)
        at_site = aggregator.on_message(server.topics.grad(device), payload, now, token=now, retained=retained)
        at_site += aggregator.on_tick(now + WAIT_S)  # what waited for its device or version is refused by now
        expected = [] if reason in (None, "replayed") else [reason]
        assert verdict(at_server) == verdict(at_site) == expected, (reason, verdict(at_server), verdict(at_site))
        now += WAIT_S + 1
    assert aggregator.report.traffic.rejected == direct.traffic.rejected
    assert [u.seq for u, _ in aggregator.held] == [22, 23]  # what the server took, the aggregator holds
    assert aggregator.job.version == 0  # a base version from the future never became the aggregator's


def test_no_commit_makes_the_aggregator_fail_and_every_site_commit_is_valid() -> None:
    """The audit: seq >= 2^53 made an ingest worker exit ("ERROR --seq ...") and every restart die
    (the broker hands the commit back); a 1e30 commit at a one-device site overflowed spread and the
    aggregator died with "--spread inf", 3 of 3 restarts."""
    server = site_server(devices=("a",))
    aggregator = site_of(server, devices=("a",))
    aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 2**60), 1.0, token="big seq")
    aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1, scale=1e30), 1.0, token="bomb")
    aggregator.on_message(
        server.topics.grad("a"),
        commit_bytes(server, "a", 2, samples=MAX_U32, steps=MAX_U32, scale=3e38),
        1.0,
        token="max",
    )
    up = aggregator.flush(1.0) + aggregator.flush(3.0)
    assert sorted(aggregator.settled(), key=str) == ["big seq", "bomb", "max"]
    before = server.store.norm()
    deliver(server, up, 3.0)
    assert server.store.version >= 1 and math.isfinite(server.store.norm())
    assert server.store.norm() <= 2 * before  # clipped to half the model's norm a step, at most


def test_a_base_version_from_the_future_never_becomes_the_aggregators() -> None:
    """The audit: base_version 2^53 - 1 became the aggregator's version; every later site commit was
    refused future_version (0 versions/s for 30 s, then 152 silent refusals in 45 s) and a retained
    copy survived restarts."""
    server = site_server(devices=("a", "b"))
    aggregator = site_of(server, devices=("a", "b"))
    aggregator.on_message(server.topics.grad("a"), commit_bytes(server, "a", 1, base=MAX_SAFE_INT), 1.0)
    [notice] = notices(aggregator.on_tick(1.0 + WAIT_S))
    assert notice.reason is R.FUTURE_VERSION and aggregator.job.version == 0
    retained = aggregator.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 12.0, retained=True)
    assert verdict(retained) == ["retained"]
    for device in ("a", "b"):
        aggregator.on_message(server.topics.grad(device), commit_bytes(server, device, 5), 12.0)
    deliver(server, aggregator.flush(12.0), 12.0)
    assert server.store.version == 1  # the site's refusals reach the job's metrics with its site commit
    assert server.traffic.rejected == {"future_version": 1, "retained": 1}


def test_a_device_claiming_four_billion_samples_at_a_two_device_site_counts_as_the_server_allows() -> None:
    """The audit: the median of two sizes is their mean and the core took a site's data as given: a
    device claiming 2^32 - 1 samples got a share of 1.000000 and drove accuracy 0.958 -> 0.0000."""
    server = site_server(devices=("a", "b"))
    server.start(0.0)
    for device, samples in (("a", 100), ("b", MAX_U32), ("c", 120), ("d", 90)):  # c and d: on the core
        hello(server, device, samples=samples)
    aggregator = aggregator_of(server, ("a", "b"), 0.0)
    from schemas.messages import DeviceStatus

    for device, samples in (("a", 100), ("b", MAX_U32)):  # as they told the server
        status = DeviceStatus(device=device, state="online", samples=samples, incarnation=11)
        aggregator.on_message(server.topics.status(device), status.to_bytes(), 0.0)
    for device, scale in (("a", 0.01), ("b", -0.01)):
        aggregator.on_message(server.topics.grad(device), commit_bytes(server, device, 1, scale=scale), 1.0)
    [message] = aggregator.flush(2.0)
    header, _ = parse_site_commit(message.payload, server.store.shapes, 1 << 20)
    weights = {e.device: e.weight for e in header.commits}
    cap = Barrier.from_bytes(server.barrier(1.0, force=True)[0].payload).max_weight
    assert cap == 100 and weights == {"a": 100, "b": 100}  # the fleet's lower median, not its claim
    forged = header.model_copy(
        update={
            "commits": [
                e.model_copy(update={"weight": float(MAX_U32)}) if e.device == "b" else e for e in header.commits
            ]
        }
    )
    assert forged.commits[1].weight > cap  # a lying aggregator's weight is scaled back at the server (versions)


def test_a_compromised_aggregator_gets_no_more_than_its_devices_would() -> None:
    """The audit: a compromised aggregator set steps = 2^32 - 1 on two entries with zero sums and
    amplified the honest updates through the step length: accuracy 0.9025 -> 0.1003 in one round.
    It may also lie about weights and norms: the server checks them against its sums and bounds."""
    server = site_server(devices=("a", "b", "c", "d"))
    aggregator = site_of(server, devices=("a", "b", "c", "d"))
    for device in "abcd":
        aggregator.on_message(server.topics.grad(device), commit_bytes(server, device, 1, scale=0.01), 1.0)
    [message] = aggregator.flush(1.0)
    header, tensors = parse_site_commit(message.payload, server.store.shapes, 1 << 20)

    def forged(**changes):
        entries = [e.model_copy(update=changes.get(e.device, {})) for e in header.commits]
        spread = sum(e.weight * e.norm**2 for e in entries)
        data = sum(e.weight for e in entries)
        return encode_site_commit(
            header.model_copy(update={"commits": entries, "spread": spread, "data": data}),
            {n: v * changes.get("_scale", 1.0) for n, v in tensors.items()},
        )

    # understated norms (a longer sum than its entries state): refused whole
    small = {d: {"norm": 1e-9} for d in "abcd"}
    out = server.on_message(server.topics.part("s"), forged(**small), 1.0)
    assert {n.reason for n in notices(out)} <= {R.MALFORMED, R.UNPROCESSABLE} and server.pace.pending == 0
    # huge step counts on two entries: the step length counts them at twice the fleet's median at most
    before = server.store.params()
    steps = {"c": {"steps": MAX_U32}, "d": {"steps": MAX_U32}}
    server.on_message(server.topics.part("s"), forged(**steps), 1.0)
    assert server.store.version == 1
    moved = max(float(np.abs(server.store.params()[n] - v).max()) for n, v in before.items())
    assert moved <= 2 * 0.01 * 1.0001  # each value moved at most twice what a device's commit holds


def test_a_flooding_site_is_muted_and_logged_at_a_bounded_rate() -> None:
    """The audit: part/{site} had no rate limit or mute: a 15 s junk flood dropped the job 4.80 ->
    0.13 versions/s, left two minutes of backlog and wrote 294,846 log lines (45 MB)."""
    server = site_server(devices=("a", "b"), max_commit_rate=10.0, max_commit_burst=5)
    server.start(0.0)
    part = server.topics.part("s")
    assert part in server.subscriptions()
    for i in range(20_000):
        server.on_message(part, b"junk" * 8, 1.0 + i * 1e-5)
    lines = server.events.take()
    assert len(lines) < 50 and server.traffic.rejected["rate_limited"] >= 19_000
    assert part not in server.subscriptions()  # the broker drops the rest
    server.on_tick(3.0)
    assert part in server.subscriptions()


def test_a_paused_bsp_job_holds_a_bounded_number_of_a_devices_commits() -> None:
    """The audit: bsp buffered every commit a device sent during a round and checkpointed the buffer
    every batch: 300 commits/s for 25 s took the checkpoint 0.5 -> 80.6 MB, RSS 118 -> 275 MiB."""
    server = small_server(pace="bsp", rounds=10**6)
    server.start(0.0)
    hello(server, "a")
    hello(server, "b")
    for seq in range(1, 301):
        server.on_message(server.topics.grad("a"), commit_bytes(server, "a", seq), 1.0 + seq / 300)
    assert server.pace.pending == server.config.door.max_held_commits
    assert server.traffic.rejected["rate_limited"] == 300 - server.config.door.max_held_commits
    size = len(str(server.to_state(2.0)["pace"]))
    server.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 2.0)  # the round closes
    assert server.store.version == 1 and server.door.held_bytes == 0 and len(str(server.to_state(3.0)["pace"])) < size


def test_commits_waiting_at_an_aggregator_are_bounded_in_bytes() -> None:
    """The audit: commits from a device with no status waited 10 s in memory without a rate limit: ten
    seconds of 2 MB junk took the aggregator from 54 to 3,505 MiB."""
    server = site_server(devices=("a",))
    server.start(0.0)
    aggregator = aggregator_of(server, (), 0.0, max_held_mib=8.0)
    junk = b"EPSF" + bytes(2 << 20)
    out = []
    for i in range(100):
        out += aggregator.on_message(server.topics.grad("nobody"), junk, 1.0 + i / 1000)
    assert aggregator.door.held_bytes <= 8 << 20 and len(aggregator.waiting) <= 16
    assert aggregator.report.traffic.rejected["rate_limited"] >= 84


def test_a_flooding_device_is_muted_at_its_aggregator_as_at_the_server() -> None:
    """The audit: ingest workers could not mute a flooding device (a junk flood took the job 5.00 ->
    0.17 versions/s; the flat server under the same flood: 4.50), and the leader's metrics showed
    ``rejected {}``."""
    server = small_server(pace="bsp", sites=frozenset({"s"}), sites_only=True)
    worker = site_of(server, devices=("a", "b"), shared=True, max_commit_rate=10.0, max_commit_burst=5)
    share = "$share/edgeps-t/" + server.topics.grad("a")
    assert share in worker.subscriptions()
    for i in range(40):
        worker.on_message(server.topics.grad("a"), b"junk", 1.0 + i / 1000)
    assert (
        share not in worker.subscriptions() and "$share/edgeps-t/" + server.topics.grad("b") in worker.subscriptions()
    )
    worker.on_message(server.topics.grad("b"), commit_bytes(server, "b", 1), 1.1)
    deliver(server, worker.flush(1.1), 1.1)
    assert server.traffic.rejected["rate_limited"] >= 30 and server.traffic.rejected["malformed"] == 5
    worker.on_tick(3.0)
    assert share in worker.subscriptions()


def test_the_door_refuses_before_it_reads() -> None:
    door = Door(DoorConfig(max_commit_rate=None, max_held_commits=1), DeviceRegistry())
    update = Update("a", 1, 0, 1, 1, {"w": np.zeros(4, np.float32)})
    door.hold_updates([update])
    from ps_service.door import Checks

    refusal = door.admit("a", b"anything", 0.0, Checks(0, {"w": (4,)}, frozenset({"fp32"})))
    assert isinstance(refusal, Refusal) and refusal.rejection.reason is R.RATE_LIMITED
    door.release_updates([update])
    assert door.held_bytes == 0 and not door.held


def test_an_aggregator_listens_to_its_listed_devices_from_the_start() -> None:
    """A worker that subscribed to a device's commits only once its status came could miss its first
    commit (the device commits as soon as the server's control reaches it): with ``--devices`` it
    listens from the start, as the server does to its allow-list, and refuses others' commits."""
    server = small_server(pace="bsp", sites=frozenset({"s"}), sites_only=True)
    server.start(0.0)
    worker = aggregator_of(server, (), 0.0, shared=True, allowed_devices=frozenset({"a", "b"}))
    assert [t for t in worker.subscriptions() if "/grad/" in t] == [
        "$share/edgeps-t/" + server.topics.grad(d) for d in ("a", "b")
    ]
    hello(server, "x")
    out = worker.on_message(server.topics.grad("x"), commit_bytes(server, "x", 1), 1.0)
    out += worker.on_tick(1.0 + WAIT_S)
    assert verdict(out) == ["unknown_device"]


def test_an_admitted_commits_tensors_are_views_of_its_one_vector() -> None:
    """A commit the door takes carries its values once (``flat``); its tensors are made from it only
    when asked (the commit path runs on the vector), in the model's names and shapes, not copied."""
    server = small_server(pace="asp")
    server.start(0.0)
    hello(server, "a")
    update = server.door.admit("a", commit_bytes(server, "a", 1, scale=0.25), 1.0, server.checks())
    assert isinstance(update, Update) and update.tensors is None and update.flat is not None
    assert {name: values.shape for name, values in update.delta.items()} == server.store.shapes
    assert all(np.shares_memory(values, update.flat) for values in update.delta.values())
    assert all(np.all(values == np.float32(0.25)) for values in update.delta.values())
