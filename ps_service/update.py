"""A validated commit from one device, as the pure server logic sees it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from learning.model import Params


@dataclass(frozen=True)
class Update:
    """The change a device proposes: ``delta`` = its local parameters minus version ``base_version``."""

    device: str
    seq: int
    base_version: int
    samples: int
    steps: int
    delta: Params

    def to_state(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "seq": self.seq,
            "base_version": self.base_version,
            "samples": self.samples,
            "steps": self.steps,
            "delta": self.delta,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Update:
        delta = {str(name): np.asarray(values, np.float32) for name, values in state["delta"].items()}
        return cls(str(state["device"]), int(state["seq"]), int(state["base_version"]), int(state["samples"]),
                   int(state["steps"]), delta)  # fmt: skip
