"""The C device core (edge_client/embedded, built with ASan/UBSan) in jobs with the real
ServerCore, through the in-memory relay the Python device's protocol tests use: every pace,
compressed commits and pulls, a reboot, a refused commit. It must train as the Python DeviceCore
does, with no commit refused."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from learning.data import Dataset
from schemas.frame import Frame, FrameKind, encode_frame
from schemas.topics import Publish, Topics
from tests.helpers import Relay, blobs, small_device, small_server


def data_frame(data: Dataset, path: Path) -> Path:
    """A device's data as the harness reads it: a frame of x (n, features) and y (n,)."""
    tensors = {"x": data.x.astype(np.float32), "y": data.y.astype(np.float32)}
    path.write_bytes(encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, tensors=tensors)))
    return path


class CDevice:
    """The C device core in an ``epsd`` process, shaped like a DeviceCore for the relay."""

    def __init__(self, epsd: Path, name: str, data: Path, seed: int, job: str = "t", arena: int = 1 << 20) -> None:
        self.device, self.topics = name, Topics(job)
        self.process = subprocess.Popen(
            [str(epsd), job, name, str(data), str(seed), str(arena)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.subscribed: set[str] = set()
        self.resync = False
        self.logged: list[tuple[str, str]] = []  # (status, reason) from the port's log hook
        self.verdict = "ok"  # what the last message returned

    def _call(self, kind: str, topic: str = "", payload: bytes = b"") -> list[Publish]:
        assert self.process.stdin is not None and self.process.stdout is not None
        t = topic.encode()
        self.process.stdin.write(
            kind.encode() + struct.pack("<H", len(t)) + t + struct.pack("<I", len(payload)) + payload
        )
        self.process.stdin.flush()
        published = []
        while True:
            head = self.process.stdout.read(3)
            assert len(head) == 3, f"epsd exited ({self.process.wait()})"
            out_topic = self.process.stdout.read(struct.unpack("<H", head[1:])[0]).decode()
            body = self.process.stdout.read(struct.unpack("<I", self.process.stdout.read(4))[0])
            what = chr(head[0])
            if what == "E":
                return published
            if what == "S":
                self.resync = self.resync or out_topic in self.subscribed
                self.subscribed.add(out_topic)
            elif what == "U":
                self.subscribed.discard(out_topic)
            elif what == "Q":
                self.last_state = json.loads(body)
            elif what == "G":
                self.logged.append((out_topic, body.decode()))
            elif what == "R":
                self.verdict = out_topic
            elif what == "P":
                retain = out_topic.startswith("R:")
                published.append(Publish(out_topic.removeprefix("R:"), body, qos=1, retain=retain))

    def connected(self) -> list[Publish]:
        return self._call("C")

    def subscriptions(self) -> list[str]:
        return sorted(self.subscribed)

    def on_message(self, topic: str, payload: bytes) -> None:
        self.said = self._call("M", topic, payload)  # a status, when the device cannot take part

    def tick(self, ms: int) -> list[Publish]:
        """The port's tick, the clock moved on by ``ms`` first."""
        return self._call("K", payload=struct.pack("<I", ms))

    def fail_publishes(self, n: int) -> None:
        self._call("F", payload=struct.pack("<I", n))

    def state(self) -> dict:
        self._call("Q")
        return self.last_state

    @property
    def ready(self) -> bool:
        return bool(self.state()["ready"])

    @property
    def finished(self) -> bool:
        return bool(self.state()["finished"])

    def step(self) -> list[Publish]:
        return self._call("T", payload=struct.pack("<I", 1))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0  # a sanitizer's finding exits non-zero


class CRelay(Relay):
    """The relay, with C devices: they subscribe (and say hello) when told they are connected."""

    def connect(self, device) -> None:
        if not isinstance(device, CDevice):
            return super().connect(device)
        self.devices[device.device] = device
        hello = device.connected()
        for topic in device.subscriptions():
            if topic in self.retained:
                device.on_message(topic, self.retained[topic])
        self.send(device, hello)
        self.flush()


def job(epsd, tmp_path, kind: str, pace: str = "bsp", rounds: int = 30, last: int = 0, **config) -> tuple:
    """``rounds`` versions of a job of three devices of ``kind`` (c or python) on the blobs task, which
    ends at version ``last`` (default: ``rounds``); (server, relay, devices)."""
    server = small_server(pace=pace, rounds=last or rounds, **config)
    relay = CRelay(server)
    relay.start()
    devices = []
    for i in range(3):
        if kind == "c":
            devices.append(CDevice(epsd, f"d{i}", data_frame(blobs(seed=i + 1), tmp_path / f"d{i}.bin"), seed=i))
        else:
            devices.append(small_device(f"d{i}", seed=i, incarnation=100 + i))
        relay.connect(devices[-1])
    relay.train(rounds=rounds)
    return server, relay, devices


def best(server) -> float:
    return max(m.accuracy for m in server.history)


CASES = [
    ("bsp", "fp32", "fp32"),
    ("acbsp", "sign", "ternary"),
    ("asp", "topk:0.3", "fp32"),
    ("ssp:1", "int8", "int8"),
    ("acbsp", "ternary", "qsgd:4"),
]


@pytest.mark.parametrize(("pace", "codec", "pull"), CASES)
def test_c_devices_train_as_the_python_ones_with_no_commit_refused(epsd, tmp_path, pace, codec, pull) -> None:
    server, _, devices = job(epsd, tmp_path, "c", pace, codec=codec, pull_codec=pull)
    try:
        assert server.finished and dict(server.traffic.rejected) == {}
        assert server.traffic.applied >= 30
        reference, _, _ = job(epsd, tmp_path, "python", pace, codec=codec, pull_codec=pull)
        assert best(server) >= best(reference) - 0.03, (best(server), best(reference))
    finally:
        for device in devices:
            device.close()


def test_a_rebooted_c_device_resumes_above_its_old_numbers(epsd, tmp_path) -> None:
    server, relay, devices = job(epsd, tmp_path, "c", "asp", rounds=12, last=10**6)
    old = devices[0].state()["seq"]
    devices[0].close()
    reborn = CDevice(epsd, "d0", tmp_path / "d0.bin", seed=99)  # same id, new incarnation, seq from 0
    devices[0] = reborn
    relay.connect(reborn)
    relay.train(rounds=12)
    try:
        assert server.registry.record("d0").incarnation == reborn.state()["incarnation"]
        assert reborn.state()["seq"] > old and dict(server.traffic.rejected) == {}  # none lost to replayed
    finally:
        for device in devices:
            device.close()


@pytest.mark.parametrize("codec", ["fp32", "topk:0.3"])  # topk: a compact commit (protocol 1.9), carried whole
def test_a_refused_commit_releases_a_bsp_c_device_and_its_work_is_carried(epsd, tmp_path, codec) -> None:
    server = small_server(pace="bsp", rounds=10**6, max_commit_rate=1.0, max_commit_burst=1, codec=codec)
    relay = CRelay(server)
    relay.start()
    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1)
    try:
        relay.connect(device)
        relay.train(rounds=1)  # the burst of one commit is spent
        for _ in range(2):  # push_every 2: a commit, refused as rate_limited
            relay.send(device, device.step())
        relay.flush()
        state = device.state()
        assert dict(server.traffic.rejected) == {"rate_limited": 1}
        assert not state["waiting"] and state["ready"] and state["steps"] == 2  # released, its 2 steps carried
    finally:
        device.close()


def step_until_commit(device: CDevice, limit: int = 50) -> list[Publish]:
    for _ in range(limit):
        published = device.step()
        if any("/grad/" in p.topic for p in published):
            return published
    raise AssertionError(f"no commit in {limit} steps: {device.state()}")


def test_a_commit_the_port_refused_is_tried_again_and_never_counted_as_sent(epsd, tmp_path) -> None:
    server = small_server(pace="bsp", rounds=10**6, min_devices=1)
    relay = CRelay(server)
    relay.start()
    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1)
    try:
        relay.connect(device)
        device.fail_publishes(1)
        assert not any("/grad/" in p.topic for p in device.step() + device.step())  # push_every 2: refused
        state = device.state()
        assert state["unpublished"] == 1 and state["has_sent"] == 0 and not state["waiting"]
        assert ("port refused", "the port refused to publish a commit; trying again") in device.logged
        assert device.tick(500) == []  # the first retry comes after 1 s
        again = device.tick(600)
        assert [p.topic for p in again] == ["edgeps/t/grad/d1"]
        relay.send(device, again)
        relay.flush()
        assert server.store.version == 1 and server.traffic.applied == 1  # delivered once, applied once
        assert device.state()["has_sent"] == 1, (device.state(), device.logged)
    finally:
        device.close()


