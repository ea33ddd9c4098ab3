"""acbsp: the paper's asynchronous-compatible BSP."""

from __future__ import annotations

from ps_service.paces.base import DeviceRules, register
from ps_service.paces.bsp import Bsp


@register
class Acbsp(Bsp):
    """Asynchronous-compatible BSP (the paper's pace): BSP's rounds, one aggregate over
    every device in the barrier, but nobody idles. A device commits after ``push_every``
    steps and keeps training; it commits once per version, and when the next round's
    parameters arrive it adopts them with its uncommitted progress carried over into its
    next commit. Fast devices thus bring more steps to a round (normalised by the
    FedNova-style aggregation) without sending more commits than bsp (docs/PACES.md)."""

    name = "acbsp"
    # Beyond the paper: extrapolating the round's average lifts acbsp's late accuracy, where
    # averaging over devices that keep training cancels most of their progress; early on it
    # only overshoots, hence the warm-up (docs/PACES.md). The cap bounds one step at three
    # plain ones.
    max_extrapolation = 3.0
    extrapolation_warmup = 10

    def configure(self, device: str) -> DeviceRules:
        return DeviceRules(one_commit_per_version=True)
