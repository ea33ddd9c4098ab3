"""Shared test helpers: waiting on conditions, tiny jobs built from the real components."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from edge_client.core import DeviceCore
from edge_client.trainer import NumpyTrainer
from learning.data import Dataset
from learning.model import init_mlp
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.server.core import ServerCore
from schemas.frame import Frame


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def stop_devices(cores, runners, timeout: float = 10.0) -> None:
    """Tell device cores to finish and wait for their driver threads."""
    for core in cores:
        core.finished = True
    for runner in runners:
        runner.join(timeout=timeout)


def blobs(n: int = 200, features: int = 8, classes: int = 3, seed: int = 0) -> Dataset:
    """A small, learnable dataset: Gaussian blobs around fixed class centres; ``seed`` draws the samples."""
    centres = np.random.default_rng(12345).normal(0, 2, size=(classes, features))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, size=n)
    x = centres[y] + rng.normal(0, 0.5, size=(n, features))
    return Dataset(x.astype(np.float32), y.astype(np.int64))


def small_server(pace: str = "bsp", rounds: int = 5, run: int | None = None, **overrides: object) -> ServerCore:
    data = blobs()
    settings: dict = {"push_every": 2, "lr": 0.1, "batch_size": 16, **overrides}
    config = ServerConfig(job="t", pace=pace, rounds=rounds, **settings)
    return ServerCore(config, init_mlp([8, 16, 3], seed=0), Evaluator(data, clock=time.perf_counter), run=run)


#: The run of the job that device tests pretend a server started, and every test device's incarnation.
RUN = 7
INCARNATION = 11


def small_device(name: str, seed: int = 0, incarnation: int = INCARNATION) -> DeviceCore:
    return DeviceCore("t", name, blobs(seed=seed + 1), NumpyTrainer(), seed=seed, incarnation=incarnation)


def control_bytes(device: str = "d1", **fields) -> bytes:
    """A Control for ``device`` of run ``RUN``, answering incarnation ``INCARNATION``; ``fields`` override."""
    from schemas.messages import Control

    values = {
        "run": RUN,
        "incarnation": INCARNATION,
        "lr": 0.1,
        "batch_size": 8,
        "push_every": 3,
        "wait_for_params": False,
        **fields,
    }
    values.setdefault("max_uncommitted_steps", 8 * values["push_every"])
    return Control(device=device, **values).to_bytes()


def params_bytes(version: int, tensors, run: int = RUN) -> bytes:
    """A parameter snapshot of ``version`` in run ``run``."""
    from schemas.frame import Frame, FrameKind, encode_frame

    return encode_frame(Frame(kind=FrameKind.PARAMS, base_version=version, seq=run, tensors=tensors))


def commit_bytes(
    server: ServerCore, device: str, seq: int, base: int | None = None, scale: float = 0.01, **kw
) -> bytes:
    """A valid commit frame for ``server``'s model from ``device``; ``kw`` overrides frame fields."""
    from schemas.frame import Frame, FrameKind, encode_frame

    fields = dict(
        kind=FrameKind.COMMIT,
        base_version=server.store.version if base is None else base,
        tensors={name: np.full(shape, scale, np.float32) for name, shape in server.store.shapes.items()},
        device=device,
        seq=seq,
        samples=10,
        steps=2,
    )
    fields.update(kw)
    return encode_frame(Frame(**fields))


def hello(
    server: ServerCore,
    device: str,
    state: str = "online",
    samples: int = 10,
    incarnation: int = INCARNATION,
    now: float = 0.0,
) -> list:
    from schemas.messages import DeviceStatus

    body = DeviceStatus(device=device, state=state, samples=samples, incarnation=incarnation).to_bytes()
    return server.on_message(server.topics.status(device), body, now=now)


def next_message(transport, timeout: float = 10.0):
    """The next message a transport receives; AssertionError after ``timeout`` seconds."""
    message = transport.receive(timeout=timeout)
    if message is None:
        raise AssertionError(f"no message within {timeout} s")
    return message


class Relay:
    """A lossless in-memory broker between one ServerCore and DeviceCores: retained messages,
    each device's subscriptions (and re-subscriptions), FIFO delivery. For sans-IO tests of the
    protocol between the two cores; the MQTT tests use Mosquitto."""

    def __init__(self, server: ServerCore, now: float = 0.0) -> None:
        self.server = server
        self.now = now
        self.devices: dict[str, DeviceCore] = {}
        self.retained: dict[str, bytes] = {}
        self.log: list = []  # every message the server published
        self._pending: list = []  # (target, message): "server" or a device id

    def start(self) -> None:
        self._from_server(self.server.start(self.now))
        self.flush()

    def _from_server(self, messages: list) -> None:
        for message in messages:
            self.log.append(message)
            if message.retain:
                self.retained[message.topic] = message.payload
            for name, device in self.devices.items():
                if message.topic in device.subscriptions():
                    self._pending.append((name, message))

    def connect(self, device: DeviceCore) -> None:
        """``device`` connects: it subscribes (getting the retained messages) and says hello."""
        self.devices[device.device] = device
        for topic in device.subscriptions():
            if topic in self.retained:
                device.on_message(topic, self.retained[topic])
        self.send(device, [device.status("online")])
        self.flush()

    def send(self, device: DeviceCore, messages: list) -> None:
        for message in messages:
            if message.retain:
                self.retained[message.topic] = message.payload
            self._pending.append(("server", message))

    def flush(self) -> None:
        """Deliver until nothing is in flight."""
        while self._pending:
            target, message = self._pending.pop(0)
            if target == "server":
                self._from_server(self.server.on_message(message.topic, message.payload, self.now))
                continue
            device = self.devices.get(target)
            if device is None:
                continue
            before = set(device.subscriptions())
            device.on_message(message.topic, message.payload)
            fresh = set(device.subscriptions()) - before
            if device.resync:
                device.resync = False
                fresh.add(device.topics.params)
            for topic in fresh:
                if topic in self.retained:
                    self._pending.append((target, type(message)(topic, self.retained[topic], retain=True)))

    def train(self, rounds: int = 1, limit: int = 10_000) -> None:
        """Step every ready device until the server has made ``rounds`` more versions."""
        goal = self.server.store.version + rounds
        for _ in range(limit):
            if self.server.store.version >= goal or self.server.finished:
                return
            stepped = False
            self.now += 0.001  # a local step takes a millisecond
            for device in list(self.devices.values()):
                if device.ready:
                    self.send(device, device.step())
                    stepped = True
            self.flush()
            if not stepped:
                self.now += 0.1
                self._from_server(self.server.on_tick(self.now))
                self.flush()
        raise AssertionError(f"no version {goal} after {limit} steps (at {self.server.store.version})")


def read_commit(payload: bytes, shapes: dict[str, tuple[int, ...]] | None = None) -> Frame:
    """A device's commit decoded: a compact commit names no tensors, so the model's ``shapes`` (by
    default the small MLP 8-16-3 of ``small_server`` and ``small_device``) name them."""
    from schemas.frame import decode_frame

    if shapes is None:
        shapes = {name: values.shape for name, values in init_mlp([8, 16, 3], seed=0).items()}
    return decode_frame(payload, shapes=shapes)
