"""Per-device balancing of push_every from each device's measured step rate (after ADSP).

Pure logic: commits and reports come in with their time, push_every values and the devices
a round need not wait for go out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Bounds:
    """The range push_every may move in."""

    low: int = 1
    high: int = 160

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"push_every bounds need 1 <= low <= high, got {self.low}..{self.high}")

    def clip(self, value: float) -> int:
        return int(min(self.high, max(self.low, round(value))))


@dataclass
class StepRate:
    """A device's local steps per second, smoothed over its commits."""

    ready_at: float | None = None  # when it could start training towards its next commit
    rate: float | None = None
    history: list[float] = field(default_factory=list)

    def commit(self, steps: int, now: float, smoothing: float = 0.5) -> None:
        if self.ready_at is not None and now > self.ready_at:
            sample = steps / (now - self.ready_at)
            self.rate = sample if self.rate is None else (1 - smoothing) * self.rate + smoothing * sample
        self.ready_at = now

    def to_state(self, now: float) -> dict[str, Any]:
        age = None if self.ready_at is None else now - self.ready_at
        return {"ready_age_s": age, "rate": self.rate, "history": list(self.history)}

    @classmethod
    def from_state(cls, state: dict[str, Any], now: float) -> StepRate:
        age = state["ready_age_s"]
        return cls(None if age is None else now - float(age), state["rate"], [float(x) for x in state["history"]])


class Balancer:
    """Per-device adjustment after ADSP: slow devices must not hold the barrier, fast devices
    must not be throttled. This base class balances nothing (every device gets the base
    push_every, the barrier waits for all); it measures each device's step rate, which the
    subclasses act on. A device's rate is what it reports (its timed steps, in its status),
    else what its commits show; until either is known it is treated as a fast one."""

    mode = "off"
    #: Whether a device's step rate can change what this balancer decides (push_every values, releases);
    #: if not, a speed report changes nothing and the server does not go over the fleet for it.
    reacts_to_speed = False

    def __init__(self) -> None:
        self.rates: dict[str, StepRate] = {}
        self.reported: dict[str, float] = {}  # steps per second, from the devices' own timing
        self.current: dict[str, int] = {}

    def on_commit(self, device: str, steps: int, now: float) -> None:
        """``device`` committed ``steps`` local steps at ``now``."""
        self._rate(device).commit(steps, now)

    def on_ready(self, device: str, now: float) -> None:
        """``device`` may train again from ``now`` (it was waiting for parameters)."""
        self._rate(device).ready_at = now

    def _rate(self, device: str) -> StepRate:
        """``device``'s measured rate, made when it has none (not setdefault: it would make one a call)."""
        rate = self.rates.get(device)
        if rate is None:
            rate = self.rates[device] = StepRate()
        return rate

    def on_report(self, device: str, step_s: float) -> None:
        """``device`` timed its local steps at ``step_s`` seconds each."""
        self.reported[device] = 1.0 / step_s

    def rate(self, device: str) -> float | None:
        """Steps per second: as the device reported it, else as measured from its commits."""
        if device in self.reported:
            return self.reported[device]
        return self.rates[device].rate if device in self.rates else None

    def forget(self, device: str) -> None:
        """``device`` went offline: what was measured of it goes."""
        self.rates.pop(device, None)
        self.reported.pop(device, None)
        self.current.pop(device, None)

    def assign(self, devices: list[str], base: int, bounds: Bounds) -> dict[str, int]:
        """push_every per device."""
        return dict.fromkeys(devices, base)

    def released(self, push_every: dict[str, int]) -> set[str]:
        """The devices the barrier should not wait for."""
        return set()

    def to_state(self, now: float) -> dict[str, Any]:
        return {
            "rates": {d: r.to_state(now) for d, r in sorted(self.rates.items())},
            "reported": dict(sorted(self.reported.items())),
            "current": dict(sorted(self.current.items())),
        }

    def load_state(self, state: dict[str, Any], now: float) -> None:
        self.rates = {str(d): StepRate.from_state(r, now) for d, r in state["rates"].items()}
        self.reported = {str(d): float(r) for d, r in state["reported"].items()}
        self.current = {str(d): int(c) for d, c in state["current"].items()}


#: Under ``steps`` balancing, the fastest rate the others are scaled against is taken among the rates
#: at most this many times the fleet's median: one device claiming to step in a microsecond cannot
#: cut every other device's push_every (it once took 10 to 1, commits 7.4 -> 48.6 a second).
SPREAD = 2.0


class StepsBalancer(Balancer):
    """``steps``: a device gets push_every in proportion to its step rate, so that the slowest
    commits as often as the fastest; the fastest keep the base value. The fastest is the fastest
    of the rates within ``SPREAD`` times the fleet's median (a faster claim gets the base value and
    changes no one else's). A value changes only when it moves by at least ``tolerance``
    (relative), so that measurement noise does not rewrite a control message every round."""

    mode = "steps"
    reacts_to_speed = True

    def __init__(self, tolerance: float = 0.25) -> None:
        super().__init__()
        self.tolerance = tolerance

    def assign(self, devices: list[str], base: int, bounds: Bounds) -> dict[str, int]:
        rates = [r for r in map(self.rate, devices) if r]
        median = float(np.median(rates)) if rates else 0.0
        fastest = max((r for r in rates if r <= SPREAD * median), default=None)
        out = {}
        for device in devices:
            rate = self.rate(device)
            wanted = base if not rate or not fastest else max(bounds.low, min(base, round(base * rate / fastest)))
            current = self.current.get(device)
            if current is None or abs(wanted - current) >= self.tolerance * current or wanted == base:
                current = wanted
            self.current[device] = current
            out[device] = current
        return out


class ReleaseBalancer(Balancer):
    """``release``: every device keeps the base push_every; a device expected to need more than
    ``factor`` times the median device's time for its next commit leaves the barrier (as if
    past the round deadline) and commits at its own pace, its commit joining the round open
    when it arrives, with its staleness weight. Fewer commits, and no short slow-device commits
    stretched to the round's step count by the aggregation."""

    mode = "release"
    reacts_to_speed = True

    def __init__(self, factor: float = 2.0) -> None:
        super().__init__()
        self.factor = factor

    def released(self, push_every: dict[str, int]) -> set[str]:
        expected = {d: p / rate for d, p in push_every.items() if (rate := self.rate(d))}
        if len(expected) < 2:
            return set()
        median = float(np.median(list(expected.values())))
        return {d for d, t in expected.items() if t > self.factor * median}


BALANCERS: dict[str, type[Balancer]] = {b.mode: b for b in (Balancer, StepsBalancer, ReleaseBalancer)}


def make_balancer(mode: str) -> Balancer:
    """``off``, ``steps`` or ``release``."""
    if mode not in BALANCERS:
        raise ValueError(f"unknown balance mode {mode!r}; known: {', '.join(BALANCERS)}")
    return BALANCERS[mode]()
