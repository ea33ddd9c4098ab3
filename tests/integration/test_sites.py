"""Sites: two site brokers bridged to a core broker (three Mosquitto processes, TLS, accounts and
ACLs from ``edgeps broker init --site``), devices on each site, the server on the core."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.client import BrokerAddress, MqttTransport
from broker.deploy.secure import SecureSetup, init_secure_broker
from broker.deploy.sites import aggregator_account, bridge_account, core_acl
from broker.launcher import BrokerProcess, free_port, start_broker
from edge_client.core import DeviceCore
from edgeps.bench.attack.deployments import wait_for_bridges
from ps_service.server.core import ServerCore
from schemas.topics import Publish, Topics
from tests.helpers import next_message, wait_until
from tests.integration.jobs import DEVICES, JOB, ROUNDS, best, on_one_broker, run_job

pytestmark = pytest.mark.integration

SITES = {"a": DEVICES[:2], "b": DEVICES[2:]}


@contextlib.contextmanager
def bridged_brokers(root: Path, aggregators: bool):
    """The setup, the core broker and one broker per site, bridged (each bridge up); stopped after."""
    core_port = free_port()
    setup = init_secure_broker(
        root / "setup",
        JOB,
        devices=[],
        operators=["op"],
        sites=SITES,
        core_address=f"127.0.0.1:{core_port}",
        aggregators=aggregators,
    )
    brokers = [start_broker(port=core_port, workdir=root / "core", embedded=False, template=setup.config)]
    try:
        for site in SITES:
            brokers.append(start_broker(workdir=root / site, embedded=False, template=setup.site_config(site)))
        core, *sites = brokers
        wait_for_bridges(address(setup, core, "op"), JOB, list(SITES), timeout=15)  # each bridge announces itself
        yield setup, core, dict(zip(SITES, sites, strict=True))
    finally:
        for broker in brokers:
            broker.stop()


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    """Sites whose bridges carry their devices' commits."""
    with bridged_brokers(tmp_path_factory.mktemp("sites"), aggregators=False) as brokers:
        yield brokers


@pytest.fixture(scope="module")
def aggregated(tmp_path_factory):
    """Sites that run an aggregator each: their bridges carry site commits instead."""
    with bridged_brokers(tmp_path_factory.mktemp("aggregated"), aggregators=True) as brokers:
        yield brokers


def address(setup: SecureSetup, broker: BrokerProcess, name: str) -> BrokerAddress:
    return BrokerAddress(broker.host, broker.port, name, setup.passwords[name], tls_ca=str(setup.ca_cert))


def on_their_sites(setup: SecureSetup, sites: dict[str, BrokerProcess]) -> dict[str, BrokerAddress]:
    """Each device's address: its account on its site's broker."""
    return {device: address(setup, sites[site], device) for site, members in SITES.items() for device in members}


def account(setup: SecureSetup, broker: BrokerProcess, name: str, subscriptions: list[str]) -> MqttTransport:
    transport = MqttTransport(address(setup, broker, name), f"test-{name}", subscriptions, persistent=False)
    transport.wait_connected(5)
    return transport


def test_a_job_over_two_bridged_sites_trains_as_on_one_broker(topology, tmp_path) -> None:
    setup, core_broker, sites = topology
    bridged, _ = run_job(
        tmp_path / "bridged",
        address(setup, core_broker, "ps"),
        on_their_sites(setup, sites),
    )
    assert bridged.store.version == ROUNDS and bridged.traffic.applied == ROUNDS * len(DEVICES)
    # A commit made after the last version is refused as finished (the protocol's end of a job), nothing else.
    assert set(bridged.traffic.rejected) <= {"finished"}
    direct = on_one_broker(tmp_path)
    assert abs(best(bridged) - best(direct)) <= 0.01, (best(bridged), best(direct))