@pytest.mark.parametrize("pace", ["bsp", "ssp:2"])
def test_a_lone_c_device_whose_commits_were_lost_sends_the_newest_again(epsd, tmp_path, pace) -> None:
    """Commits lost on the way (the broker drops them while the server does not listen) hold a bsp
    device for parameters, and an ssp device at its staleness bound, for good: after 30 s with no
    news it sends its newest commit again, the same bytes, and the job goes on."""
    server = small_server(pace=pace, rounds=10**6, min_devices=1)
    relay = CRelay(server)
    relay.start()
    device = CDevice(epsd, "d1", data_frame(blobs(seed=2), tmp_path / "d1.bin"), seed=1)
    try:
        relay.connect(device)
        lost = []
        while device.ready:  # every commit lost, until the device may not go on
            lost += [p for p in device.step() if "/grad/" in p.topic]
        assert lost and server.store.version == 0
        assert device.tick(29_000) == []
        again = device.tick(1_500)
        assert [p.payload for p in again] == [lost[-1].payload]  # the newest commit, byte for byte
        relay.send(device, again)
        relay.flush()
        assert device.ready and server.traffic.applied == 1
        assert device.state()["resends"] == 1
        assert device.tick(10_000) == []  # news came: the clock starts again
    finally:
        device.close()
