"""The Pace interface and the registry every pace joins.

A Pace decides when buffered updates become a new global version and what it asks of
devices between commits; it never touches the model, the clock or MQTT. The server passes
it the *barrier set*: the online devices that have not been dropped past a round deadline.
A new pace is one module of this package with a ``@register``-ed subclass, imported by the
package's ``__init__``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from ps_service.aggregate import Aggregate, Clip, aggregate_all
from ps_service.update import Contribution, Update


@dataclass(frozen=True)
class DeviceRules:
    """What a pace asks of a device, sent in its Control (docs/PROTOCOL.md)."""

    wait_for_params: bool = False  # after a commit, idle until parameters newer than its base arrive
    staleness_bound: int | None = None  # at most this many commits ahead of the barrier's slowest clock
    one_commit_per_version: bool = False  # commit at most once per version, training on in between


class Pace(ABC):
    """Buffers accepted updates and decides: ``add`` each one, and while ``ready(barrier)``,
    ``take`` the updates of one version and ``aggregate`` them. ``configure`` says what each
    device's Control asks of it."""

    name: str
    #: Versions are rounds over the barrier set: the open round waits for every device in it,
    #: so a round deadline and release balancing apply (``waiting_for`` names who it waits for).
    rounds: bool = False
    #: Scale of one aggregate's delta (a server learning rate).
    mixing: float = 1.0
    #: The most an aggregate may be extrapolated (FedExP's server step, ps_service.aggregate);
    #: 1 is plain averaging. Applied after ``extrapolation_warmup`` versions.
    max_extrapolation: float = 1.0
    extrapolation_warmup: int = 0
    usage: str = ""  # how its spec is written, when it is not just ``name``

    def __init__(self) -> None:
        self._buffer: list[Contribution] = []

    @classmethod
    def from_arg(cls, arg: str) -> Pace:
        """The pace for the text after ``name:`` in a spec ('' when there is none)."""
        if arg:
            raise ValueError(f"pace {cls.name} takes no argument")
        return cls()

    def configure(self, device: str) -> DeviceRules:
        """What ``device`` is asked to do between commits (its Control's pace fields)."""
        return DeviceRules()

    @abstractmethod
    def ready(self, barrier: frozenset[str]) -> bool:
        """Whether the buffered updates should be aggregated now."""

    def broadcast_every(self, fleet: int) -> int:
        """Publish the parameters after this many new versions (``fleet``: devices in the barrier)."""
        return 1

    def aggregate(
        self,
        updates: list[Contribution],
        version: int,
        sizes: dict[str, int],
        extrapolation: float | None,
        steady: bool,
        kept: float = 1.0,
        clips: Mapping[str, Clip] | None = None,
    ) -> Aggregate:
        """One version's change from ``updates`` (weighted by ``sizes``). ``extrapolation``: the
        job's cap on the server step, if it sets one; ``steady``: whether the local work per round
        and the codecs' noise leave the norms that FedExP compares meaningful; ``kept``: the share
        of an update's squared norm its codec delivers (``norm_kept``); ``clips``: how the server's
        bounds take each device's own commits (ps_service.robust)."""
        cap = self.step_cap(version, extrapolation, steady)
        return aggregate_all(updates, version, sizes, self.mixing, cap, kept, clips)

    def step_cap(self, version: int, extrapolation: float | None, steady: bool) -> float:
        """How far the aggregate made at ``version`` may be extrapolated (1: plain averaging)."""
        if version < self.extrapolation_warmup:
            return 1.0
        if extrapolation is not None:
            return extrapolation
        return self.max_extrapolation if self.max_extrapolation > 1 and steady else 1.0

    # ----------------------------------------------------------------- the buffer
    def add(self, update: Contribution) -> None:
        """Buffer an accepted update (a device's commit or a site's)."""
        self._buffer.append(update)

    def take(self) -> list[Contribution]:
        """Hand over (and forget) the updates of one aggregate."""
        taken, self._buffer = self._buffer, []
        return taken

    def take_all(self) -> list[Contribution]:
        """Hand over every buffered update (the pace is being replaced)."""
        taken, self._buffer = self._buffer, []
        return taken

    def drop(self, device: str) -> list[Update]:
        """Forget (and return) the buffered commits of ``device`` (evicted by an operator). Its work
        inside a site commit stays: a site's sum cannot be taken apart."""
        dropped = [u for u in self._buffer if isinstance(u, Update) and u.device == device]
        self._buffer = [u for u in self._buffer if not (isinstance(u, Update) and u.device == device)]
        return dropped

    def committed(self) -> list[str]:
        """Devices with a buffered update, sorted."""
        return sorted({d for u in self._buffer for d in u.devices})

    def waiting_for(self, barrier: frozenset[str]) -> list[str]:
        """Devices of the barrier set the open round still waits for, sorted (none without rounds)."""
        return sorted(barrier - set(self.committed())) if self.rounds else []

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def buffered(self) -> list[Contribution]:
        """The buffered updates, oldest first (for a checkpoint)."""
        return list(self._buffer)


_PACES: dict[str, type[Pace]] = {}
P = TypeVar("P", bound=type[Pace])


def register(cls: P) -> P:
    """Class decorator: make ``cls`` known by its name (unique)."""
    if _PACES.get(cls.name, cls) is not cls:
        raise ValueError(f"pace {cls.name!r} is already registered by {_PACES[cls.name].__name__}")
    _PACES[cls.name] = cls
    return cls


def known() -> tuple[str, ...]:
    """How each registered pace's spec is written: ``bsp``, …, ``ssp:S``."""
    return tuple(c.usage or c.name for c in _PACES.values())


def make_pace(spec: str) -> Pace:
    """A new pace from its spec: its name, then ``:`` and its parameter where it takes one;
    ValueError for anything else."""
    name, colon, arg = spec.partition(":")
    if not spec.isascii():  # Python would read ssp:٣ as ssp:3: a spec means one thing to every peer
        raise ValueError(f"unknown pace {spec!r}: ASCII letters and digits only; known: {', '.join(known())}")
    cls = _PACES.get(name)
    if cls is None or (colon and not arg):
        raise ValueError(f"unknown pace {spec!r}; known: {', '.join(known())}")
    try:
        return cls.from_arg(arg)
    except ValueError:
        raise ValueError(f"unknown pace {spec!r}; known: {', '.join(known())}") from None
