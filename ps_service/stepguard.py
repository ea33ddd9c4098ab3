"""How far the server may extrapolate an aggregate, held back while the held-out loss rises.

FedExP's step (acbsp, docs/PACES.md) helps while the aggregates point the same way; with noisy
commits (``sign``) or a model near its optimum it overshoots, and the held-out loss jumps (a
6-class task under acbsp and sign: loss 0.95 to 5.05 between two evaluations, accuracy 0.74 to
0.40). ``StepGuard`` keeps a trust in [0, 1] in the extrapolation beyond plain averaging: each
evaluation whose loss rose by more than ``RISE`` halves it, each whose loss did not rise
restores ``RECOVER`` of it. The cap a pace allows becomes ``1 + (cap - 1) * trust``: the full
step while the loss falls, plain averaging after a run of rises. Pure logic: the core feeds it
evaluations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RISE = 0.05  # a loss more than 5 % above the previous evaluation's counts as a rise
RECOVER = 0.1  # trust regained per evaluation that did not rise


@dataclass
class StepGuard:
    """The trust in extrapolation, moved by the held-out loss of successive evaluations."""

    trust: float = 1.0
    last_loss: float | None = None

    def observe(self, loss: float) -> None:
        """An evaluation's held-out loss (a non-finite one counts as a rise)."""
        rose = not math.isfinite(loss) or (self.last_loss is not None and loss > self.last_loss * (1 + RISE))
        self.trust = self.trust / 2 if rose else min(1.0, self.trust + RECOVER)
        self.last_loss = loss if math.isfinite(loss) else self.last_loss

    def limit(self, cap: float) -> float:
        """The extrapolation cap to use when the pace allows ``cap`` (1: plain averaging)."""
        return 1.0 + (cap - 1.0) * self.trust if cap > 1 else cap
