"""The parameter store: the global model and its version counter."""

from __future__ import annotations

from typing import Any

import numpy as np

from learning.model import Params
from schemas.frame import Frame, FrameKind, encode_frame


class NonFinite(ValueError):
    """A change that would make the model hold NaN or Inf: refused, the model kept."""


class ParameterStore:
    """Holds version ``v`` of the parameters; every applied delta makes version ``v + 1``.

    The store owns its arrays: callers get copies, so nothing outside can corrupt the model.
    """

    def __init__(self, params: Params, version: int = 0) -> None:
        self._params = {name: np.array(values, dtype=np.float32) for name, values in params.items()}
        self.version = version
        self._frame: tuple[bytes, int] | None = None  # (frame, run)
        self._shapes = {name: values.shape for name, values in self._params.items()}  # an apply keeps them

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape (the same dict every time: callers read it, never change it)."""
        return self._shapes

    def params(self) -> Params:
        """A copy of the current parameters."""
        return {name: values.copy() for name, values in self._params.items()}

    def view(self) -> Params:
        """The current parameters, read-only (no copy): for evaluation."""
        out = {}
        for name, values in self._params.items():
            ro = values.view()
            ro.flags.writeable = False
            out[name] = ro
        return out

    def apply(self, delta: Params) -> int:
        """Add ``delta`` (same names and shapes) and return the new version.

        The sum is computed fully before anything is stored, so a failure leaves the
        model as it was.
        """
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected just below
            updated = {name: values + delta[name].astype(np.float32) for name, values in self._params.items()}
        if not all(np.isfinite(v).all() for v in updated.values()):
            raise NonFinite("applying the delta would make the model non-finite")
        self._params = updated
        self.version += 1
        self._frame = None
        return self.version

    def snapshot_frame(self, run: int = 0) -> bytes:
        """The parameter frame of the current version, stamped with the job's ``run`` (cached until
        the next apply)."""
        if self._frame is None or self._frame[1] != run:
            frame = Frame(kind=FrameKind.PARAMS, base_version=self.version, seq=run, tensors=self._params)
            self._frame = (encode_frame(frame), run)
        return self._frame[0]

    def norm(self) -> float:
        """The model's L2 norm (double precision)."""
        return float(np.sqrt(sum(float(np.vdot(v.astype(np.float64), v)) for v in self._params.values())))

    def to_state(self) -> dict[str, Any]:
        return {"version": self.version, "params": self.params()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ParameterStore:
        return cls(state["params"], int(state["version"]))
