"""Jobs over real brokers, shared by the integration tests of sites and ingest workers: four seeded
devices, a bsp server and, where asked, site aggregators or ingest workers, in threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerAddress, MqttTransport
from broker.launcher import start_broker
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.trainer import NumpyTrainer
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.io.mqtt import connect_server, serve, serve_site
from ps_service.server.core import ServerCore
from ps_service.site.aggregator import SiteAggregator
from ps_service.site.config import SiteConfig
from tests.helpers import wait_until

JOB = "sites"
DEVICES = ["dev-0", "dev-1", "dev-2", "dev-3"]
ROUNDS = 15


def run_job(
    tmp: Path,
    server_address: BrokerAddress,
    device_addresses: dict[str, BrokerAddress],
    aggregators: dict[str, BrokerAddress] | None = None,
    during: Callable[[ServerCore, dict[str, DeviceCore]], None] | None = None,
    sites: dict[str, list[str]] | None = None,
    shared: bool = False,
) -> tuple[ServerCore, list[SiteAggregator]]:
    """A bsp job of the four devices (seeded: the same shards, model and batches every time), with
    an aggregator on each site of ``aggregators`` (site -> its account on the site's broker), site
    commits taken from ``sites`` (site -> its devices, the deployment's; default: the aggregators',
    any device), and ``during`` run beside the job. ``shared``: the aggregators are ingest workers on
    the server's broker (``sites``' names theirs), and the server takes no commit directly."""
    shards = prepare_shards(load_digits(), tmp / "data", devices=len(DEVICES), alpha=0.5, seed=0)
    holdout = Dataset.load(shards.holdout)
    names = frozenset(sites or aggregators or ())
    placed = {"site_devices": sites} if sites and not shared else {"sites": names or None, "sites_only": shared}
    config = ServerConfig(
        job=JOB, rounds=ROUNDS, min_devices=len(DEVICES), allowed_devices=frozenset(DEVICES), **placed
    )
    core = ServerCore(config, init_mlp([64, 32, 10], seed=0), Evaluator(holdout))
    transport = connect_server(core, server_address)
    server = threading.Thread(target=serve, args=(core, transport), daemon=True)
    server.start()
    stop = threading.Event()
    summing = []
    for site, where in (aggregators or {}).items():
        members = DEVICES if shared or not sites else sites[site]
        aggregator = SiteAggregator(SiteConfig(job=JOB, site=site, shared=shared, allowed_devices=frozenset(members)))
        link = MqttTransport(where, f"agg-{site}", aggregator.subscriptions())
        link.wait_connected(5)
        thread = threading.Thread(target=serve_site, args=(aggregator, link, stop), daemon=True)
        thread.start()
        summing.append((aggregator, link, thread))
    runners, devices = [], {}
    for i, (name, shard) in enumerate(zip(DEVICES, shards.devices, strict=True)):
        device = devices[name] = DeviceCore(JOB, name, Dataset.load(shard), NumpyTrainer(), seed=i)
        runner = threading.Thread(target=run_device, args=(device, connect_device(device, device_addresses[name])))
        runner.start()
        runners.append(runner)
    beside = threading.Thread(target=during, args=(core, devices), daemon=True) if during is not None else None
    if beside is not None:
        beside.start()
    try:
        wait_until(lambda: core.finished, timeout=90, what="the job")
        if beside is not None:
            beside.join(timeout=30)
            assert not beside.is_alive()
    finally:
        server.join(timeout=10)
        for runner in runners:
            runner.join(timeout=10)
        stop.set()
        for _, link, thread in summing:
            thread.join(timeout=10)
            link.close()
        transport.close()
    return core, [aggregator for aggregator, _, _ in summing]


def best(core: ServerCore) -> float:
    return max(m.accuracy for m in core.history if m.accuracy is not None)


def on_one_broker(tmp: Path) -> ServerCore:
    """The same job with every device on one broker."""
    local = start_broker(workdir=tmp / "one", embedded=False)
    try:
        plain = BrokerAddress(local.host, local.port)
        direct, _ = run_job(tmp / "direct", plain, dict.fromkeys(DEVICES, plain))
    finally:
        local.stop()
    assert direct.store.version == ROUNDS
    return direct
