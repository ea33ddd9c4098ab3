"""Firmware that joins a job: the image in its NETWORK mode for a Cortex-M4F (mps2-an386) and an
RV32IMAC without an FPU (riscv32 virt), the SDK's own MQTT client over the UART, run under QEMU with
the UART joined to the project's Mosquitto (a modem in transparent mode): each board joins a job
through the CLI; an image of each board beside 6 Python devices reaches the all-Python job's accuracy
in bsp fp32 and acbsp sign/ternary with nothing refused (`edgeps bench embedded` runs 2 a board);
a link cut for 5 s loses no commit; the demo runs firmware devices."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from broker.client import BrokerAddress
from edgeps.firmware import BOARDS, build_image, check_tools, run_image, splice
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from tests.helpers import stop_devices, wait_until
from tests.integration.test_mqtt_job import start_device, start_server

DEMO_ARENA = 110_275  # epsf arena 64,64,10 32: the demo model, fp32 commits (local, anchor, replica, ...)


def needs_firmware_tools() -> None:
    for board in BOARDS:
        try:
            check_tools(board)
        except ValueError as exc:
            pytest.fail(str(exc))


MIXED_ROUNDS = {"bsp": 20, "acbsp": 20}  # versions of each job (the UART's speed makes a firmware round ~1 s)


class CuttableLink:
    """A TCP relay between the image's UART socket and the broker that can cut the link: every
    connection closed, and none taken for a while (the modem out of coverage)."""

    def __init__(self, host: str, port: int) -> None:
        import socket

        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list = []
        self.refusing_until = 0.0
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            client, _ = self.listener.accept()
            if time.monotonic() < self.refusing_until:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.open += [client, upstream]
            splice(client, upstream)

    def cut(self, seconds: float) -> None:
        import socket

        self.refusing_until = time.monotonic() + seconds
        self.cuts += 1
        for s in self.open:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.open = []


def run_mixed_job(mosquitto, tmp_path, pace: str, codec: str, pull: str, rounds: int, boards: tuple[str, ...]):
    """A job of the demo task over 8 digits shards in ``pace``, commits in ``codec``, pulls in
    ``pull``; its last devices firmware images of ``boards`` under QEMU, the rest Python devices.
    The server once the job ended, and each image's console."""
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=8, alpha=0.5, seed=0)
    job = f"mixed-{len(boards)}"
    server, thread, stop = start_server(
        address,
        Dataset.load(shards.holdout),
        job=job,
        pace=pace,
        rounds=rounds,
        min_devices=8,
        codec=codec,
        pull_codec=pull,
        params=init_mlp([64, 64, 10], seed=0),
    )
    first = 8 - len(boards)
    images, firmware, pythons, runners = {}, [], [], []
    for i, board in enumerate(boards, start=first):
        data = Dataset.load(shards.devices[i])
        images[i] = tmp_path / f"fw-{i}"
        built = build_image(
            images[i],
            board,
            job,
            f"dev-{i}",
            data.x.astype(np.float32),
            data.y.astype(np.float32),
            [64, 64, 10],
            codec,
            pull,
            seed=i,
        )
        assert built["ram_bytes"] <= built["ram_part_bytes"] <= 160 * 1024, built
    try:
        for i, folder in images.items():
            firmware.append(run_image(folder, mosquitto.host, mosquitto.port, tmp_path / f"fw-{i}.log"))
        for i in range(first):
            device, runner = start_device(job, f"dev-{i}", Dataset.load(shards.devices[i]), address, seed=i)
            pythons.append(device)
            runners.append(runner)
        wait_until(lambda: server.finished, timeout=420, what=f"the {pace} job to finish")
        for process in firmware:
            process.wait(timeout=120)
        consoles = [(tmp_path / f"fw-{i}.log").read_text() for i in images]
        return server, consoles
    finally:
        stop.set()
        stop_devices(pythons, runners)
        thread.join(timeout=10)
        for process in firmware:
            if process.poll() is None:
                process.kill()


