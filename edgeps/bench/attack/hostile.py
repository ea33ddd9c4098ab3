"""The hostile device: within its ACL, it does what the audit did (floods, replays, lies about its
data, oversized and malformed frames, ...), one attack a job."""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from edgeps.bench.attack.deployments import HOSTILE, JOB, Deployment
from schemas.messages import MAX_SAFE_INT


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
