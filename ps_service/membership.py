"""Who a round waits for: the online devices, less those that ``left`` the barrier.

A device leaves when a round's deadline passes without its commit, or when release balancing
lets it go. Its commits still count, as a late device's (with their staleness weight); it
takes its place again by keeping up: commits based on the newest version, or the one before
(``on_time``). A device that keeps missing deadlines is trusted less each time (after FedBuff's
and ADSP's treatment of stragglers, and against a device that rejoins just after each deadline
to hold every next round up):

* each missed deadline is a *strike*; with s strikes a device rejoins after 2^(s-1) on-time
  commits in a row (at most ``MAX_REJOIN``), and every 2^s on-time commits in the barrier take
  one strike away;
* while a device with strikes is waited for, the round's deadline shrinks to ``PROBATION`` times
  the median duration of the last rounds that closed without a missed deadline (at least
  ``PROBATION_FLOOR_S``, at most the job's deadline), so that the wait it can cause is about a
  round, not the job's whole deadline.

Pure logic: device ids and durations in, sets out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_REJOIN = 64
PROBATION = 4.0
PROBATION_FLOOR_S = 0.25
ROUNDS_REMEMBERED = 16


@dataclass
class Standing:
    strikes: int = 0  # deadlines missed, less those worked off
    streak: int = 0  # on-time commits in a row: towards rejoining (while left) or towards a strike less


class Membership:
    """The devices that left the barrier, each device's standing, and recent round durations."""

    def __init__(self) -> None:
        self.left: set[str] = set()
        self.standing: dict[str, Standing] = {}
        self.durations: deque[float] = deque(maxlen=ROUNDS_REMEMBERED)
        self._missed = False  # a deadline passed in the open round: its duration is not typical

    def barrier(self, online: frozenset[str]) -> frozenset[str]:
        """The devices the next aggregate waits for (``online`` itself while none left: asked several
        times a commit, it costs nothing then, not O(fleet))."""
        return online - self.left if self.left else online

    def missed(self, devices: list[str]) -> None:
        """``devices`` let a round's deadline pass: they leave, with a strike each."""
        self._missed = self._missed or bool(devices)
        for device in devices:
            standing = self._standing(device)
            standing.strikes += 1
            standing.streak = 0
            self.left.add(device)

    def _standing(self, device: str) -> Standing:
        """``device``'s standing, made when it has none (not setdefault: it would make one a call)."""
        standing = self.standing.get(device)
        if standing is None:
            standing = self.standing[device] = Standing()
        return standing

    def release(self, devices: set[str]) -> None:
        """Release balancing lets ``devices`` go (no strike: they are slow, not failing)."""
        self.left.update(devices)

    def rejoin_after(self, device: str) -> int:
        """On-time commits in a row that ``device`` needs to take its place again."""
        strikes = self.standing[device].strikes if device in self.standing else 0
        return 1 if strikes == 0 else min(MAX_REJOIN, 2 ** (strikes - 1))

    def on_commit(self, device: str, staleness: int) -> bool:
        """``device`` committed, based ``staleness`` versions back; True if it takes its place again.
        A device without strikes rejoins with any commit."""
        standing = self._standing(device)
        on_time = staleness <= 1
        standing.streak = standing.streak + 1 if on_time else 0
        if device in self.left:
            if standing.strikes == 0 or standing.streak >= self.rejoin_after(device):
                self.left.discard(device)
                standing.streak = 0
                return True
            return False
        if standing.strikes and standing.streak >= 2**standing.strikes:
            standing.strikes -= 1
            standing.streak = 0
        return False

    def forget(self, device: str) -> None:
        """``device`` went offline: it is not in the barrier at all. If it had left the barrier, it
        stays left, and its strikes stay: a device that comes back online takes its place again only
        by committing on time, so that going offline and online again does not make the next round
        wait for it (a flapping device once cut a bsp job from 4.5 to 1.18 versions/s)."""

    def round_closed(self, duration: float) -> None:
        """A round closed after ``duration`` seconds; remembered if no deadline passed in it."""
        if duration >= 0 and not self._missed:
            self.durations.append(duration)
        self._missed = False

    def deadline(self, waited_for: list[str], configured: float) -> float:
        """How long this round waits for ``waited_for``: the job's deadline, or a probation one
        when any of them has strikes."""
        if not any(self.standing.get(d, Standing()).strikes for d in waited_for) or not self.durations:
            return configured
        typical = float(np.median(list(self.durations)))
        return min(configured, max(PROBATION_FLOOR_S, PROBATION * typical))

    def to_state(self) -> dict[str, Any]:
        return {
            "left": sorted(self.left),
            "standing": {d: [s.strikes, s.streak] for d, s in sorted(self.standing.items())},
            "durations": list(self.durations),
            "missed": self._missed,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.left = {str(d) for d in state["left"]}
        self.standing = {str(d): Standing(int(a), int(b)) for d, (a, b) in state["standing"].items()}
        self.durations = deque((float(x) for x in state["durations"]), maxlen=ROUNDS_REMEMBERED)
        self._missed = bool(state["missed"])