@pytest.mark.parametrize(("pace", "codec", "pull"), [("bsp", "fp32", "fp32"), ("acbsp", "sign", "ternary")])
def test_firmware_on_both_boards_trains_as_well_as_python_devices(mosquitto, tmp_path, pace, codec, pull) -> None:
    """A Cortex-M4F and an RV32IMAC image beside 6 Python devices against the same job of 8 Python
    devices: the best accuracy within 0.01, nothing refused but commits crossing the job's end. (One
    image a board: the RV32's soft float makes it the round's straggler, and two of them share a
    core with the rest here; `edgeps bench embedded` runs 2 a board, 40 versions.)"""
    needs_firmware_tools()
    rounds = MIXED_ROUNDS[pace]
    python, _ = run_mixed_job(mosquitto, tmp_path / "python", pace, codec, pull, rounds, ())
    mixed, consoles = run_mixed_job(mosquitto, tmp_path / "mixed", pace, codec, pull, rounds, tuple(BOARDS))
    for console in consoles:
        assert console.rstrip().endswith("DONE"), console[-2000:]
    assert set(mixed.traffic.rejected) <= {"finished"}, mixed.traffic.rejected
    assert all(mixed.registry.record(f"dev-{i}").highest_seq >= 1 for i in range(8 - len(BOARDS), 8))  # every image
    best, python_best = max(m.accuracy for m in mixed.history), max(m.accuracy for m in python.history)
    print(f"{pace} {codec}/{pull}: best {best:.4f} with firmware, {python_best:.4f} all Python")
    assert best >= python_best - 0.01, (best, python_best)


def test_a_firmware_device_whose_link_is_cut_for_5_s_resumes_and_loses_no_commit(mosquitto, tmp_path) -> None:
    needs_firmware_tools()
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=2, alpha=0.5, seed=0)
    rounds = 12
    server, thread, stop = start_server(
        address,
        Dataset.load(shards.holdout),
        job="cut",
        pace="bsp",
        rounds=rounds,
        min_devices=2,
        params=init_mlp([64, 64, 10], seed=0),
    )
    data = Dataset.load(shards.devices[0])
    build_image(
        tmp_path / "fw",
        "mps2-an386",
        "cut",
        "fw-0",
        data.x.astype(np.float32),
        data.y.astype(np.float32),
        [64, 64, 10],
        seed=1,
        keep_alive_s=2,
    )
    link = CuttableLink(mosquitto.host, mosquitto.port)
    firmware = run_image(tmp_path / "fw", "127.0.0.1", link.port, tmp_path / "fw.log")
    python, runner = start_device("cut", "py-1", Dataset.load(shards.devices[1]), address, seed=1)
    try:
        wait_until(lambda: server.store.version >= 4, timeout=120, what="version 4")
        link.cut(5.0)
        wait_until(lambda: server.finished, timeout=180, what="the job's end after the cut")
        deadline = time.monotonic() + 90  # the image catches up on what queued for it over its UART
        while firmware.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (tmp_path / "fw.log").read_text()
        assert firmware.returncode == 0 and log.rstrip().endswith("DONE"), log[-2000:]
        assert "the link broke" in log and log.count("CONNECTED") >= 2, log[-2000:]
        built = int(log.split("STEPS ")[1].split()[0])  # commits the image built (the last maybe after the end)
        refused = server.traffic.rejected
        assert set(refused) <= {"finished"}, refused  # none replayed, none lost to a bad frame
        # the server took the image's commits 1, 2, 3, ... in order: none lost across the cut, none twice
        taken = list(server.registry.record("fw-0").recent_seqs)
        assert taken == list(range(1, len(taken) + 1)) and built - 1 <= len(taken) <= built, (taken, built)
        assert server.store.version == rounds and len(taken) >= 3
    finally:
        stop.set()
        stop_devices([python], [runner])
        thread.join(timeout=10)
        if firmware.poll() is None:
            firmware.kill()


