"""ssp:S: asynchronous within a staleness bound."""

from __future__ import annotations

from ps_service.paces.asp import Asp
from ps_service.paces.base import DeviceRules, Pace, register


@register
class Ssp(Asp):
    """Stale synchronous: applied on arrival like ``asp``, but a device may be at most ``S``
    commits ahead of the slowest device in the barrier; beyond that it idles."""

    name = "ssp"
    usage = "ssp:S"

    def __init__(self, bound: int) -> None:
        super().__init__()
        if bound < 0:
            raise ValueError("the ssp staleness bound must be >= 0")
        self.bound = bound
        self.name = f"ssp:{bound}"

    @classmethod
    def from_arg(cls, arg: str) -> Pace:
        """``ssp:S`` with S >= 0 commits."""
        if not arg.isdigit():
            raise ValueError(f"ssp needs a bound S >= 0, got {arg!r}")
        return cls(int(arg))

    def configure(self, device: str) -> DeviceRules:
        return DeviceRules(staleness_bound=self.bound)
