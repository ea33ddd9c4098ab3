"""What a site knows of its job: read off the server's broadcasts (parameters, deltas, the barrier,
each device's control), following the job's newest run."""

from __future__ import annotations

import math

from ps_service.site.sums import first_bound
from schemas.frame import FrameKind, parse_frame
from schemas.messages import Barrier, Control


class JobView:
    """The job as the site's broker shows it: the version and run, the model's shapes and newest
    snapshot, each device's accepted codecs, and what the barrier says (who left, finished, who
    committed, the server's bounds). ``on_*`` return the id of a run that began, else None."""

    def __init__(self) -> None:
        self.version = 0
        self.run: int | None = None  # the job's run the version belongs to (its parameters' and barrier's)
        self.ended_runs: set[int] = set()  # runs a newer one replaced: their retained messages are ignored
        self.shapes: dict[str, tuple[int, ...]] | None = None
        self.snapshot: bytes | None = None  # the newest parameters (their norm: the bound before the barrier's)
        self.codecs: dict[str, frozenset[str]] = {}  # each device's accepted codecs, from its control
        self.left: frozenset[str] = frozenset()
        self.finished = False  # the barrier said the job has finished: commits are refused here
        self.committed: tuple[int, frozenset[str]] = (-1, frozenset())  # the barrier's version and committed
        self.max_norm: float | None = None  # the server's bounds, from the barrier
        self.max_weight: float | None = None

    def bounds(self) -> tuple[float, float]:
        """(the per-step norm each device's update is clipped to, the most data size it is weighted
        by): the barrier's, else, before the server said, half the model's norm and no cap."""
        max_norm = self.max_norm if self.max_norm is not None else first_bound(self.snapshot)
        return max_norm, self.max_weight or math.inf

    def on_control(self, device: str, control: Control) -> None:
        self.codecs[device] = frozenset({control.codec, *self.codecs.get(device, ())})

    def on_barrier(self, barrier: Barrier) -> int | None:
        followed, new_run = self._follow(barrier.run, barrier.version)
        if followed:
            self.left, self.finished = frozenset(barrier.left), barrier.state == "finished"
            self.committed = (barrier.version, frozenset(barrier.committed))
            self.max_norm, self.max_weight = barrier.max_norm, barrier.max_weight
        return new_run

    def on_params(self, payload: bytes) -> int | None:
        raw = parse_frame(payload)
        if raw.kind == FrameKind.PARAMS:  # a snapshot's seq: its run
            followed, new_run = self._follow(raw.seq, raw.base_version)
            if followed:
                self.shapes, self.snapshot = raw.shapes, payload
            return new_run
        if raw.kind == FrameKind.DELTA and self.run is not None:  # deltas follow the run's snapshot
            self.version = max(self.version, raw.base_version)
        return None

    def _follow(self, run: int, version: int) -> tuple[bool, int | None]:
        """Take ``version`` of ``run`` as known: (False for a run that ended: a retained message a
        site broker kept from an earlier run of the job; ``run`` if it is a new one replacing
        another). A new run starts again from its own version."""
        if run in self.ended_runs:
            return False, None
        new_run = None
        if run != self.run:
            if self.run is not None:
                self.ended_runs.add(self.run)
                new_run = run
            self.run, self.version = run, version
        self.version = max(self.version, version)
        return True, new_run
