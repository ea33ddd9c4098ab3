"""Error feedback (after EF-SGD) for biased codecs."""

from __future__ import annotations

import numpy as np

from schemas.codecs.base import Codec


class ErrorFeedback:
    """What a biased codec dropped from one tensor is added to the next one of the same name,
    so nothing is lost, only delayed. ``codec`` may be replaced between calls."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: dict[str, np.ndarray] = {}

    def encode(
        self, tensors: dict[str, np.ndarray], rng: np.random.Generator | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
        """Encode ``tensors`` plus the carried residual, each once: (the tensors the payloads stand
        for, the payloads by name).

        Under a biased codec the payloads stand for the compensated tensors less the codec's
        loss on them, which becomes the new residual. An unbiased codec keeps no residual: one
        left by a biased codec before a switch goes out once, added to these tensors, and the
        payloads stand for the compensated tensors (unchanged ``tensors`` when nothing was
        carried)."""
        codec = self.codec
        if not codec.biased:
            if self.residual:
                held, self.residual = self.residual, {}
                tensors = {
                    name: (values + held[name]).astype(np.float32) if name in held else values
                    for name, values in tensors.items()
                }
            return tensors, {name: codec.encode(np.asarray(values), rng) for name, values in tensors.items()}
        sent, payloads = {}, {}
        for name, values in tensors.items():
            carried = values + self.residual[name] if name in self.residual else values
            carried = carried.astype(np.float32)
            payloads[name] = codec.encode(carried, rng)
            self.residual[name] = carried - codec.decode(payloads[name], carried.shape)
            sent[name] = carried - self.residual[name]
        return sent, payloads
