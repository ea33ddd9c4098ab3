"""Bounds on what one device can do to the model: its weight and the size of its contribution.

The server cannot check what a device says about itself (how many samples it holds, how many
steps it made, what its update is), only compare it with the rest of the fleet. Two bounds,
applied to every aggregate before the FedNova average (ps_service.aggregate):

* **weight**: a device's data size counts at most ``size_factor`` times the median of the sizes
  the job's devices declared (and at most ``max_samples``, when the operator sets a ceiling), so
  one device claiming a billion samples cannot drown the others;
* **contribution**: a device's mean per-step update (its commits' sum over its steps, the d_i of
  FedNova) is scaled down to at most ``norm_factor`` times the median of the other devices' recent
  per-step norms. With no other device to compare with yet, at most ``model_fraction`` of the
  model's own norm per step. A commit of 1e30 then moves the model as far as an ordinary one.

Measured on the default pace scenario (docs/OPERATIONS.md): honest per-step norms stay within
6.6x the median of the others (acbsp; bsp 1.5x, asp 4.3x) and within 1.4% of the model's norm.

Pure logic: numbers in, scales out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def bounded_sizes(
    claimed: dict[str, int], reference: list[int], factor: float, ceiling: int | None = None
) -> dict[str, int]:
    """Each device's data size for weighting: what it ``claimed``, at most ``factor`` times the
    median of ``reference`` (the sizes the job's devices declared) and at most ``ceiling``."""
    cap = float(ceiling) if ceiling is not None else math.inf
    if reference:
        cap = min(cap, factor * float(np.median(reference)))
    return {device: max(1, int(min(float(size), cap))) for device, size in claimed.items()}


@dataclass
class NormBound:
    """Clips each device's per-step update against the fleet's recent per-step norms.

    ``recent`` keeps each device's last per-step norm *after* clipping and at most its reference,
    with the version it was seen at, so that a device cannot ratchet the reference up; entries
    older than ``memory`` versions are forgotten."""

    factor: float = 8.0
    model_fraction: float = 0.05
    memory: int = 50
    recent: dict[str, tuple[float, int]] = field(default_factory=dict)

    def scales(self, norms: dict[str, float], version: int, model_norm: float) -> dict[str, float]:
        """The factor (at most 1) each device's per-step update is multiplied by, for per-step
        ``norms`` of the devices in one aggregate made at ``version``."""
        fresh = {d: n for d, (n, seen) in self.recent.items() if version - seen <= self.memory}
        out: dict[str, float] = {}
        remembered: dict[str, float] = {}
        for device, norm in norms.items():
            others = [n for d, n in fresh.items() if d != device and d not in norms]
            others += [n for d, n in norms.items() if d != device]
            if others:
                reference = float(np.median(others))
                limit = self.factor * reference
            else:
                reference = limit = self.model_fraction * model_norm if model_norm > 0 else math.inf
            scale = 1.0 if not norm > limit else limit / norm
            out[device] = scale
            remembered[device] = min(norm * scale, reference)
        for device, norm in remembered.items():
            self.recent[device] = (norm, version)
        return out

    def to_state(self) -> dict[str, Any]:
        return {"recent": {d: [n, v] for d, (n, v) in sorted(self.recent.items())}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.recent = {str(d): (float(n), int(v)) for d, (n, v) in state["recent"].items()}
