"""The parameter store: the global model and its version counter."""

from __future__ import annotations

from typing import Any

import numpy as np

from learning.model import Params
from ps_service.flat import Layout, add_finite
from schemas.frame import Frame, FrameKind, encode_frame


class NonFinite(ValueError):
    """A change that would make the model hold NaN or Inf: refused, the model kept."""


class ParameterStore:
    """Holds version ``v`` of the parameters; every applied delta makes version ``v + 1``.

    The store owns its arrays: callers get copies, so nothing outside can corrupt the model.
    """

    def __init__(self, params: Params, version: int = 0) -> None:
        self._shapes = {name: np.shape(values) for name, values in params.items()}  # an apply keeps them
        self.layout = Layout(self._shapes)
        self._flat = self.layout.flatten(params)  # the model, one vector
        self._views: Params | None = None  # its tensors (views of it), made when asked for
        self.version = version
        self._frame: tuple[bytes, int] | None = None  # (frame, run)
        self._norm: tuple[float, int] | None = None  # (norm, version)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape (the same dict every time: callers read it, never change it)."""
        return self._shapes

    @property
    def _params(self) -> Params:
        """The model's tensors, views of its vector (made once a version: most versions never need them)."""
        if self._views is None:
            self._views = self.layout.views(self._flat)
        return self._views

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
        """Add ``delta`` (the model's names and shapes) and return the new version (``apply_flat``)."""
        return self.apply_flat(self.layout.flatten(delta))

    def apply_flat(self, flat: np.ndarray) -> int:
        """Add ``flat`` (a change as one vector in the model's order) and return the new version.

        The sum is computed fully before anything is stored, so a failure leaves the
        model as it was.
        """
        updated = add_finite(self._flat, flat)
        if updated is None:
            raise NonFinite("applying the delta would make the model non-finite")
        self._flat, self._views = updated, None
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
        """The model's L2 norm (double precision; kept until the next apply)."""
        if self._norm is None or self._norm[1] != self.version:
            self._norm = (float(np.sqrt(self.layout.squares(self._flat.astype(np.float64)))), self.version)
        return self._norm[0]

    def to_state(self) -> dict[str, Any]:
        return {"version": self.version, "params": self.params()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ParameterStore:
        return cls(state["params"], int(state["version"]))
