"""The model artifact on ``edgeps/{job}/model`` (retained): a TFLite trainer and what it expects.

Layout (docs/PROTOCOL.md §8): ``EPSM`` magic, u32 little-endian length of the metadata,
the metadata as UTF-8 JSON (``ArtifactMeta``), then the ``.tflite`` flatbuffer. The
metadata names the flatbuffer's SHA-256 and size; a receiver refuses an artifact whose
bytes do not match them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAGIC = b"EPSM"
MAX_META_BYTES = 64 * 1024


class ArtifactError(ValueError):
    """An artifact that does not parse or whose bytes do not match its metadata."""


class TensorSpec(BaseModel):
    """One named parameter tensor the signatures take (and whose gradient they return)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z]+[0-9]+\.[wb]$")
    shape: tuple[int, ...]


class ArtifactMeta(BaseModel):
    """What a device needs to run the trainer: the architecture, the tensors, the input spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["edgeps-tflite/1"] = "edgeps-tflite/1"
    arch: Literal["mlp", "cnn", "conv1d"]
    version: int = Field(ge=1, description="the artifact's own version, counted by the server")
    params: list[TensorSpec]
    features: int = Field(ge=1, description="x: float32 (batch, features)")
    classes: int = Field(ge=1, description="the model's outputs: classes for cross_entropy, else 1")
    loss: Literal["cross_entropy", "bce", "mse", "mae"] = Field(
        "cross_entropy", description="the loss of loss_and_grads; y is int32 labels for cross_entropy, else float32"
    )
    batch_size: int = Field(ge=1, description="loss_and_grads takes exactly this many rows; predict any number")
    signatures: tuple[str, ...] = ("loss_and_grads", "predict")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=1)
    built_with: str = Field("", max_length=64, description="e.g. tensorflow 2.21.0")

    def input_name(self, param: str) -> str:
        """The signature input (and gradient output) name of a parameter: dots are not allowed there."""
        return param.replace(".", "_")


def encode_artifact(meta: ArtifactMeta, tflite: bytes) -> bytes:
    body = meta.model_dump_json().encode()
    return MAGIC + struct.pack("<I", len(body)) + body + tflite


def decode_artifact(payload: bytes) -> tuple[ArtifactMeta, bytes]:
    """The metadata and the verified flatbuffer; ArtifactError otherwise."""
    if len(payload) < 8 or payload[:4] != MAGIC:
        raise ArtifactError("not an edgeps model artifact (bad magic)")
    (length,) = struct.unpack_from("<I", payload, 4)
    if length > MAX_META_BYTES or 8 + length > len(payload):
        raise ArtifactError(f"artifact metadata length {length} does not fit the payload")
    try:
        meta = ArtifactMeta.model_validate(json.loads(payload[8 : 8 + length]))
    except (ValueError, ValidationError) as exc:
        raise ArtifactError(f"artifact metadata invalid: {str(exc).splitlines()[0]}") from None
    tflite = payload[8 + length :]
    verify(meta, tflite)
    return meta, tflite


def verify(meta: ArtifactMeta, tflite: bytes) -> None:
    """ArtifactError unless ``tflite`` is exactly the flatbuffer ``meta`` describes."""
    if len(tflite) != meta.size:
        raise ArtifactError(f"artifact is {len(tflite)} bytes, its metadata says {meta.size}: refused")
    digest = hashlib.sha256(tflite).hexdigest()
    if digest != meta.sha256:
        raise ArtifactError(f"artifact sha256 {digest[:12]}... does not match {meta.sha256[:12]}...: refused")
