"""What a site commit holds: its devices' updates, each clipped per step to the server's bound and
weighted by its bounded data size, summed, with each device's stated weight and norm (docs/PROTOCOL.md
§4, "Site commits"). Pure arithmetic over updates; the aggregator decides when."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ps_service.aggregate import Clip, partial
from ps_service.robust import MODEL_FRACTION, bounded_sizes, claimed_sizes, per_device
from ps_service.update import Update
from schemas.frame import decode_frame
from schemas.messages import MAX_U32
from schemas.sitecommit import SiteCommit, SiteEntry, encode_site_commit


def first_bound(snapshot: bytes | None) -> float:
    """Half the norm of the newest parameters (the clip bound until the barrier says one)."""
    if snapshot is None:
        return math.inf
    tensors = decode_frame(snapshot).tensors
    return MODEL_FRACTION * math.sqrt(sum(float(np.vdot(v.astype(np.float64), v)) for v in tensors.values()))


def site_commit(
    site: str,
    seq: int,
    version: int,
    updates: list[Update],
    sizes: Mapping[str, int],
    max_norm: float,
    max_weight: float,
    refused: dict[str, int],
) -> bytes:
    """Site commit ``seq`` of ``site`` at ``version``: ``updates`` clipped to ``max_norm`` a step and
    weighted by their claimed data sizes (``sizes``: what each device's status declared) bounded by
    ``max_weight``; ``refused``: what the site refused so far, by reason."""
    weights = bounded_sizes(claimed_sizes(updates, sizes), min(max_weight, MAX_U32))
    norms = per_device(updates, version)
    clips = {d: Clip(max_norm / norm if norm > max_norm else 1.0, steps) for d, (norm, steps) in norms.items()}
    part = partial(updates, version, weights, clips)
    entries = []
    for device in dict.fromkeys(u.device for u in updates):
        mine = [u for u in updates if u.device == device]
        entries.append(
            SiteEntry(
                device=device,
                seq=max(u.seq for u in mine),
                base_version=min(u.base_version for u in mine),
                samples=min(MAX_U32, sum(u.samples for u in mine)),
                steps=min(MAX_U32, sum(u.steps for u in mine)),
                weight=float(weights[device]),
                norm=norms[device][0] * clips[device].scale,
            )
        )
    spread = sum(e.weight * e.norm**2 for e in entries)  # in double precision, as the server checks it
    header = SiteCommit(
        site=site, seq=seq, version=version, data=part.data, spread=spread, commits=entries, refused=refused
    )
    weighted = {name: np.asarray(values, np.float32) for name, values in part.weighted.items()}
    return encode_site_commit(header, weighted)
