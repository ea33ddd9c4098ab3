"""Weighted aggregation of device updates into one global delta."""

from __future__ import annotations

import numpy as np

from learning.model import Params
from ps_service.update import Update


def staleness_weight(staleness: int) -> float:
    """Discount for an update computed on a version ``staleness`` steps old (FedAsync's
    polynomial rule with exponent 1/2): fresh updates count fully, stale ones less, none zero."""
    return 1.0 / float(np.sqrt(1 + max(0, staleness)))


def aggregate(updates: list[Update], version: int) -> Params:
    """Sample-weighted mean of the deltas (FedAvg), each scaled by its staleness weight."""
    if not updates:
        raise ValueError("nothing to aggregate")
    total = sum(u.samples for u in updates)
    out = {name: np.zeros_like(values) for name, values in updates[0].delta.items()}
    for u in updates:
        weight = (u.samples / total) * staleness_weight(version - u.base_version)
        for name, values in u.delta.items():
            out[name] += np.float32(weight) * values
    return out
