"""Which model a job trains: the built-in MLP, or a convolution before it, and their sizes."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from learning.model import Params, init_cnn, init_mlp


class ModelSpec(BaseModel):
    """The model's architecture; ``init`` draws its parameters for a dataset's shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: str = Field("64", description="hidden layer sizes, comma-separated")
    arch: Literal["mlp", "cnn"] = Field("mlp", description="cnn: a convolution before the MLP (square images)")
    channels: int = Field(16, ge=1, description="cnn: convolution filters")
    kernel: int = Field(3, ge=1, description="cnn: kernel side")

    @field_validator("hidden")
    @classmethod
    def _sizes(cls, text: str) -> str:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"hidden layer sizes must be positive integers, comma-separated, got {text!r}")
        return ",".join(parts)

    @property
    def layers(self) -> list[int]:
        """The hidden layer sizes."""
        return [int(h) for h in self.hidden.split(",") if h]

    def init(self, features: int, classes: int, seed: int) -> Params:
        """Parameters for ``features`` inputs and ``classes`` outputs, drawn from ``seed``."""
        if self.arch == "cnn":
            return init_cnn(math.isqrt(features), self.kernel, self.channels, self.layers, classes, seed)
        return init_mlp([features, *self.layers, classes], seed)