def test_site_aggregators_cut_the_upstream_bytes_by_their_fan_in(aggregated, tmp_path) -> None:
    """Each site's aggregator sums its two devices' commits into one site commit a round: the job
    trains as on one broker, every commit applied once, and the bytes reaching the core halve."""
    setup, core_broker, sites = aggregated
    summed, aggregators = run_job(
        tmp_path / "aggregated",
        address(setup, core_broker, "ps"),
        on_their_sites(setup, sites),
        {site: address(setup, sites[site], aggregator_account(site)) for site in SITES},
        sites=SITES,
    )
    assert summed.store.version == ROUNDS and summed.traffic.applied == ROUNDS * len(DEVICES)
    assert set(summed.traffic.rejected) <= {"finished"}
    # One site commit a site a round, and at most two more: a site's first round may go up in two (its
    # aggregator learns of a device with the device's hello) and a commit racing the job's end alone.
    assert all(ROUNDS <= a.stats["site_commits"] <= ROUNDS + 2 for a in aggregators), [a.stats for a in aggregators]
    direct = on_one_broker(tmp_path)
    assert abs(best(summed) - best(direct)) <= 0.01, (best(summed), best(direct))
    fan_in = len(DEVICES) / len(SITES)
    ratio = summed.traffic.bytes_up / direct.traffic.bytes_up
    print(
        f"upstream bytes at the core: {summed.traffic.bytes_up} with aggregators, {direct.traffic.bytes_up} "
        f"on one broker: {ratio:.3f}x (fan-in {fan_in:g})"
    )
    assert ratio <= (ROUNDS + 2) / ROUNDS * 1.05 / fan_in, ratio  # 5%: the site commit's header


def test_a_sigkilled_aggregator_loses_and_repeats_no_commit(aggregated, tmp_path) -> None:
    """Site a's aggregator is an `edgeps aggregator` process, stopped and SIGKILLed three times mid-job,
    each time with its devices' commits of the round delivered to it and not acknowledged, and started
    again: its site broker delivers them again (its persistent session, MQTT DUP), each goes up alone
    (a copy of one the server holds would be dropped as such), and the round goes on. Every commit is
    applied once, the job ends, and nothing is refused but commits racing the job's end."""
    setup, core_broker, sites = aggregated
    broker = sites["a"]
    account = aggregator_account("a")
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "aggregator",
        "--job",
        JOB,
        "--site",
        "a",
        "--devices",
        ",".join(SITES["a"]),
        "--broker",
        f"{broker.host}:{broker.port}",
        "--username",
        account,
        "--password-file",
        str(setup.credentials_dir / f"{account}.password"),
        "--tls-ca",
        str(setup.ca_cert),
    ]
    logs = tmp_path / "aggregator.log"
    processes = [subprocess.Popen(command, stdout=logs.open("ab"), stderr=subprocess.STDOUT)]
    kills = []

    def kill_and_restart(core: ServerCore, devices: dict[str, DeviceCore]) -> None:
        for at in (3, 6, 9):
            wait_until(lambda at=at: core.store.version >= at, timeout=60, what=f"version {at}")
            processes[-1].send_signal(signal.SIGSTOP)  # it reads and acknowledges nothing from here on
            # the site's devices commit on this version: the broker sends their commits to a process that
            # will never acknowledge them
            version = core.store.version
            wait_until(
                lambda v=version: all(devices[d].committed_on == v for d in SITES["a"]),
                timeout=30,
                what="site a's devices to commit",
            )
            processes[-1].kill()  # SIGKILL
            processes[-1].wait(timeout=10)
            kills.append(core.store.version)
            processes.append(subprocess.Popen(command, stdout=logs.open("ab"), stderr=subprocess.STDOUT))

    try:
        summed, _ = run_job(
            tmp_path / "killed",
            address(setup, core_broker, "ps"),
            on_their_sites(setup, sites),
            {"b": address(setup, sites["b"], aggregator_account("b"))},
            during=kill_and_restart,
            sites=SITES,
        )
    finally:
        for process in processes:  # one left stopped by a failed wait takes SIGTERM after SIGCONT
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
    assert len(kills) == 3, logs.read_text()
    assert summed.store.version == ROUNDS and summed.traffic.applied == ROUNDS * len(DEVICES), logs.read_text()
    assert set(summed.traffic.rejected) <= {"finished", "replayed"}, (summed.traffic.rejected, logs.read_text())


def test_only_a_sites_own_traffic_crosses_its_bridge(topology) -> None:
    setup, core_broker, sites = topology
    t = Topics(JOB)
    spy = account(setup, core_broker, "op", [t.status("+")])
    device = account(setup, sites["a"], "dev-0", [])
    try:
        device.publish(Publish(t.status("dev-2"), b"forged", qos=1))  # b's device: site a's ACL drops it
        device.publish(Publish(t.status("dev-0"), b"mine", qos=1))
        seen: dict[str, bytes] = {}
        wait_until(lambda: collect(spy, seen).get(t.status("dev-0")) == b"mine", timeout=10, what="dev-0's status")
        assert collect(spy, seen).get(t.status("dev-2")) != b"forged"
    finally:
        device.close()
        spy.close()
    # A site's device has no account on the core, nor on another site.
    for broker in (core_broker, sites["b"]):
        refused = MqttTransport(address(setup, broker, "dev-0"), "dev-0", [], persistent=False)
        with pytest.raises(ConnectionError):
            refused.wait_connected(3)


