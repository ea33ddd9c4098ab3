"""Ingest workers: `edgeps aggregator --shared` processes share the job's commits through an MQTT 5
shared subscription on the server's Mosquitto, and the server takes them only as site commits."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from broker.client import BrokerAddress
from broker.launcher import start_broker
from edge_client.core import DeviceCore
from ps_service.server.core import ServerCore
from tests.helpers import wait_until
from tests.integration.jobs import DEVICES, JOB, ROUNDS, best, on_one_broker, run_job

pytestmark = pytest.mark.integration

WORKERS = ["ingest-0", "ingest-1"]


def test_two_ingest_workers_share_the_commits_and_train_as_one_server(tmp_path) -> None:
    broker = start_broker(workdir=tmp_path / "broker", embedded=False)
    try:
        plain = BrokerAddress(broker.host, broker.port)
        shared, workers = run_job(
            tmp_path / "shared", plain, dict.fromkeys(DEVICES, plain), dict.fromkeys(WORKERS, plain), shared=True
        )
    finally:
        broker.stop()
    assert shared.store.version == ROUNDS and shared.traffic.applied == ROUNDS * len(DEVICES)
    assert set(shared.traffic.rejected) <= {"finished"}
    # the broker spreads the commits over both workers, and each of them went up once
    assert all(w.stats["forwarded"] > 0 for w in workers), [w.stats for w in workers]
    assert sum(w.stats["forwarded"] for w in workers) >= ROUNDS * len(DEVICES)
    direct = on_one_broker(tmp_path)
    assert abs(best(shared) - best(direct)) <= 0.01, (best(shared), best(direct))


def test_a_sigkilled_worker_loses_and_repeats_no_commit(tmp_path) -> None:
    """Worker ingest-0 is a process, stopped and SIGKILLed mid-job with commits of the round delivered to
    it and unacknowledged, and started again under the same client id, up to three times: Mosquitto
    keeps what it was given in its session (it does not hand them to the live worker) and delivers them
    again to the new process. Every commit is applied once and the job ends."""
    broker = start_broker(workdir=tmp_path / "broker", embedded=False)
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "aggregator",
        "--job",
        JOB,
        "--site",
        WORKERS[0],
        "--shared",
        "--devices",
        ",".join(DEVICES),
        "--broker",
        f"{broker.host}:{broker.port}",
    ]
    logs = tmp_path / "worker.log"
    processes = [subprocess.Popen(command, stdout=logs.open("ab"), stderr=subprocess.STDOUT)]
    kills = []
    # its shared subscription is in place before the job begins (later ones keep it in their session)
    wait_until(lambda: "aggregating" in logs.read_text(), timeout=30, what="ingest-0 to connect")

    def kill_and_restart(core: ServerCore, devices: dict[str, DeviceCore]) -> None:
        for at in (3, 6, 9):
            wait_until(lambda at=at: core.store.version >= at, timeout=60, what=f"version {at}")
            processes[-1].send_signal(signal.SIGSTOP)
            # the broker hands about every other commit to the stopped worker: within a round or two one of
            # them holds a round up, every device having committed on the version
            wait_until(
                lambda: core.finished or all(d.committed_on == core.store.version for d in devices.values()),
                timeout=30,
                what="a round held up",
            )
            processes[-1].kill()
            processes[-1].wait(timeout=10)
            processes.append(subprocess.Popen(command, stdout=logs.open("ab"), stderr=subprocess.STDOUT))
            if core.finished:
                return
            kills.append(core.store.version)

    try:
        plain = BrokerAddress(broker.host, broker.port)
        shared, live = run_job(
            tmp_path / "killed",
            plain,
            dict.fromkeys(DEVICES, plain),
            {WORKERS[1]: plain},
            during=kill_and_restart,
            sites=dict.fromkeys(WORKERS, DEVICES),
            shared=True,
        )
    finally:
        for process in processes:  # one left stopped by a failed wait takes SIGTERM after SIGCONT
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
        broker.stop()
    assert len(kills) >= 2, logs.read_text()
    # the broker gave the live worker every other commit (30 of 60 in each of three runs): the rest came
    # through ingest-0's processes, killed with some of them in hand
    assert live[0].stats["forwarded"] < ROUNDS * len(DEVICES), live[0].stats
    assert shared.store.version == ROUNDS and shared.traffic.applied == ROUNDS * len(DEVICES), logs.read_text()
    assert set(shared.traffic.rejected) <= {"finished", "replayed"}, (shared.traffic.rejected, logs.read_text())
