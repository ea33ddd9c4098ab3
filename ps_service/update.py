"""A validated commit from one device, as the pure server logic sees it."""

from __future__ import annotations

from dataclasses import dataclass

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
