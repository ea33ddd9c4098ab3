"""What the simulator runs and what it measures: a ``Scenario`` (the job's options and the simulated
fleet: devices, slow ones, their links, sites, non-IID data) and a run's ``RunResult`` (time to
target, best, final and plateau accuracy, idle share, commits and bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from edge_client.profile import DeviceProfile
from edgeps.options import nest_fields
from ps_service.config import ServerConfig
from schemas.messages import Metrics

#: The job of every scenario unless it says otherwise: versions without end (a run lasts
#: ``duration_s``), a 5 s round deadline.
SCENARIO_SERVER = ServerConfig(job="sim", rounds=10**9, round_deadline_s=5.0)


class Scenario(BaseModel):
    """A fleet, its data and its training settings (``server``, a job's ServerConfig): what every
    pace is compared on. The job's fields may be given flat (``Scenario(push_every=20)``); they go
    into ``server``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerConfig = SCENARIO_SERVER

    devices: int = Field(16, ge=1)
    slow_fraction: float = Field(0.25, ge=0, le=1, description="share of devices that are slower")
    slowdown: float = Field(4.0, ge=1, description="compute slowdown of the slow devices")
    step_s: float = Field(0.01, gt=0, description="reference seconds per local step")
    up_bps: float = Field(2e6, gt=0)
    down_bps: float = Field(2e6, gt=0)
    latency_s: float = Field(0.02, ge=0)
    sites: int = Field(0, ge=0, description="sites the devices are spread over, each with its aggregator (0: none)")
    site_up_bps: float = Field(10e6, gt=0, description="each site's uplink to the core")
    site_latency_s: float = Field(0.02, ge=0, description="between a site and the core, each way")
    site_flush_s: float = Field(1.0, gt=0, description="the aggregators' flush_s")
    alpha: float = Field(0.5, gt=0, description="Dirichlet non-IID concentration")
    holdout: float = Field(0.2, gt=0, lt=1)
    hidden: tuple[int, ...] = (64,)
    duration_s: float = Field(30.0, gt=0, description="virtual seconds of training per run")
    target: float = Field(0.90, gt=0, le=1, description="accuracy whose first crossing times a run")
    sample_s: float = Field(
        0.25, gt=0, description="virtual seconds between accuracy samples (the same grid for every pace)"
    )
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _job_fields_into_server(cls, data: Any) -> Any:
        """Flat job fields (``push_every=20``) become ``server``'s."""
        return nest_fields(data, cls, "server", ServerConfig, SCENARIO_SERVER)

    def slow_devices(self) -> set[int]:
        """Indices of the slow devices: a seeded choice of round(slow_fraction * devices)."""
        count = round(self.slow_fraction * self.devices)
        return set(np.random.default_rng(self.seed).permutation(self.devices)[:count].tolist())

    def profiles(self) -> list[DeviceProfile]:
        slow = self.slow_devices()
        return [
            DeviceProfile(
                slowdown=self.slowdown if i in slow else 1.0,
                step_s=self.step_s,
                up_bps=self.up_bps,
                down_bps=self.down_bps,
                latency_s=self.latency_s,
            )
            for i in range(self.devices)
        ]


def plateau(accuracies: list[float]) -> float:
    """Mean over the last fifth of a run's accuracies: where a pace settles, free of one lucky sample."""
    tail = accuracies[-max(1, len(accuracies) // 5) :]
    return sum(tail) / len(tail)


@dataclass
class RunResult:
    """What one simulated run measured."""

    pace: str
    history: list[Metrics]
    idle_fraction: float
    commits: int
    bytes_up: int
    bytes_down: int
    run_s: float  # seconds the run lasted (virtual or wall)
    target: float
    #: (virtual seconds, held-out accuracy of the server's model) on the scenario's sampling grid.
    curve: list[tuple[float, float]] = field(default_factory=list)
    #: On the same grid: (commits received, bytes up + down, mean push_every of the online devices).
    traffic: list[tuple[int, int, float]] = field(default_factory=list)

    def at_target(self) -> tuple[int, int] | None:
        """(commits, bytes) by the first sample at the target accuracy; None if never reached."""
        samples = zip(self.curve, self.traffic, strict=True)
        return next(((c, b) for (_, a), (c, b, _) in samples if a >= self.target), None)

    @property
    def best_accuracy(self) -> float:
        return max(a for _, a in self.curve)

    def best_within(self, commits: int) -> float:
        """The best accuracy sampled while the server had received at most ``commits`` commits: paces
        compared at the same number of commits rather than the same time."""
        samples = zip(self.curve, self.traffic, strict=True)
        return max((a for (_, a), (c, _, _) in samples if c <= commits), default=self.curve[0][1])

    @property
    def final_accuracy(self) -> float:
        return self.curve[-1][1]

    @property
    def plateau_accuracy(self) -> float:
        return plateau([a for _, a in self.curve])

    @property
    def time_to_target(self) -> float | None:
        return next((t for t, a in self.curve if a >= self.target), None)

    @property
    def lowest_after_target(self) -> float | None:
        """The lowest sample after the first one at the target: how far the model fell back."""
        reached = self.time_to_target
        return None if reached is None else min(a for t, a in self.curve if t >= reached)

    def summary(self) -> dict[str, Any]:
        low = self.lowest_after_target
        return {
            "pace": self.pace,
            "time_to_target": self.time_to_target,
            "best_accuracy": round(self.best_accuracy, 4),
            "final_accuracy": round(self.final_accuracy, 4),
            "plateau_accuracy": round(self.plateau_accuracy, 4),
            "lowest_after_target": None if low is None else round(low, 4),
            "idle_fraction": round(self.idle_fraction, 4),
            "commits": self.commits,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "versions": self.history[-1].version,
        }
