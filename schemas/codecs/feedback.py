"""Error feedback (after EF-SGD) for biased codecs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from schemas.codecs.base import Codec

#: The residual's key under compact commits (the model's values in one vector).
COMPACT = "*"


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
        return self._encode(tensors, rng, self.codec.encode, self.codec.decode)

    def encode_compact(
        self, tensors: dict[str, np.ndarray], rng: np.random.Generator | None = None
    ) -> tuple[dict[str, np.ndarray], bytes]:
        """As ``encode``, for a compact commit: ``tensors`` (in the model's order) as one flat vector
        under the codec's ``encode_compact``: (the tensors the payload stands for, the payload). Its
        residual is one flat vector too (``COMPACT``)."""
        sizes = [int(np.size(values)) for values in tensors.values()]
        vector = np.concatenate([np.asarray(values, np.float32).reshape(-1) for values in tensors.values()])
        codec = self.codec
        sent, payloads = self._encode(
            {COMPACT: vector}, rng, codec.encode_compact, lambda p, s: codec.decode_compact(p, s[0])
        )
        ends = np.cumsum(sizes)
        flat = sent[COMPACT]
        out = {
            name: flat[end - size : end].reshape(np.shape(values))
            for (name, values), end, size in zip(tensors.items(), ends, sizes, strict=True)
        }
        return out, payloads[COMPACT]

    def _encode(
        self,
        tensors: dict[str, np.ndarray],
        rng: np.random.Generator | None,
        encode: Callable[[np.ndarray, np.random.Generator | None], bytes],
        decode: Callable[[bytes, tuple[int, ...]], np.ndarray],
    ) -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
        if not self.codec.biased:
            if self.residual:
                held, self.residual = self.residual, {}
                tensors = {
                    name: (values + held[name]).astype(np.float32) if name in held else values
                    for name, values in tensors.items()
                }
            return tensors, {name: encode(np.asarray(values), rng) for name, values in tensors.items()}
        sent, payloads = {}, {}
        for name, values in tensors.items():
            carried = values + self.residual[name] if name in self.residual else values
            carried = carried.astype(np.float32)
            payloads[name] = encode(carried, rng)
            self.residual[name] = carried - decode(payloads[name], carried.shape)
            sent[name] = carried - self.residual[name]
        return sent, payloads
