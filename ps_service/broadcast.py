"""How each new version reaches the devices: full snapshots, or compressed deltas without drift.

With a lossy pull codec the server keeps the *broadcast view* B: exactly what every device
holds. A broadcast sends D = decode(encode(x - B)) and sets B = B + D, the same float32
addition each device performs, so every replica of version v is bit-identical to B_v.
What the codec dropped stays in x - B and goes out with the next delta (server-side
error feedback). The full snapshot of B is kept retained for devices that join late or
notice a gap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from learning.model import Params
from ps_service.store import ParameterStore
from schemas.codecs import make_codec, typical_error
from schemas.frame import Frame, FrameKind, decode_frame, encode_frame
from schemas.topics import Publish, Topics


def pull_shrink(spec: str) -> float:
    """The share of the pending change a noisy unbiased pull codec is asked to send. The server's
    error feedback keeps ``r' = v - Q(g v)`` of the change v; with g = 1 its size is about e |v|
    for the codec's typical relative error e, which grows without bound where e > 1. With
    g = 1 / (1 + e^2) it is e / sqrt(1 + e^2) |v| < |v|: what is held back goes out with the next
    delta. Devices decode as ever. Codecs with e <= 1, and the biased ones (whose error is below
    |v| by construction), send everything: 1 (measured in docs/CODECS.md)."""
    codec = make_codec(spec)
    error = 0.0 if codec.biased or codec.name == "fp32" else typical_error(spec)
    return 1.0 if error <= 1.0 else 1.0 / (1.0 + error**2)


class Broadcaster:
    """Turns the store's current version into the messages devices receive."""

    def __init__(self, topics: Topics, pull_codec: str = "fp32", seed: int = 0, run: int = 0) -> None:
        self.topics = topics
        self.run = run  # stamped on every snapshot (its seq field)
        self.codec = make_codec(pull_codec).spec
        self.deltas = self.codec != "fp32"
        self.shrink = pull_shrink(self.codec)
        self.view: Params | None = None
        self.view_version = -1
        self.snapshot = b""
        self._rng = np.random.default_rng(seed)

    def publish(self, store: ParameterStore) -> tuple[list[Publish], int]:
        """The messages for the store's current version, and the bytes each device receives."""
        if not self.deltas:
            self.snapshot = store.snapshot_frame(self.run)
            return [Publish(self.topics.params, self.snapshot, qos=1, retain=True)], len(self.snapshot)
        out = []
        per_device = 0
        if self.view is None:
            self.view = store.params()
        else:
            x = store.view()
            change = {name: x[name] - self.view[name] for name in x}
            if self.shrink != 1.0:
                change = {name: np.float32(self.shrink) * values for name, values in change.items()}
            frame = Frame(
                kind=FrameKind.DELTA,
                base_version=store.version,
                seq=self.view_version,
                tensors=change,
                codec=self.codec,
            )
            payload = encode_frame(frame, self._rng)
            sent = decode_frame(payload).tensors  # exactly what the devices will add
            self.view = {name: self.view[name] + sent[name] for name in self.view}
            out.append(Publish(self.topics.delta, payload, qos=1))
            per_device = len(payload)
        self.view_version = store.version
        self.snapshot = self._snapshot()
        out.append(Publish(self.topics.params, self.snapshot, qos=1, retain=True))
        return out, per_device or len(self.snapshot)

    def _snapshot(self) -> bytes:
        assert self.view is not None
        return encode_frame(
            Frame(kind=FrameKind.PARAMS, base_version=self.view_version, seq=self.run, tensors=self.view)
        )

    def to_state(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "view": self.view,
            "view_version": self.view_version,
            "rng": self._rng.bit_generator.state,
        }

    def load_state(self, state: dict[str, Any], store: ParameterStore) -> None:
        """Restore what ``to_state`` saved; the snapshot is encoded again (bit for bit the same)."""
        if state["codec"] != self.codec:
            raise ValueError(f"the broadcast view was kept for pull codec {state['codec']}, not {self.codec}")
        self.view = None if state["view"] is None else {k: np.asarray(v, np.float32) for k, v in state["view"].items()}
        self.view_version = int(state["view_version"])
        self._rng.bit_generator.state = state["rng"]
        if not self.deltas:
            self.snapshot = store.snapshot_frame(self.run)
        elif self.view is not None:
            self.snapshot = self._snapshot()
