"""The deployments the audit attacks, each from `edgeps broker init`: flat, sites (a core broker and
bridged site brokers with their aggregators), workers (ingest workers behind the server); their
processes supervised, their memory read."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeps.bench.common import rss_mib

ROOT = Path(__file__).resolve().parents[3]  # the repository


JOB = "attack"


DEVICES = ("dev-0", "dev-1", "dev-2")


HOSTILE = "dev-2"


#: The honest devices' emulated compute time per local step: a job paced by its devices (about 8
#: versions a second, as the audit's), not by the two cores it shares with the broker and the attacker.
STEP_S = 0.01


# ----------------------------------------------------------------------------- the deployments
@dataclass
class Deployment:
    """One path's brokers and the accounts ``edgeps broker init`` made for it."""

    path: str
    setup: Any  # broker.deploy.secure.SecureSetup
    core: Any  # broker.launcher.BrokerProcess
    sites: dict[str, Any] = field(default_factory=dict)  # site -> its broker

    def broker_of(self, device: str) -> Any:
        """Where ``device`` connects: its site's broker, or the core."""
        for site, members in self.setup.sites.items():
            if device in members:
                return self.sites[site]
        return self.core

    def address(self, broker: Any, account: str) -> Any:
        from broker.client import BrokerAddress

        return BrokerAddress(
            broker.host, broker.port, account, self.setup.passwords[account], tls_ca=str(self.setup.ca_cert)
        )

    def login(self, broker: Any, account: str) -> list[str]:
        """The flags that log ``account`` in to ``broker``."""
        creds = self.setup.credentials_dir
        return [
            "--broker",
            f"{broker.host}:{broker.port}",
            "--job",
            JOB,
            "--username",
            account,
            "--password-file",
            str(creds / f"{account}.password"),
            "--tls-ca",
            str(self.setup.ca_cert),
        ]

    def server_flags(self) -> list[str]:
        """The deployment's sites, as the server takes them."""
        if self.path == "sites":
            return [f"--site={site}={','.join(members)}" for site, members in self.setup.sites.items()]
        if self.path == "workers":
            return ["--sites", ",".join(self.setup.workers), "--sites-only"]
        return []

    def helpers(self) -> dict[str, list[str]]:
        """The aggregator and worker processes of the path: name -> command."""
        edgeps = [sys.executable, "-m", "edgeps.cli"]
        if self.path == "sites":
            from broker.deploy.sites import aggregator_account

            account = aggregator_account("s1")
            members = ",".join(self.setup.sites["s1"])
            return {
                "aggregator s1": [
                    *edgeps,
                    "aggregator",
                    "--site",
                    "s1",
                    "--devices",
                    members,
                    *self.login(self.sites["s1"], account),
                ]
            }
        if self.path == "workers":
            return {
                worker: [
                    *edgeps,
                    "aggregator",
                    "--site",
                    worker,
                    "--shared",
                    "--devices",
                    ",".join(DEVICES),
                    *self.login(self.core, worker),
                ]
                for worker in self.setup.workers
            }
        return {}


@contextlib.contextmanager
def deploy(path: str, root: Path) -> Iterator[Deployment]:
    """``path``'s setup (``edgeps broker init``) and brokers, each bridge up; stopped after."""
    from broker.deploy.secure import init_secure_broker
    from broker.launcher import free_port, start_broker

    core_port = free_port()
    options: dict[str, Any] = {"devices": list(DEVICES)}
    if path == "sites":
        options = {
            "devices": [],
            "sites": {"s1": list(DEVICES), "s2": ["spare"]},
            "aggregators": True,
            "core_address": f"127.0.0.1:{core_port}",
        }
    elif path == "workers":
        options["ingest_workers"] = 2
    setup = init_secure_broker(root / "setup", JOB, operators=["op"], host="127.0.0.1", **options)
    brokers = [start_broker(port=core_port, workdir=root / "core", embedded=False, template=setup.config)]
    try:
        sites = {}
        for site in setup.sites:
            sites[site] = start_broker(workdir=root / site, embedded=False, template=setup.site_config(site))
            brokers.append(sites[site])
        deployment = Deployment(path, setup, brokers[0], sites)
        if sites:
            wait_for_bridges(deployment.address(deployment.core, "op"), JOB, list(sites))
        yield deployment
    finally:
        for broker in brokers:
            broker.stop()


def wait_for_bridges(operator: Any, job: str, sites: list[str], timeout: float = 20.0) -> None:
    """Wait until each of ``job``'s ``sites``' bridges says it is up (``1``, retained on the core),
    read with the ``operator`` account's address; RuntimeError after ``timeout`` seconds."""
    from broker.client import MqttTransport
    from schemas.topics import Topics

    t = Topics(job)
    watcher = MqttTransport(operator, f"watch-{operator.username}", [t.site("+")], persistent=False)
    try:
        up: dict[str, bytes] = {}
        deadline = time.monotonic() + timeout
        while up != {t.site(s): b"1" for s in sites}:
            message = watcher.receive(timeout=max(0.0, deadline - time.monotonic()))
            if message is None:
                raise RuntimeError(f"the site bridges did not come up in {timeout:g} s: {up}")
            up[message.topic] = message.payload
    finally:
        watcher.close()


class Supervised:
    """A helper process (an aggregator, an ingest worker) that is started again when it exits, as
    systemd would; every exit is counted as a crash."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.command, self.log = command, log
        self.crashes = 0
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, cwd=ROOT)

    def poll(self) -> None:
        if self.process.poll() is not None:
            self.crashes += 1
            self.process = self._start()

    def stop(self) -> float:
        """SIGTERM; the seconds it took to exit (SIGKILL after 10)."""
        started = time.monotonic()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        return time.monotonic() - started


def _forget_sessions(deployment: Deployment) -> None:
    """End the persistent sessions of the job's server, aggregator and workers, so that what they
    left unacknowledged (a hostile device's last commits) is not handed to the next job's."""
    from broker.client import MqttTransport
    from broker.deploy.sites import aggregator_account

    accounts = [(deployment.core, "ps"), *((deployment.core, w) for w in deployment.setup.workers)]
    accounts += [(deployment.sites[s], aggregator_account(s)) for s in deployment.sites]
    for broker, account in accounts:
        if account in deployment.setup.passwords:
            session = MqttTransport(deployment.address(broker, account), account, [], persistent=False)
            session.wait_connected(10)  # a clean session replaces the persistent one
            session.close()


def _client(deployment: Deployment, device: str, shards: Any, workdir: Path) -> subprocess.Popen[bytes]:
    """An honest device: ``edgeps client`` on its account, on its broker."""
    login = deployment.login(deployment.broker_of(device), device)
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "client",
        *login,
        "--device",
        device,
        "--step-time",
        str(STEP_S),
        "--data",
        str(shards.devices[DEVICES.index(device)]),
        "--seed",
        device[-1],
    ]
    log = (workdir / f"{device}.log").open("wb")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)


def _memory(server: subprocess.Popen[bytes], helpers: list[Supervised]) -> float:
    """The resident memory of the server and its aggregators or workers together, MiB."""
    return sum(rss_mib(pid) or 0.0 for pid in [server.pid, *(h.process.pid for h in helpers)])
