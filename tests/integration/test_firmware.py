"""Firmware that joins a job (issue 30, in progress): the Cortex-M4F image in its NETWORK mode,
the SDK's own MQTT client over UART0, run under QEMU with the UART joined to the project's
Mosquitto (`-serial tcp:`), trains in a bsp job beside a Python device."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from broker.client import BrokerAddress
from edgeps.firmware import build_firmware, check_tools, run_firmware
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from tests.helpers import stop_devices, wait_until
from tests.integration.test_mqtt_job import start_device, start_server

DEMO_ARENA = 91_035  # epsf arena 64,64,10 32: the demo model, fp32 commits and pulls


@pytest.mark.parametrize("board", ["mps2-an386", "riscv32-virt"])
def test_a_firmware_image_joins_a_bsp_job_over_its_uart_and_trains(mosquitto, tmp_path, board) -> None:
    """As a user would: ``edgeps firmware build`` from a shard, ``edgeps firmware run`` against the
    broker; a Cortex-M4F (hard float) and an RV32IMAC (soft float) image, the same SDK."""
    import json
    import subprocess
    import sys

    from edgeps.cli import main

    try:
        check_tools(board)
    except ValueError as exc:
        pytest.fail(str(exc))
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=2, alpha=0.5, seed=0)
    rounds = 10
    server, thread, stop = start_server(address, Dataset.load(shards.holdout), job="fw", pace="bsp", rounds=rounds,
                                        min_devices=2, params=init_mlp([64, 64, 10], seed=0))  # fmt: skip
    out = tmp_path / "fw-0"
    assert main(["firmware", "build", "--board", board, "--device", "fw-0", "--job", "fw", "--data",
                 str(shards.devices[0]), "--broker", f"{mosquitto.host}:{mosquitto.port}", "--seed", "1",
                 "--out", str(out)]) == 0  # fmt: skip
    built = json.loads((out / "firmware.json").read_text())
    assert built["arena_bytes"] == DEMO_ARENA and (out / "firmware.bin").stat().st_size > 20_000
    assert built["ram_bytes"] <= 128 * 1024  # arena, the MQTT client's buffers and the stack, as linked
    firmware = subprocess.Popen([sys.executable, "-m", "edgeps.cli", "firmware", "run", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    python, runner = start_device("fw", "py-1", Dataset.load(shards.devices[1]), address, seed=1)
    try:
        wait_until(lambda: server.finished, timeout=180, what="the job with a firmware device to finish")
        code = firmware.wait(timeout=90)
        console = firmware.stdout.read()  # type: ignore[union-attr]
        assert code == 0 and console.rstrip().endswith("DONE"), console[-2000:]
        assert server.store.version == rounds and server.traffic.applied == 2 * rounds  # each device every round
        assert set(server.traffic.rejected) <= {"finished"}  # commits crossing the job's end only
        assert server.registry.record("fw-0").highest_seq >= rounds
        assert max(m.accuracy for m in server.history) > 0.8
    finally:
        stop.set()
        stop_devices([python], [runner])
        thread.join(timeout=10)
        if firmware.poll() is None:
            firmware.kill()


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
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.close()

    def cut(self, seconds: float) -> None:
        import socket

        self.refusing_until = time.monotonic() + seconds
        self.cuts += 1
        for s in self.open:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.open = []


def test_a_firmware_device_whose_link_is_cut_for_5_s_resumes_and_loses_no_commit(mosquitto, tmp_path) -> None:
    try:
        check_tools("mps2-an386")
    except ValueError as exc:
        pytest.fail(str(exc))
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    shards = prepare_shards(load_digits(), tmp_path / "data", devices=2, alpha=0.5, seed=0)
    rounds = 12
    server, thread, stop = start_server(address, Dataset.load(shards.holdout), job="cut", pace="bsp", rounds=rounds,
                                        min_devices=2, params=init_mlp([64, 64, 10], seed=0))  # fmt: skip
    data = Dataset.load(shards.devices[0])
    elf = build_firmware(tmp_path / "fw", "cut", "fw-0", data.x.astype(np.float32), data.y.astype(np.float32),
                         DEMO_ARENA, seed=1, keep_alive_s=2)  # fmt: skip
    link = CuttableLink(mosquitto.host, mosquitto.port)
    firmware = run_firmware(elf, "127.0.0.1", link.port, tmp_path / "fw.log")
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


def test_the_demo_runs_firmware_devices_beside_python_ones(tmp_path) -> None:
    from edgeps.demo import DemoSettings, run_demo

    report = run_demo(DemoSettings(devices=3, rounds=8, out=tmp_path / "demo", firmware_devices=1), quiet=True)
    assert report["device_backends"] == {"numpy": 2, "firmware-m4": 1}  # the report's trainer line says so
    assert report["rounds"] == 8 and report["rejected"] == 0 and report["best_accuracy"] > 0.7


def test_the_demo_refuses_firmware_devices_it_cannot_run(tmp_path) -> None:
    from edgeps.demo import DemoSettings, run_demo

    with pytest.raises(ValueError, match="--firmware-devices 3: 1 to --devices"):
        run_demo(DemoSettings(devices=3, embedded_devices=1, out=tmp_path / "demo", firmware_devices=3), quiet=True)
