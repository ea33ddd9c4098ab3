"""Communication paces: when buffered updates become a new global version.

A Pace only buffers updates and decides; it never touches the model, the clock or MQTT.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ps_service.update import Update


class Pace(ABC):
    """Decides when the server aggregates and whether devices idle after committing.

    The server calls ``add`` for every accepted update, then ``ready`` with the set of
    active devices; when ready, ``take`` hands over the updates of one aggregate.
    """

    name: str
    #: Whether a device, after committing, waits for parameters newer than its commit's base.
    wait_for_params: bool

    def __init__(self) -> None:
        self._buffer: list[Update] = []

    def add(self, update: Update) -> None:
        """Buffer an accepted update."""
        self._buffer.append(update)

    def committed(self) -> list[str]:
        """Devices with a buffered update, sorted."""
        return sorted({u.device for u in self._buffer})

    def waiting_for(self, active: frozenset[str]) -> list[str]:
        """Active devices the next aggregate still waits for, sorted."""
        return sorted(active - set(self.committed()))

    @abstractmethod
    def ready(self, active: frozenset[str]) -> bool:
        """Whether the buffered updates should be aggregated now."""

    def take(self) -> list[Update]:
        """Hand over (and forget) the updates of one aggregate."""
        taken, self._buffer = self._buffer, []
        return taken

    @property
    def pending(self) -> int:
        return len(self._buffer)


class Bsp(Pace):
    """Bulk synchronous: a round closes when every active device has committed."""

    name = "bsp"
    wait_for_params = True

    def ready(self, active: frozenset[str]) -> bool:
        return bool(self._buffer) and not self.waiting_for(active)


class Asp(Pace):
    """Asynchronous: every update is applied on arrival, discounted by its staleness."""

    name = "asp"
    wait_for_params = False

    def ready(self, active: frozenset[str]) -> bool:
        return bool(self._buffer)

    def take(self) -> list[Update]:
        first, self._buffer = self._buffer[:1], self._buffer[1:]
        return first


PACES: dict[str, type[Pace]] = {p.name: p for p in (Bsp, Asp)}


def make_pace(name: str) -> Pace:
    """A new pace by name: ``bsp`` or ``asp``."""
    try:
        return PACES[name]()
    except KeyError:
        raise ValueError(f"unknown pace {name!r}; known: {sorted(PACES)}") from None
