"""How often devices commit: a fleet-wide ``push_every`` from the global model's evaluations,
and a per-device adjustment on top from each device's measured step rate.

Pure logic: evaluations and commits come in with their time, push_every values go out;
the server core turns changes into control messages.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ps_service.balance import Bounds as Bounds  # where the policies' users import it from
from ps_service.balance import make_balancer
from schemas.messages import FREQUENCY_POLICIES


class FrequencyPolicy(ABC):
    """Sets the fleet's base push_every (local steps per commit) from evaluations of the
    global model. ``observe`` is called once per evaluation, and is where the value moves;
    ``value`` only reads it."""

    name: str

    @abstractmethod
    def observe(self, now: float, score: float, loss: float, bounds: Bounds) -> None:
        """An evaluation of the global model at time ``now`` (seconds): the task's metric as a
        ``score`` (higher is better, 1 ideal: the accuracy itself, or 1 - error for an error metric;
        learning.metrics) and the loss. The value may move, within ``bounds``."""

    @abstractmethod
    def value(self, bounds: Bounds) -> int:
        """The base push_every now, within ``bounds``; reading it changes nothing."""

    @property
    def trend(self) -> float | None:
        """The policy's view of the accuracy trend, for metrics (None if it has none)."""
        return None

    def to_state(self) -> dict[str, Any]:
        """What the policy has learnt, for a checkpoint (JSON values)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - a policy that learns nothing keeps nothing
        """Take back what ``to_state`` gave."""


class Fixed(FrequencyPolicy):
    """push_every never changes."""

    name = "fixed"

    def __init__(self, push_every: int) -> None:
        self.push_every = push_every

    def observe(self, now: float, score: float, loss: float, bounds: Bounds) -> None:
        pass

    def value(self, bounds: Bounds) -> int:
        return bounds.clip(self.push_every)

    def to_state(self) -> dict[str, Any]:
        return {"push_every": self.push_every}

    def load_state(self, state: dict[str, Any]) -> None:
        self.push_every = int(state["push_every"])


class AdaComm(FrequencyPolicy):
    """After ADACOMM (Wang & Joshi, 2019): start with infrequent averaging, tau_0 = the upper
    bound, and shrink it as the loss falls: tau = ceil(sqrt(loss / loss_0) * tau_0)."""

    name = "adacomm"

    def __init__(self) -> None:
        self.initial_loss: float | None = None
        self.loss: float | None = None

    def observe(self, now: float, score: float, loss: float, bounds: Bounds) -> None:
        if not math.isfinite(loss):
            return
        if self.initial_loss is None:
            self.initial_loss = loss
        self.loss = loss

    def value(self, bounds: Bounds) -> int:
        if self.initial_loss is None or self.loss is None or self.initial_loss <= 0:
            return bounds.high
        return bounds.clip(math.ceil(math.sqrt(max(self.loss, 0.0) / self.initial_loss) * bounds.high))

    def to_state(self) -> dict[str, Any]:
        return {"initial_loss": self.initial_loss, "loss": self.loss}

    def load_state(self, state: dict[str, Any]) -> None:
        self.initial_loss, self.loss = state["initial_loss"], state["loss"]


class Trend(FrequencyPolicy):
    """The paper's policy: fit a line to the held-out score (accuracy, or 1 - error for a task whose
    metric is an error, where lower is better) over the last ``window`` evaluations
    and read how much of the remaining error it closes over that span (the *gain*). While the
    model improves fast (gain >= ``steep``) local work pays: commit rarely, push_every doubles.
    When it flattens (gain <= ``flat``) drift costs more than messages: push_every halves.
    Hysteresis: between the two thresholds nothing moves; a move needs ``patience``
    evaluations in a row agreeing; after a move the window restarts, so the next move is
    judged on evidence gathered at the new setting. Starts at ``start`` (default: the upper
    bound, where the first evaluations find the model improving fastest)."""

    name = "trend"

    def __init__(
        self,
        window: int = 3,
        steep: float = 0.3,
        flat: float = 0.1,
        patience: int = 1,
        start: int | None = None,
    ) -> None:
        if window < 2 or patience < 1 or not 0 <= flat < steep:
            raise ValueError("trend needs window >= 2, patience >= 1 and 0 <= flat < steep")
        self.window, self.steep, self.flat, self.patience = window, steep, flat, patience
        self.start = start
        self.points: list[tuple[float, float]] = []
        self.level: int | None = None  # the current push_every, once bounds are known
        self.votes = 0  # consecutive agreeing signals: > 0 towards up, < 0 towards down
        self._gain: float | None = None

    @property
    def trend(self) -> float | None:
        return self._gain

    def observe(self, now: float, score: float, loss: float, bounds: Bounds) -> None:
        if not math.isfinite(score):
            return
        self.points = [*self.points, (now, score)][-self.window :]
        self._gain = self.gain(self.points)
        if self._gain is not None:
            signal = 1 if self._gain >= self.steep else -1 if self._gain <= self.flat else 0
            self.votes = 0 if signal == 0 else self.votes + signal if self.votes * signal > 0 else signal
        self._move(bounds)

    def _move(self, bounds: Bounds) -> None:
        """Double or halve the level when the window is full and enough evaluations agree."""
        level = self.value(bounds)
        if len(self.points) >= self.window and abs(self.votes) >= self.patience:
            moved = bounds.clip(level * 2 if self.votes > 0 else math.ceil(level / 2))
            if moved != level:
                level = moved
                self.points = self.points[-1:]  # judge the new setting on its own evidence
            self.votes = 0
        self.level = level

    @staticmethod
    def gain(points: list[tuple[float, float]]) -> float | None:
        """Share of the remaining error (1 - score) that the fitted line closes over the
        span of ``points``; None for fewer than 2 points or no elapsed time."""
        if len(points) < 2:
            return None
        t = np.array([p[0] for p in points])
        a = np.array([p[1] for p in points])
        span = float(t[-1] - t[0])
        if span <= 0:
            return None
        slope = float(np.polyfit(t - t[0], a, 1)[0])
        return slope * span / max(1.0 - float(a.mean()), 0.01)

    def value(self, bounds: Bounds) -> int:
        level = self.level if self.level is not None else self.start if self.start is not None else bounds.high
        return bounds.clip(level)

    def to_state(self) -> dict[str, Any]:
        return {"points": [list(p) for p in self.points], "level": self.level, "votes": self.votes, "gain": self._gain}

    def load_state(self, state: dict[str, Any]) -> None:
        self.points = [(float(t), float(a)) for t, a in state["points"]]
        self.level, self.votes, self._gain = state["level"], int(state["votes"]), state["gain"]


POLICIES = FREQUENCY_POLICIES


def make_policy(name: str, push_every: int) -> FrequencyPolicy:
    """``fixed`` (at ``push_every``), ``adacomm`` or ``trend``."""
    if name == "fixed":
        return Fixed(push_every)
    if name == "adacomm":
        return AdaComm()
    if name == "trend":
        return Trend()
    raise ValueError(f"unknown frequency policy {name!r}; known: {', '.join(POLICIES)}")


class FrequencyController:
    """The policy, the bounds, the per-device balancing and the operator's levers together."""

    def __init__(self, policy: FrequencyPolicy, bounds: Bounds, balance: str = "off") -> None:
        self.policy, self.bounds = policy, bounds
        self.balancer = make_balancer(balance)
        self.frozen: int | None = None  # the base push_every an operator froze
        self.assigned: dict[str, int] = {}
        self.changes = 0  # counts writes to ``assigned`` (for caches of what devices were told)

    def observe(self, now: float, score: float, loss: float) -> None:
        """An evaluation of the global model: the policy may move the base value."""
        self.policy.observe(now, score, loss, self.bounds)

    @property
    def base(self) -> int:
        return self.frozen if self.frozen is not None else self.policy.value(self.bounds)

    def freeze(self) -> None:
        self.frozen = self.base

    def unfreeze(self) -> None:
        self.frozen = None

    def set_bounds(self, low: int | None, high: int | None) -> None:
        self.bounds = Bounds(self.bounds.low if low is None else low, self.bounds.high if high is None else high)
        if self.frozen is not None:
            self.frozen = self.bounds.clip(self.frozen)

    def set_policy(self, policy: FrequencyPolicy) -> None:
        self.policy = policy

    def push_every(self, device: str) -> int:
        """The push_every ``device`` was told (the base value for one not told yet)."""
        told = self.assigned.get(device)
        return self.base if told is None else told  # the base only when needed: asked for every device often

    def tell(self, device: str) -> int:
        """The push_every to tell ``device`` in a control message, remembered as told."""
        value = self.push_every(device)
        if self.assigned.get(device) != value:
            self.assigned[device] = value
            self.changes += 1
        return value

    def assign(self, devices: list[str]) -> dict[str, int]:
        """push_every per device; also remembered in ``assigned``."""
        self.assigned = self.balancer.assign(devices, self.base, self.bounds)
        self.changes += 1
        return dict(self.assigned)

    def released(self, devices: list[str]) -> set[str]:
        """Devices the round should not wait for (``release`` balancing)."""
        return self.balancer.released({d: self.push_every(d) for d in devices})

    def forget(self, device: str) -> None:
        """``device`` went offline: it starts afresh when it returns."""
        self.balancer.forget(device)
        if self.assigned.pop(device, None) is not None:
            self.changes += 1

    def to_state(self, now: float) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "policy_state": self.policy.to_state(),
            "bounds": [self.bounds.low, self.bounds.high],
            "frozen": self.frozen,
            "assigned": dict(sorted(self.assigned.items())),
            "balancer": self.balancer.to_state(now),
        }

    def load_state(self, state: dict[str, Any], now: float, push_every: int) -> None:
        """Take back ``to_state``'s dict; ``push_every``: the job's, for a fixed policy set by an operator."""
        self.policy = make_policy(str(state["policy"]), push_every)
        self.policy.load_state(state["policy_state"])
        self.bounds = Bounds(*(int(b) for b in state["bounds"]))
        self.frozen = state["frozen"]
        self.assigned = {str(d): int(p) for d, p in state["assigned"].items()}
        self.changes += 1
        self.balancer.load_state(state["balancer"], now)