def test_a_firmware_image_joins_a_broker_init_deployment_through_a_tls_modem(tmp_path) -> None:
    """The walk-through of docs/EMBEDDED.md, as a user runs it: accounts, ACLs and TLS from
    ``broker init``; ``edgeps firmware build`` with the device's account from a shard; ``edgeps
    firmware run --tls-ca``, the UART's plain MQTT carried over TLS as a modem would."""
    import json
    import subprocess
    import sys

    from broker.deploy.secure import init_secure_broker
    from broker.launcher import start_broker
    from edgeps.cli import main
    from ps_service.config import ServerConfig
    from ps_service.evaluator import Evaluator
    from ps_service.io.mqtt import connect_server, serve
    from ps_service.server.core import ServerCore

    needs_firmware_tools()
    devices = ["dev-0", "dev-1"]
    setup = init_secure_broker(tmp_path / "setup", "tls-fw", devices=devices)
    broker = start_broker(workdir=tmp_path / "run", embedded=False, template=setup.config)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=2, alpha=0.5, seed=0)
    (tmp_path / "dev-1.password").write_text(setup.passwords["dev-1"] + "\n")
    out = tmp_path / "fw"
    assert (
        main(
            [
                "firmware",
                "build",
                "--device",
                "dev-1",
                "--job",
                "tls-fw",
                "--data",
                str(shards.devices[1]),
                "--username",
                "dev-1",
                "--password-file",
                str(tmp_path / "dev-1.password"),
                "--broker",
                f"{broker.host}:{broker.port}",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    built = json.loads((out / "firmware.json").read_text())
    assert built["arena_bytes"] == DEMO_ARENA and (out / "firmware.bin").stat().st_size > 20_000
    assert built["ram_bytes"] <= 128 * 1024  # arena, the MQTT client's buffers and the stack, as linked
    assert built["rx_bytes"] == 1024  # the snapshot streams into the arena: the buffer holds JSON messages only
    assert built["flash_bytes"] <= 64 * 1024  # the SDK with its MQTT client, libc, start-up (the data apart)
    config = ServerConfig(job="tls-fw", rounds=8, min_devices=2, allowed_devices=frozenset(devices))
    core = ServerCore(config, init_mlp([64, 64, 10], seed=0), Evaluator(Dataset.load(shards.holdout)))
    ca = str(setup.ca_cert)
    transport = connect_server(core, BrokerAddress(broker.host, broker.port, "ps", setup.passwords["ps"], tls_ca=ca))
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(core, transport), kwargs={"stop": stop, "linger_s": 0.2}, daemon=True)
    server.start()
    firmware = subprocess.Popen(
        [sys.executable, "-m", "edgeps.cli", "firmware", "run", str(out), "--tls-ca", ca],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    python, runner = None, None
    try:
        address = BrokerAddress(broker.host, broker.port, "dev-0", setup.passwords["dev-0"], tls_ca=ca)
        python, runner = start_device("tls-fw", "dev-0", Dataset.load(shards.devices[0]), address, seed=0)
        wait_until(lambda: core.finished, timeout=180, what="the job over TLS with a firmware device")
        code = firmware.wait(timeout=90)
        console = firmware.stdout.read()  # type: ignore[union-attr]
        assert code == 0 and console.rstrip().endswith("DONE"), console[-2000:]
        assert core.store.version == 8 and core.traffic.applied == 16 and set(core.traffic.rejected) <= {"finished"}
        assert max(m.accuracy for m in core.history) > 0.8
    finally:
        stop.set()
        if python is not None:
            stop_devices([python], [runner])
        server.join(timeout=10)
        transport.close()
        if firmware.poll() is None:
            firmware.kill()
        broker.stop()


def test_the_demo_runs_firmware_devices_beside_python_ones(tmp_path) -> None:
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings

    needs_firmware_tools()
    report = run_demo(DemoSettings(devices=3, rounds=8, out=tmp_path / "demo", firmware_devices=2), quiet=True)
    # the report's trainer line says so: a Cortex-M4F and an RV32IMAC image
    assert report["device_backends"] == {"numpy": 1, "firmware-m4": 1, "firmware-rv32": 1}
    assert report["rounds"] == 8 and report["rejected"] == 0 and report["best_accuracy"] > 0.7


def test_the_demo_refuses_firmware_devices_it_cannot_run(tmp_path) -> None:
    from edgeps.demo import run_demo
    from edgeps.localjob import DemoSettings

    with pytest.raises(ValueError, match="--firmware-devices 3: 1 to --devices"):
        run_demo(DemoSettings(devices=3, embedded_devices=1, out=tmp_path / "demo", firmware_devices=3), quiet=True)