def test_the_core_acl_names_each_sites_devices_for_its_bridge() -> None:
    acl = core_acl(JOB, "a", SITES["a"])
    t = Topics(JOB)
    assert f"user {bridge_account('a')}" in acl
    assert f"topic write {t.grad('dev-0')}" in acl and f"topic write {t.status('dev-1')}" in acl
    assert "dev-2" not in acl and "+" not in acl  # no wildcard: nothing of another site
    assert f"topic read {t.ctrl('dev-0')}" in acl and f"topic read {t.params}" in acl
    assert t.cmd not in acl and t.metrics not in acl


def one_site(tmp_path: Path) -> tuple[SecureSetup, BrokerProcess, BrokerProcess]:
    """A core broker and one site's (site a, device dev-0), bridged: (setup, core, site)."""
    core_port = free_port()
    setup = init_secure_broker(
        tmp_path / "setup", JOB, devices=[], sites={"a": ["dev-0"]}, core_address=f"127.0.0.1:{core_port}"
    )
    core = start_broker(port=core_port, workdir=tmp_path / "core", embedded=False, template=setup.config)
    return setup, core, start_broker(workdir=tmp_path / "a", embedded=False, template=setup.site_config("a"))


def test_a_core_restart_loses_no_commit_a_site_accepted(tmp_path) -> None:
    """The site broker queues what its bridge could not forward (QoS 1, persistent bridge session) and
    delivers it once the core is back; the server's persistent session on the core survives too."""
    t = Topics(JOB)
    setup, core, site = one_site(tmp_path)
    core_port = core.port
    device = account(setup, site, "dev-0", [])
    try:
        server = MqttTransport(address(setup, core, "ps"), "ps", [t.all_grad], persistent=True)
        server.wait_connected(5)
        device.publish(Publish(t.grad("dev-0"), b"before", qos=1))
        message = next_message(server, timeout=15)
        assert message.payload == b"before"
        server.ack(message)
        server.close()
        core.stop()
        for i in range(5):
            device.publish(Publish(t.grad("dev-0"), f"during-{i}".encode(), qos=1))
        core = start_broker(port=core_port, workdir=tmp_path / "core", embedded=False, template=setup.config)
        server = MqttTransport(address(setup, core, "ps"), "ps", [t.all_grad], persistent=True)
        server.wait_connected(5)
        got = []
        for _ in range(5):
            message = next_message(server, timeout=40)  # the bridge retries after 1 s, then backs off
            got.append(message.payload)
            server.ack(message)
        assert got == [f"during-{i}".encode() for i in range(5)]
        server.close()
    finally:
        device.close()
        site.stop()
        core.stop()


def test_a_site_restart_gets_what_the_core_published_meanwhile(tmp_path) -> None:
    """The core queues what goes down for the bridge's persistent session; retained broadcasts come again
    on the bridge's resubscription (a device may read a snapshot twice: it ignores a version it holds)."""
    t = Topics(JOB)
    setup, core, site = one_site(tmp_path)
    server = account(setup, core, "ps", [])
    try:
        site_port = site.port
        site.stop()
        server.publish(Publish(t.params, b"snapshot", qos=1, retain=True))
        server.publish(Publish(t.ctrl("dev-0"), b"control", qos=1, retain=True))
        site = start_broker(port=site_port, workdir=tmp_path / "a", embedded=False, template=setup.site_config("a"))
        device = account(setup, site, "dev-0", [t.params, t.ctrl("dev-0")])
        try:
            seen: dict[str, bytes] = {}
            wait_until(lambda: len(collect(device, seen)) == 2, timeout=40, what="the snapshot and the control")
            assert seen == {t.params: b"snapshot", t.ctrl("dev-0"): b"control"}
        finally:
            device.close()
    finally:
        server.close()
        site.stop()
        core.stop()


def collect(transport: MqttTransport, seen: dict[str, bytes]) -> dict[str, bytes]:
    """``seen`` with what ``transport`` received meanwhile (newest payload by topic)."""
    while (message := transport.receive(timeout=0.05)) is not None:
        seen[message.topic] = message.payload
        transport.ack(message)
    return seen
