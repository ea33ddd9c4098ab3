"""What a sans-IO core has to say, kept for its driver to log: a core never logs itself.

Not part of the wire protocol; here because it is the lowest layer both cores share. Levels
are the standard logging levels' numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

INFO, WARNING, ERROR = 20, 30, 40


@dataclass(frozen=True)
class Event:
    level: int
    message: str


class Events:
    """A core's events since its driver last took them (bounded: the oldest go first)."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._items: list[Event] = []

    def _add(self, level: int, message: str, args: tuple[object, ...]) -> None:
        if len(self._items) >= self.LIMIT:
            del self._items[: self.LIMIT // 2]
        self._items.append(Event(level, message % args if args else message))

    def info(self, message: str, *args: object) -> None:
        self._add(INFO, message, args)

    def warning(self, message: str, *args: object) -> None:
        self._add(WARNING, message, args)

    def error(self, message: str, *args: object) -> None:
        self._add(ERROR, message, args)

    def take(self) -> list[Event]:
        """The events since the last call, oldest first."""
        items, self._items = self._items, []
        return items
