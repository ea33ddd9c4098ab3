"""The device's on-disk cache of verified model artifacts, so that a restarted gateway can
train before (or without) fetching the retained artifact again."""

from __future__ import annotations

import os
from pathlib import Path

from schemas.artifact import decode_artifact

SUFFIX = ".epsm"


def save_artifact(directory: Path, payload: bytes) -> Path:
    """Write a verified artifact as ``{sha256}.epsm`` (atomically); ArtifactError if it does not verify."""
    meta, _ = decode_artifact(payload)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{meta.sha256}{SUFFIX}"
    if not path.exists() or path.read_bytes() != payload:
        partial = path.with_suffix(".part")
        partial.write_bytes(payload)
        os.replace(partial, path)
    return path


def cached_artifacts(directory: Path) -> list[bytes]:
    """Cached artifacts, newest first, unverified: the device verifies each before using it."""
    if not directory.is_dir():
        return []
    paths = sorted(directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [p.read_bytes() for p in paths]
