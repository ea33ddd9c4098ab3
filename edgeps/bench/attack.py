"""``edgeps bench attack``: the hostile-client audit, against real deployments of ``edgeps broker
init`` (TLS, passwords, ACLs, client ids pinned to accounts), on three paths:

* ``flat``: one broker, the server, three devices on it;
* ``sites``: a core broker and a site broker bridged to it, the site's aggregator (``edgeps
  aggregator --site s1``) beside it, the three devices on the site; a second site (``s2``) whose
  aggregator account is the attacker's;
* ``workers``: one broker, two ingest workers (``edgeps aggregator --shared``) and the server
  behind them (``--sites-only``), the three devices on it.

On each path, a clean job (three honest devices) and one job per attack, in which the third device
(or, for ``site_flood``, site s2's aggregator account) is hostile within its ACL, does what the
audit did (``ATTACKS``). Each entry of ``attacks`` says what the job reached (``clean_metric``,
``attacked_metric``: final held-out accuracy; ``attacked_mean``: the mean over the second half of
its versions, while the attack went on), how many times a server, aggregator or worker process
exited (``crashes``; a supervisor restarts an aggregator or worker that exits), the resident memory
of those processes before and after (MiB), and versions per second against the clean job's.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.bench.common import rss_mib
from edgeps.tables import Table
from schemas.messages import MAX_SAFE_INT

ROOT = Path(__file__).resolve().parents[2]  # the repository
JOB = "attack"
DEVICES = ("dev-0", "dev-1", "dev-2")
HOSTILE = "dev-2"
PATHS = ("flat", "sites", "workers")
#: What the hostile device (or account) does, by name: the audit's attacks.
ATTACKS = {
    "huge_seq": "commits whose sequence number is 2^53 and above (a site commit cannot carry it)",
    "bomb": "a commit of 1e30 every version",
    "future_base": "a retained commit, then live ones, based on version 2^53 - 1",
    "samples_flip": "claims 2^32 - 1 samples and commits the reverse of each version, just under the old 8x bound",
    "inbound": "commits the reverse of each version at 7.9x the fleet's median norm (just under the old bound)",
    "flood": "junk commits of 100 KB as fast as the broker takes them",
    "flap": "its status offline and online again every 0.3 s, never a commit",
    "site_flood": "site s2's aggregator account floods junk site commits (sites only)",
}
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


# ----------------------------------------------------------------------------- the attacker
class Hostile:
    """The attacker's client: device ``HOSTILE``'s account (or, for ``site_flood``, site s2's
    aggregator account) used for harm, as ``ATTACKS`` describes."""

    def __init__(self, deployment: Deployment, attack: str, shapes: dict[str, tuple[int, ...]]) -> None:
        from broker.client import MqttTransport
        from schemas.topics import Topics

        self.attack, self.shapes = attack, shapes
        self.topics = t = Topics(JOB)
        self.sent = 0
        self.done = threading.Event()
        if attack == "site_flood":
            from broker.deploy.sites import aggregator_account

            account = aggregator_account("s2")
            broker = deployment.sites["s2"]
            self.transport = MqttTransport(deployment.address(broker, account), account, [t.barrier], persistent=False)
        else:
            where = deployment.address(deployment.broker_of(HOSTILE), HOSTILE)
            self.transport = MqttTransport(where, HOSTILE, [t.barrier, t.params, t.ctrl(HOSTILE)], persistent=False)
        self.transport.wait_connected(10)
        self.seq = 0
        self.incarnation = 1 + int(
            np.random.default_rng().integers(1 << 40)
        )  # a new boot: an earlier job's control is not ours
        self.run_id: int | None = None  # the job's run, from its control: what an earlier job left is ignored
        self.models: list[dict[str, np.ndarray]] = []  # the last two versions' parameters
        self.max_norm: float | None = None
        self.under_way = False  # a barrier of this job past its first version came

    def _publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        from schemas.topics import Publish

        self.transport.publish(Publish(topic, payload, qos=1, retain=retain))
        self.sent += 1
        if self.sent % 256 == 0:  # let the broker's acknowledgements catch up (paho queues the rest)
            self.transport.wait_acknowledged(30)

    def hello(self, samples: int) -> None:
        from schemas.messages import DeviceStatus

        status = DeviceStatus(device=HOSTILE, state="online", incarnation=self.incarnation, samples=samples)
        self._publish(self.topics.status(HOSTILE), status.to_bytes(), retain=True)

    def commit(self, base: int, tensors: dict[str, np.ndarray], seq: int | None = None, retain: bool = False) -> None:
        from schemas.frame import Frame, FrameKind, encode_frame

        self.seq += 1
        frame = Frame(
            kind=FrameKind.COMMIT,
            base_version=base,
            tensors=tensors,
            device=HOSTILE,
            seq=self.seq if seq is None else seq,
            samples=32,
            steps=10,
        )
        self._publish(self.topics.grad(HOSTILE), encode_frame(frame), retain=retain)

    def filled(self, value: float) -> dict[str, np.ndarray]:
        return {name: np.full(shape, value, np.float32) for name, shape in self.shapes.items()}

    def reverse(self) -> dict[str, np.ndarray]:
        """The reverse of the last version's change, 10 steps at 7.9x the fleet's median per-step norm
        (the barrier's bound is twice it), or 8x the version's own change before there is a bound."""
        new, old = self.models[-1], self.models[-2] if len(self.models) > 1 else self.models[-1]
        change = {n: (new[n] - old[n]).astype(np.float64) for n in new}
        length = math.sqrt(sum(float(np.vdot(v, v)) for v in change.values())) or 1.0
        target = 10 * 3.95 * self.max_norm if self.max_norm else 8 * length
        return {n: (-target * v / length).astype(np.float32) for n, v in change.items()}

    def run(self) -> None:
        """Attack until ``done``; then leave nothing behind (its retained commit cleared, its
        connection closed), so that the next job meets only its own attacker."""
        try:
            self._attack()
        finally:
            if self.attack == "future_base":
                self._publish(self.topics.grad(HOSTILE), b"", retain=True)
            self.transport.close()

    def _attack(self) -> None:
        flooding = self.attack in ("flood", "site_flood")
        if self.attack != "site_flood":
            self.hello(2**32 - 1 if self.attack == "samples_flip" else 134)
        if self.attack == "future_base":
            self.commit(MAX_SAFE_INT, self.filled(0.01), retain=True)
        flapped = time.monotonic()
        while not self.done.is_set():
            if flooding and self.under_way:  # the job runs: flood it
                return self.flood()
            if self.attack == "flap" and time.monotonic() - flapped >= 0.3:
                flapped = time.monotonic()
                self.flap()
            message = self.transport.receive(timeout=0.1)
            if message is None:
                continue
            self.transport.ack(message)
            self.on_message(message.topic, message.payload)

    def flood(self) -> None:
        """Junk commits of 100 KB (or junk site commits) as fast as the broker takes them, until ``done``."""
        topic = self.topics.part("s2") if self.attack == "site_flood" else self.topics.grad(HOSTILE)
        junk = b"EPSF" + bytes(100_000)
        while not self.done.is_set():
            self._publish(topic, junk)

    def flap(self) -> None:
        from schemas.messages import DeviceStatus

        offline = DeviceStatus(device=HOSTILE, state="offline", incarnation=self.incarnation)
        self._publish(self.topics.status(HOSTILE), offline.to_bytes(), retain=True)
        self.hello(134)

    def on_message(self, topic: str, payload: bytes) -> None:
        from schemas.frame import FrameError, decode_frame
        from schemas.messages import Barrier, Control, MessageError

        try:
            if topic == self.topics.ctrl(HOSTILE):
                control = Control.from_bytes(payload, tolerant=True)
                if control.incarnation == self.incarnation:  # (a control left by an earlier job is not)
                    self.seq, self.run_id = max(self.seq, control.seq_base), control.run
                return
            if topic == self.topics.barrier:
                barrier = Barrier.from_bytes(payload, tolerant=True)
                # a site's aggregator account reads no control: any running barrier past version 0 is this job's
                if barrier.run == self.run_id or (self.attack == "site_flood" and barrier.state == "running"):
                    self.max_norm = barrier.max_norm
                    self.under_way = self.under_way or barrier.version >= 1
                    if barrier.state == "finished":
                        self.done.set()
                return
            frame = decode_frame(payload)  # a new version's parameters: the attack's moment
        except (MessageError, FrameError):
            return
        if frame.seq != self.run_id:  # a snapshot's seq is its run
            return
        self.models = [*self.models[-1:], frame.tensors]
        version = frame.base_version
        if self.attack == "huge_seq":
            self.commit(version, self.filled(0.01), seq=2**53 + version)
        elif self.attack == "bomb":
            self.commit(version, self.filled(1e30))
        elif self.attack == "future_base":
            self.commit(MAX_SAFE_INT, self.filled(0.01))
        elif self.attack in ("samples_flip", "inbound"):
            self.commit(version, self.reverse())


# ----------------------------------------------------------------------------- one job
def run_job(
    deployment: Deployment, attack: str | None, rounds: int, deadline: float, shards: Any, workdir: Path
) -> dict[str, Any]:
    """One job of ``rounds`` bsp versions on ``deployment``: three honest devices, or two and the
    hostile one (``attack``; for ``site_flood``, three and the hostile account). It starts once
    the three devices said hello. What it reached, and what its processes did."""
    from broker.client import MqttTransport
    from learning.model import init_mlp
    from schemas.messages import MessageError, Metrics
    from schemas.topics import Topics

    workdir.mkdir(parents=True)
    edgeps = [sys.executable, "-m", "edgeps.cli"]
    watcher = MqttTransport(deployment.address(deployment.core, "op"), "op", [Topics(JOB).metrics], persistent=False)
    watcher.wait_connected(10)
    server = subprocess.Popen(
        [
            *edgeps,
            "ps",
            *deployment.login(deployment.core, "ps"),
            "--devices",
            ",".join(DEVICES),
            *deployment.server_flags(),
            "--rounds",
            str(rounds),
            "--min-devices",
            str(len(DEVICES)),
            "--round-deadline",
            str(deadline),
            "--eval-data",
            str(shards.holdout),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "ps.log").open("wb"),
        cwd=ROOT,
    )
    helpers = [
        Supervised(command, workdir / f"{name.replace(' ', '-')}.log") for name, command in deployment.helpers().items()
    ]
    honest = [d for d in DEVICES if not (attack and attack != "site_flood" and d == HOSTILE)]
    clients = [_client(deployment, d, shards, workdir) for d in honest]
    hostile = runner = None
    history: list[Metrics] = []
    before = after = 0.0
    try:
        if attack is not None:
            shapes = {name: values.shape for name, values in init_mlp([64, 64, 10], seed=0).items()}
            hostile = Hostile(deployment, attack, shapes)
            runner = threading.Thread(target=hostile.run, daemon=True)
            runner.start()
        give_up = time.monotonic() + 600
        while server.poll() is None and time.monotonic() < give_up and not (history and history[-1].finished):
            for helper in helpers:
                helper.poll()
            message = watcher.receive(timeout=0.2)
            if message is None:
                continue
            try:
                metrics = Metrics.from_bytes(message.payload)
            except MessageError:
                continue
            if not before and metrics.version >= 1:  # the job is under way: everything started
                before = _memory(server, helpers)
            after = _memory(server, helpers) or after
            history.append(metrics)
    finally:
        if hostile is not None and runner is not None:
            hostile.done.set()
            runner.join(timeout=30)
        watcher.close()
        stopped = [helper.stop() for helper in helpers]
        if server.poll() is None and not (history and history[-1].finished):
            server.terminate()
        for process in [server, *clients]:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
    _forget_sessions(deployment)
    accuracies = [m.accuracy for m in history if m.accuracy is not None]
    final = history[-1] if history else None
    return {
        "final_accuracy": final.accuracy or 0.0 if final else 0.0,
        "mean_accuracy": float(np.mean(accuracies[len(accuracies) // 2 :])) if accuracies else 0.0,
        "versions": final.version if final else 0,
        "versions_per_s": round(final.version / final.elapsed_s, 3) if final and final.elapsed_s else 0.0,
        "rejected": dict(final.rejected) if final else {},
        "crashes": sum(h.crashes for h in helpers) + (0 if server.returncode == 0 else 1),
        "rss_mib_before": round(before, 1),
        "rss_mib_after": round(after, 1),
        "sigterm_s": round(max(stopped, default=0.0), 2),
        "hostile_sent": hostile.sent if hostile is not None else 0,
    }


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


# ----------------------------------------------------------------------------- the bench
def bench_attack(
    paths: tuple[str, ...] = PATHS,
    attacks: tuple[str, ...] = tuple(ATTACKS),
    rounds: int = 150,
    deadline: float = 1.0,
    say: Any = print,
) -> dict[str, Any]:
    """On each of ``paths``, the clean job and one job per attack of ``attacks``."""
    from learning.data import load_digits
    from learning.prepare import prepare_shards

    unknown = [p for p in paths if p not in PATHS] + [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise ValueError(
            f"unknown paths or attacks: {', '.join(unknown)}; paths: {', '.join(PATHS)}; attacks: {', '.join(ATTACKS)}"
        )
    entries = []
    with tempfile.TemporaryDirectory(prefix="edgeps-attack-") as tmp:
        root = Path(tmp)
        shards = prepare_shards(load_digits(), root / "data", devices=len(DEVICES), alpha=0.5, seed=0)
        for path in paths:
            with deploy(path, root / path) as deployment:
                say(f"{path}: clean job ({rounds} bsp rounds) ...", end=" ", flush=True)
                clean = run_job(deployment, None, rounds, deadline, shards, root / path / "clean")
                say(f"accuracy {clean['final_accuracy']:.4f}")
                for attack in attacks:
                    if attack == "site_flood" and path != "sites":
                        continue
                    say(f"{path}: {attack} ...", end=" ", flush=True)
                    run = run_job(deployment, attack, rounds, deadline, shards, root / path / attack)
                    say(f"accuracy {run['final_accuracy']:.4f}, {run['crashes']} crashes")
                    entries.append(
                        {
                            "name": attack,
                            "path": path,
                            "clean_metric": clean["final_accuracy"],
                            "attacked_metric": run["final_accuracy"],
                            "attacked_mean": run["mean_accuracy"],
                            "crashes": run["crashes"],
                            "rss_mib_before": run["rss_mib_before"],
                            "rss_mib_after": run["rss_mib_after"],
                            "versions_per_s": run["versions_per_s"],
                            "clean_versions_per_s": clean["versions_per_s"],
                            "versions": run["versions"],
                            "rejected": run["rejected"],
                            "hostile_sent": run["hostile_sent"],
                            "sigterm_s": run["sigterm_s"],
                        }
                    )
    held = [
        e
        for e in entries
        if e["crashes"] == 0 and min(e["attacked_metric"], e["attacked_mean"]) >= 0.9 * e["clean_metric"]
    ]
    return {"rounds": rounds, "round_deadline_s": deadline, "attacks": entries, "held": len(held), "of": len(entries)}


def format_attack(report: dict[str, Any]) -> Table:
    title = (
        f"each path's clean job, and one per attack ({report['rounds']} bsp rounds, deadline "
        f"{report['round_deadline_s']:g} s): held-out accuracy at the end and over its second half"
    )
    table = Table(
        ["path", "attack", "clean", "final", "mean", "v/s ratio", "crashes", "RSS MiB", "refused"], before=[title]
    )
    for e in report["attacks"]:
        ratio = e["versions_per_s"] / e["clean_versions_per_s"] if e["clean_versions_per_s"] else 0.0
        refused = ", ".join(f"{k} {v}" for k, v in sorted(e["rejected"].items())) or "none"
        table.add(
            e["path"],
            e["name"],
            f"{e['clean_metric']:.4f}",
            f"{e['attacked_metric']:.4f}",
            f"{e['attacked_mean']:.4f}",
            f"{ratio:.2f}",
            e["crashes"],
            f"{e['rss_mib_before']:.0f} -> {e['rss_mib_after']:.0f}",
            refused[:60],
        )
    table.after.append(
        f"{report['held']} of {report['of']} attacks held: no crash, accuracy at the end and during "
        "the attack at least 0.9 of the clean job's"
    )
    return table


def plot_attack(report: dict[str, Any], path: str | Path) -> None:
    """PNG: for each path, each attack's accuracy at the end and during it, against the clean job's
    (the line) and 0.9 of it (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deployments = list(dict.fromkeys(e["path"] for e in report["attacks"]))
    fig, axes = plt.subplots(1, len(deployments), figsize=(4.8 * len(deployments), 3.6), squeeze=False, sharey=True)
    for ax, deployment in zip(axes[0], deployments, strict=True):
        entries = [e for e in report["attacks"] if e["path"] == deployment]
        x = np.arange(len(entries))
        ax.bar(x - 0.2, [e["attacked_metric"] for e in entries], 0.4, label="at the end")
        ax.bar(x + 0.2, [e["attacked_mean"] for e in entries], 0.4, label="during (second half)")
        clean = entries[0]["clean_metric"]
        ax.axhline(clean, color="black", lw=1, label=f"clean {clean:.3f}")
        ax.axhline(0.9 * clean, color="black", lw=1, ls="--", label="0.9 of clean")
        crashes = sum(e["crashes"] for e in entries)
        ax.set(title=f"{deployment}: {crashes} crashes", xticks=x, ylim=(0.5, 1.0), ylabel="held-out accuracy")
        ax.set_xticklabels([e["name"] for e in entries], rotation=40, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(loc="lower left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_attack(
    paths: tuple[str, ...],
    attacks: tuple[str, ...],
    rounds: int,
    deadline: float,
    json_path: str | None,
    plot: str | None = "bench-attack.png",
) -> dict[str, Any]:
    report = bench_attack(paths, attacks, rounds, deadline)
    if plot:
        plot_attack(report, plot)
    from edgeps.bench.common import show

    return show(report, format_attack(report), json_path)
