"""``edgeps bench attack``: one of three devices hostile, with its own valid account, against a
Mosquitto set up by ``edgeps broker init`` (TLS, passwords, ACLs), beside the same job with three
honest devices. Side by side: final accuracy and versions per second.

The hostile device does what a compromised gateway can within its ACL: it leaves a retained
commit of 1e30 on its own ``grad`` topic before the job starts, says it holds a billion
samples, never commits while the round waits for it (so that each round runs into its
deadline), and rejoins as soon as it has left the barrier, with a commit that is 1e30, zero,
or fp16's largest value in turn.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.report import read_report
from edgeps.tables import Table

ROOT = Path(__file__).resolve().parents[2]  # the repository
JOB = "attack"
DEVICES = ("dev-0", "dev-1", "dev-2")
HOSTILE = "dev-2"


class HostileDevice:
    """The attacker's client: a device account used for harm (see the module's docstring)."""

    def __init__(self, address, shapes: dict[str, tuple[int, ...]]) -> None:
        from broker.client import MqttTransport
        from schemas.topics import Topics

        self.topics = Topics(JOB)
        self.shapes = shapes
        self.seq = 0
        self.sent = 0
        self.finished = threading.Event()
        t = self.topics
        self.transport = MqttTransport(address, "hostile", [t.barrier, t.ctrl(HOSTILE)], persistent=False)
        self.transport.wait_connected(10)

    def commit(self, base: int, values: float | None, retain: bool = False) -> None:
        from schemas.frame import Frame, FrameKind, encode_frame
        from schemas.topics import Publish

        self.seq += 1
        fill = 0.0 if values is None else values
        tensors = {name: np.full(shape, fill, np.float32) for name, shape in self.shapes.items()}
        frame = Frame(kind=FrameKind.COMMIT, base_version=base, tensors=tensors, device=HOSTILE, seq=self.seq,
                      samples=32, steps=1)  # fmt: skip
        self.transport.publish(Publish(self.topics.grad(HOSTILE), encode_frame(frame), qos=1, retain=retain))
        self.sent += 1

    def poison(self) -> None:
        """Before the job: a retained commit of 1e30 on its own commit topic."""
        self.commit(0, 1e30, retain=True)

    def flood(self, size: int, stop: threading.Event) -> None:
        """Publish junk commits of ``size`` bytes on its own topic as fast as it can until ``stop``."""
        from schemas.topics import Publish

        payload = b"EPSF" + bytes(max(0, size - 4))
        while not stop.is_set():
            self.transport.publish(Publish(self.topics.grad(HOSTILE), payload, qos=1))
            self.sent += 1
            if self.sent % 256 == 0:  # let the broker's acknowledgements catch up (paho queues the rest)
                self.transport.wait_acknowledged(30)

    def run(self) -> None:
        """Say hello with a billion samples, then flap: commit only once left out of the barrier."""
        from schemas.messages import Barrier, Control, DeviceStatus, MessageError
        from schemas.topics import Publish

        hello = DeviceStatus(device=HOSTILE, state="online", incarnation=666, samples=10**9)
        self.transport.publish(Publish(self.topics.status(HOSTILE), hello.to_bytes(), qos=1, retain=True))
        payloads = [1e30, None, 65504.0]
        rejoined_at = -1
        while not self.finished.is_set():
            message = self.transport.receive(timeout=0.2)
            if message is None:
                continue
            self.transport.ack(message)
            try:
                if message.topic == self.topics.ctrl(HOSTILE):
                    self.seq = max(self.seq, Control.from_bytes(message.payload, tolerant=True).seq_base)
                    continue
                barrier = Barrier.from_bytes(message.payload, tolerant=True)
            except MessageError:
                continue
            if barrier.state == "finished":
                break
            if HOSTILE in barrier.left and barrier.version != rejoined_at:
                self.commit(barrier.version, payloads[self.sent % len(payloads)])
                rejoined_at = barrier.version
        self.transport.close()


def _client(setup, name: str, shard: Path, broker) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "edgeps.cli", "client", "--broker", f"{broker.host}:{broker.port}", "--job", JOB,
         "--device", name, "--data", str(shard), "--username", name,
         "--password-file", str(setup.credentials_dir / f"{name}.password"), "--tls-ca", str(setup.ca_cert),
         "--seed", name[-1]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip


def run_job(
    hostile: bool,
    rounds: int,
    deadline: float,
    workdir: Path,
    shards,
    setup,
    absent: bool = False,
    flood: int = 0,
) -> dict[str, Any]:
    """One job over a fresh broker from ``setup``; the metrics of its end. ``absent``: the third
    device takes no part at all (what the honest two can do alone); ``flood``: it floods junk
    commits of that many bytes instead of attacking otherwise."""
    from broker.client import BrokerAddress
    from broker.launcher import start_broker
    from learning.model import init_mlp

    broker = start_broker(workdir=workdir / "broker", embedded=False, template=setup.config)
    processes: list[subprocess.Popen] = []
    attacker = None
    report = workdir / "metrics.json"
    try:
        address = BrokerAddress(broker.host, broker.port, HOSTILE,
                                setup.passwords[HOSTILE], tls_ca=str(setup.ca_cert))  # fmt: skip
        if hostile or flood:
            shapes = {name: values.shape for name, values in init_mlp([64, 64, 10], seed=0).items()}
            attacker = HostileDevice(address, shapes)
        if hostile:
            attacker.poison()
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "edgeps.cli", "ps", "--broker", f"{broker.host}:{broker.port}", "--job", JOB,
             "--username", "ps", "--password-file", str(setup.credentials_dir / "ps.password"),
             "--tls-ca", str(setup.ca_cert), "--devices", ",".join(DEVICES), "--rounds", str(rounds),
             "--min-devices", "2" if absent or flood else "3", "--round-deadline", str(deadline),
             "--eval-data", str(shards.holdout), "--report", str(report)],
            stdout=subprocess.DEVNULL, stderr=open(workdir / "ps.log", "wb"), cwd=ROOT,  # noqa: SIM115
        ))  # fmt: skip
        honest = [d for d in DEVICES if not ((hostile or absent or flood) and d == HOSTILE)]
        processes += [_client(setup, name, shards.devices[DEVICES.index(name)], broker) for name in honest]
        runner = None
        if attacker is not None:
            work = attacker.run if hostile else partial(attacker.flood, flood, attacker.finished)
            runner = threading.Thread(target=work, daemon=True)
            runner.start()
        if processes[0].wait(timeout=600) != 0:
            raise RuntimeError(f"the server failed; see {workdir / 'ps.log'}")
        if attacker is not None and runner is not None:
            attacker.finished.set()
            runner.join(timeout=30)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
        broker.stop()
    final = read_report(report)["metrics"][-1]
    return {
        "run": "hostile" if hostile else "two alone" if absent else f"flood {flood} B" if flood else "clean",
        "final_accuracy": final["accuracy"],
        "versions": final["version"],
        "elapsed_s": final["elapsed_s"],
        "versions_per_s": round(final["version"] / final["elapsed_s"], 3) if final["elapsed_s"] else None,
        "rejected": final["rejected"],
        "hostile_commits": attacker.sent if attacker is not None else 0,
    }


def bench_attack(rounds: int = 100, deadline: float = 2.0, floods: tuple[int, ...] = (), say=print) -> dict[str, Any]:
    """The clean job, the hostile one, the two honest devices alone, and one job per size in
    ``floods`` in which the third device floods junk commits of that many bytes."""
    from broker.secure import init_secure_broker
    from learning.data import load_digits
    from learning.prepare import prepare_shards

    with tempfile.TemporaryDirectory(prefix="edgeps-attack-") as tmp:
        root = Path(tmp)
        setup = init_secure_broker(root / "setup", JOB, devices=list(DEVICES), operators=["op"])
        shards = prepare_shards(load_digits(), root / "data", devices=len(DEVICES), alpha=0.5, seed=0)
        runs = []
        kinds = [("clean", False, False, 0), ("hostile", True, False, 0), ("two alone", False, True, 0)]
        kinds += [(f"flood-{size}", False, False, size) for size in floods]
        for name, hostile, absent, flood in kinds:
            say(f"{name} run: {rounds} bsp rounds, round deadline {deadline:g} s ...")
            (root / name).mkdir()
            runs.append(run_job(hostile, rounds, deadline, root / name, shards, setup, absent, flood))
    clean, attacked, alone = runs[:3]
    return {
        "rounds": rounds,
        "round_deadline_s": deadline,
        "runs": runs,
        "accuracy_drop": round(clean["final_accuracy"] - attacked["final_accuracy"], 4),
        "speed_ratio": round(attacked["versions_per_s"] / clean["versions_per_s"], 3),
        "accuracy_drop_vs_two_alone": round(alone["final_accuracy"] - attacked["final_accuracy"], 4),
        "flood_speed_ratios": {r["run"]: round(r["versions_per_s"] / alone["versions_per_s"], 3) for r in runs[3:]},
    }


def format_attack(report: dict[str, Any]) -> Table:
    table = Table(["run", "final acc", "versions", "seconds", "versions/s", "hostile sent", "rejected"])
    for r in report["runs"]:
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items())) or "none"
        table.add(r["run"], f"{r['final_accuracy']:.4f}", r["versions"], f"{r['elapsed_s']:.2f}",
                  f"{r['versions_per_s']:.2f}", r["hostile_commits"], rejected)  # fmt: skip
    table.after.append(f"hostile against clean: accuracy drop {report['accuracy_drop']:+.4f}, versions/s ratio "
                       f"{report['speed_ratio']:.2f}; against the two honest devices alone: accuracy drop "
                       f"{report['accuracy_drop_vs_two_alone']:+.4f}")  # fmt: skip
    for run, ratio in report["flood_speed_ratios"].items():
        table.after.append(f"{run}: versions/s {ratio:.2f}x the two honest devices' alone")
    return table


def run_bench_attack(rounds: int, deadline: float, floods: tuple[int, ...], json_path: str | None) -> dict[str, Any]:
    report = bench_attack(rounds, deadline, floods)
    from edgeps.bench.common import show

    return show(report, format_attack(report), json_path)
