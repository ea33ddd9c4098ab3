"""A validated commit from one device, as the pure server logic sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from learning.model import Params
from ps_service.flat import Layout, layout_of
from schemas.sitecommit import SiteEntry


@dataclass(frozen=True)
class Update:
    """The change a device proposes: ``delta`` = its local parameters minus version ``base_version``."""

    device: str
    seq: int
    base_version: int
    samples: int
    steps: int
    #: ``delta``'s tensors as given; None where the receiver made ``flat`` (``delta`` then views it).
    tensors: Params | None
    #: ``delta``'s values as one vector in the model's order, where the receiver made one
    #: (ps_service.validation; ps_service.flat): the commit path's arithmetic runs on it.
    flat: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: The sum of ``flat``'s squares in double precision, where the receiver computed it (its check
    #: that every value is finite: ps_service.validation): a lone commit's norm needs no pass more.
    squares: float | None = field(default=None, compare=False, repr=False)
    #: Where each tensor lies in ``flat`` (the receiver's, which it checked the commit against).
    layout: Layout | None = field(default=None, compare=False, repr=False)

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices whose work this is (a pace's round counts them as committed)."""
        return (self.device,)

    @property
    def delta(self) -> Params:
        """The update's tensors: as given, or views of ``flat`` (made when asked: the commit path,
        which runs on ``flat``, never asks; 4 us a commit saved)."""
        if self.tensors is not None:
            return self.tensors
        assert self.flat is not None and self.layout is not None, "an Update needs its tensors or its flat vector"
        return self.layout.views(self.flat)

    def vector(self) -> tuple[np.ndarray, Layout]:
        """``delta`` as one vector in the model's order, and where each tensor lies in it: as the
        receiver made them, else made here."""
        layout = self.layout if self.layout is not None else layout_of(self.delta)
        return (self.flat if self.flat is not None else layout.flatten(self.delta)), layout

    def to_state(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "seq": self.seq,
            "base_version": self.base_version,
            "samples": self.samples,
            "steps": self.steps,
            "delta": self.delta,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Update:
        delta = {str(name): np.asarray(values, np.float32) for name, values in state["delta"].items()}
        return cls(
            str(state["device"]),
            int(state["seq"]),
            int(state["base_version"]),
            int(state["samples"]),
            int(state["steps"]),
            delta,
        )


class Partial(NamedTuple):
    """Part of one aggregate, summed where its devices are (a site's aggregator): with the other
    parts, what the server needs to finish the aggregate as ``aggregate`` would over every update
    (ps_service.aggregate ``combine``). With d_i a device's staleness-weighted updates per local step
    and n_i its data:"""

    weighted: Params  # sum_i n_i d_i
    data: float  # sum_i n_i
    steps: tuple[float, ...]  # each device's local steps (bounded): the aggregate's tau_eff is their median
    spread: float  # sum_i n_i |d_i|^2: FedExP's spread before the step length


@dataclass(frozen=True)
class SiteUpdate:
    """A site commit as the server holds it: the ``Partial`` of the commits ``entries`` name, made
    by the site's aggregator at ``version`` (its staleness weights), one entry a device; ``refused``:
    the commits its aggregator refused so far, by reason (for the job's metrics, not kept)."""

    site: str
    seq: int
    version: int
    entries: tuple[SiteEntry, ...]
    part: Partial
    refused: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def device(self) -> str:
        """What a pace that groups by sender (asp) groups it under: the site, never a device id."""
        return f"site:{self.site}"

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(entry.device for entry in self.entries)

    def to_state(self) -> dict[str, Any]:
        return {
            "site": self.site,
            "seq": self.seq,
            "version": self.version,
            "entries": [entry.model_dump() for entry in self.entries],
            "weighted": self.part.weighted,
            "data": self.part.data,
            "steps": list(self.part.steps),
            "spread": self.part.spread,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SiteUpdate:
        weighted = {str(name): np.asarray(values, np.float32) for name, values in state["weighted"].items()}
        part = Partial(weighted, float(state["data"]), tuple(float(s) for s in state["steps"]), float(state["spread"]))
        entries = tuple(SiteEntry.model_validate(entry) for entry in state["entries"])
        return cls(str(state["site"]), int(state["seq"]), int(state["version"]), entries, part)


#: What a pace buffers: a device's commit, or a site's commits summed.
Contribution = Update | SiteUpdate


def from_state(state: dict[str, Any]) -> Contribution:
    """A buffered contribution from its checkpoint state (``to_state`` of either kind)."""
    return SiteUpdate.from_state(state) if "site" in state else Update.from_state(state)
