"""The job's lifecycle and its open round: state, quorum, clock, deadlines and the devices a
round stops waiting for (late past its deadline, or released as much slower than the rest).

``Round`` is pure state; ``ps_service.server.job`` and ``ps_service.server.core`` apply its rules to a job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from ps_service.membership import Membership


class JobState(StrEnum):
    """Where a job is in its life, as Barrier.state and a status reply name it.

    running --pause--> paused --resume--> running; either --finish/last version/duration-->
    finished, which is final. Aggregation also waits for the start quorum (``Round.quorum``),
    which an operator may pause before."""

    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass
class Round:
    """The job's state and clock. ``started``: when the job's clock started (the quorum; the
    server's start before it); ``opened``: when the open round started. Times are the core's."""

    state: JobState = JobState.RUNNING
    quorum: bool = False
    started: float = 0.0
    opened: float = 0.0

    @property
    def finished(self) -> bool:
        return self.state is JobState.FINISHED

    @property
    def aggregating(self) -> bool:
        """Whether buffered updates may become versions now: quorum reached, running."""
        return self.quorum and self.state is JobState.RUNNING

    def reach_quorum(self, now: float) -> None:
        """The start quorum is online: the job's clock and its first round start now."""
        self.quorum = True
        self.started = self.opened = now

    def late(self, waiting: Iterable[str], membership: Membership, deadline_s: float, now: float) -> list[str]:
        """Devices of ``waiting`` (sorted) that let the open round's deadline pass by ``now``."""
        waited = now - self.opened
        return [d for d in waiting if waited >= membership.deadline([d], deadline_s)]

    def due(self, waiting: Iterable[str], membership: Membership, deadline_s: float) -> float | None:
        """When the first of ``waiting`` becomes late (None: nobody waited for)."""
        deadlines = [membership.deadline([d], deadline_s) for d in waiting]
        return self.opened + min(deadlines) if deadlines else None
