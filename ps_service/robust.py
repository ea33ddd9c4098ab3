"""Bounds on what one device can do to the model: its weight and the size of its contribution.

The server cannot check what a device says about itself (how many samples it holds, how many
steps it made, what its update is), only compare it with the rest of the fleet. Two bounds,
applied to every aggregate before the FedNova average (ps_service.aggregate):

* **weight**: a device's data size counts at most ``size_factor`` times the median of the sizes
  the job's devices declared (and at most ``max_samples``, when the operator sets a ceiling), so
  one device claiming a billion samples cannot drown the others;
* **contribution**: a device whose mean per-step update (FedNova's d_i: its commits' sum over its
  steps) is more than ``factor`` (8) times the median of the fleet's per-step norms (this
  aggregate's and the recent ones), or less than a sixteenth of it, is left out of the aggregate
  (refused as ``outlier``; ``NormBound.outliers`` says how two norms are told apart). With no
  other device to compare with yet, more than ``model_fraction`` of the model's own norm per step
  is. A commit of 1e30 (or fp16's largest value everywhere, or a commit of zeros) then changes
  nothing: refusing, not clipping to the bound, is what keeps a device that does so every round
  from dragging the model (docs/OPERATIONS.md gives the measurements, and the range of honest
  per-step norms the bounds leave room for).

Pure logic: updates and numbers in, sets out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ps_service.aggregate import staleness_weight
from ps_service.update import Update


def bounded_sizes(
    claimed: dict[str, int], reference: list[int], factor: float, ceiling: int | None = None
) -> dict[str, int]:
    """Each device's data size for weighting: what it ``claimed``, at most ``factor`` times the
    median of ``reference`` (the sizes the job's devices declared) and at most ``ceiling``."""
    cap = float(ceiling) if ceiling is not None else math.inf
    if reference:
        cap = min(cap, factor * float(statistics.median(reference)))  # per commit: no numpy call for a few numbers
    return {device: max(1, int(min(float(size), cap))) for device, size in claimed.items()}


def data_sizes(updates: list[Update], declared: dict[str, int], factor: float, ceiling: int | None) -> dict[str, int]:
    """The data size each device of an aggregate is weighted by: what it ``declared`` (else the
    samples its commits consumed), bounded against the median of the declared sizes (``bounded_sizes``)."""
    claimed = {u.device: declared.get(u.device) or 0 for u in updates}
    for u in updates:
        if not declared.get(u.device):
            claimed[u.device] += u.samples
    reference = [size for size in declared.values() if size > 0]
    return bounded_sizes(claimed, reference, factor, ceiling)


@dataclass
class NormBound:
    """Refuses the per-step updates far from the fleet's recent per-step norms (``outliers``).

    ``recent`` keeps each device's last per-step norm that was applied, with the version it was
    seen at (entries older than ``memory`` versions are forgotten), so that a refused device
    never moves the reference."""

    factor: float = 8.0
    model_fraction: float = 0.5
    memory: int = 50
    recent: dict[str, tuple[float, int]] = field(default_factory=dict)

    def outliers(self, updates: list[Update], version: int, model_norm: float) -> set[str]:
        """The devices of one aggregate made at ``version`` whose mean per-step update (their
        commits' staleness-weighted sum over their steps, in double precision) is out of line
        with the fleet's: this aggregate's norms and the recent ones of devices not in it.

        * Too large: above ``factor`` times the lower median of the positive norms (with two
          norms, the smaller: of two that disagree, the larger is refused, the one that could
          do harm).
        * Too small: below 1 / (2 ``factor``) of the upper median, where there are three norms
          or more to tell who is out of line (a small update only slows the others down).
        * Alone: compared with its own last update; with nothing at all to compare with yet (the
          job's first update), above ``model_fraction`` of the model's norm.

        The norms of the devices kept are remembered."""
        norms = per_step_norms(updates, version)
        recent = {d: n for d, (n, seen) in self.recent.items() if version - seen <= self.memory}
        fresh = [n for d, n in recent.items() if d not in norms]
        if not fresh and len(norms) == 1:  # a device alone: compared with its own last update
            fresh = list(recent.values())
        values = sorted([*norms.values(), *fresh])
        positive = [v for v in values if v > 0]
        if len(values) == 1:
            above = self.model_fraction * model_norm if model_norm > 0 else math.inf
            below = 0.0
        else:
            low = positive[(len(positive) - 1) // 2] if positive else 0.0
            above = self.factor * low if low > 0 else math.inf
            below = values[len(values) // 2] / (2 * self.factor) if len(values) >= 3 else 0.0
        refused = {device for device, norm in norms.items() if norm > above or norm < below}
        for device, norm in norms.items():
            if device not in refused:
                self.recent[device] = (norm, version)
        return refused

    def to_state(self) -> dict[str, Any]:
        return {"recent": {d: [n, v] for d, (n, v) in sorted(self.recent.items())}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.recent = {str(d): (float(n), int(v)) for d, (n, v) in state["recent"].items()}


def per_step_norms(updates: list[Update], version: int) -> dict[str, float]:
    """Each device's |sum of its staleness-weighted commits| / its steps: the norm of FedNova's d_i."""
    sums: dict[str, dict[str, np.ndarray]] = {}
    steps: dict[str, int] = {}
    for u in updates:
        weight = staleness_weight(version - u.base_version)
        weighted = {name: weight * values.astype(np.float64) for name, values in u.delta.items()}
        if u.device in sums:
            for name, values in weighted.items():
                sums[u.device][name] += values
        else:  # a device's first commit of the aggregate (all of them under asp): no zeros to add it to
            sums[u.device] = weighted
        steps[u.device] = steps.get(u.device, 0) + u.steps
    return {
        device: float(np.sqrt(sum(float(np.vdot(v, v)) for v in delta.values()))) / steps[device]
        for device, delta in sums.items()
    }
