"""Aggregation of device updates into one global delta, normalised for unequal local work."""

from __future__ import annotations

import functools
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from learning.model import Params
from ps_service.flat import Layout, layout_of, scaled
from ps_service.update import Contribution, Partial, SiteUpdate, Update
from schemas.codecs import make_codec, typical_energy, typical_error


def staleness_weight(staleness: int) -> float:
    """Discount for an update computed on a version ``staleness`` versions old: 1/sqrt(staleness),
    FedAsync's polynomial rule with exponent 1/2 hinged at one version. An update one version
    behind is normal in a synchronous round (a commit in flight when the previous round
    closed) and counts fully; older ones count less, none zero. Discounting that one version
    too (1/sqrt(1 + s)) measurably delays acbsp (docs/PACES.md)."""
    return 1.0 / math.sqrt(max(1, staleness))  # a correctly rounded root, as numpy's


#: How far from plain averaging (0) towards FedExP's step (1) the server goes. FedExP's step is
#: the largest its analysis (convex, every client the same work) allows; here devices do unequal
#: work on non-IID data, and the full step overshoots after the warm-up (docs/PACES.md).
DAMPING = 0.5


class Clip(NamedTuple):
    """How the server's bounds (ps_service.robust) take one device's update: its summed update
    scaled by ``scale`` (below 1: clipped to the norm bound) and counted as ``steps`` local steps."""

    scale: float
    steps: float


class Aggregate(NamedTuple):
    """The global delta of one aggregate as one vector in the model's order (ps_service.flat), the
    server step it was scaled by (1: plain averaging), and where each tensor lies in the vector."""

    flat: np.ndarray
    step: float
    layout: Layout

    @property
    def delta(self) -> Params:
        """The delta's tensors (views of ``flat``)."""
        return self.layout.views(self.flat)


def aggregate(
    updates: list[Update],
    version: int,
    sizes: dict[str, int],
    mixing: float = 1.0,
    max_extrapolation: float = 1.0,
    kept: float = 1.0,
    clips: Mapping[str, Clip] | None = None,
) -> Aggregate:
    """One global delta from the updates of an aggregate, after FedNova.

    A device may contribute several commits and more local steps than another. Each
    device's commits are summed (each scaled by its staleness weight) and divided by its
    steps, giving its mean per-step update d_i; the global delta is
    ``mixing * eta * tau_eff * sum_i p_i d_i`` with p_i its share of the data (``sizes``, the
    samples it holds, as the server bounds them: ps_service.robust). The direction weights
    every device by its data alone, so devices that train more do not pull the model towards
    their own data; with equal steps this is FedAvg.

    tau_eff, the server's step length in local steps, does not change the direction.
    FedNova's default is the mean sum_i p_i tau_i; we use the median of the tau_i, the
    work of a typical device: on the default pace scenario it reaches the target sooner
    (docs/PACES.md), and unlike a maximum it ignores one outlier that piled up steps.

    eta is 1 unless ``max_extrapolation`` > 1: then halfway (``DAMPING``) from 1 to FedExP's
    step (``extrapolation``, divided by ``kept``: ``norm_kept``), at most ``max_extrapolation``.
    ``clips``: how the server's bounds take each device's update (none: as it is).
    """
    if len(updates) == 1 and max_extrapolation <= 1:
        return _lone(updates[0], version, mixing, clips)
    return _fednova(updates, version, sizes, mixing, max_extrapolation, kept, clips)


def _fednova(
    updates: list[Update],
    version: int,
    sizes: dict[str, int],
    mixing: float,
    max_extrapolation: float,
    kept: float,
    clips: Mapping[str, Clip] | None,
) -> Aggregate:
    """``aggregate`` of any updates, device by device."""
    summed, steps, data = _per_device(updates, version, sizes, clips)
    _, layout = updates[0].vector()
    total = float(sum(data.values()))
    share = {d: data[d] / total for d in summed}
    tau_eff = float(statistics.median(steps[d] for d in summed))  # a few numbers: no numpy call per commit
    out = np.zeros(layout.size, np.float32)
    for device, delta in summed.items():
        out += np.float32(mixing * tau_eff * share[device] / steps[device]) * delta
    if max_extrapolation <= 1:
        return Aggregate(out, 1.0, layout)
    contributions = {  # each device's progress as if it had made tau_eff steps
        device: np.float32(mixing * tau_eff / steps[device]) * delta for device, delta in summed.items()
    }
    views = {device: layout.views(c) for device, c in contributions.items()}
    return stepped(out, extrapolation(views, share, layout.views(out), kept), max_extrapolation, layout)


def _lone(update: Update, version: int, mixing: float, clips: Mapping[str, Clip] | None) -> Aggregate:
    """``aggregate`` of one commit without extrapolation (asp's every version): the same float32
    operations in the same order, on one new vector. Its share of the data is 1 and tau_eff its own
    steps, so the zeros the sum starts from only turn a -0 into +0, which adding 0 once does."""
    values, layout = update.vector()
    clip = (clips or {}).get(update.device)
    steps = clip.steps if clip is not None else float(update.steps)
    clipped = clip.scale if clip is not None and clip.scale < 1 else 1.0  # x 1 changes no bit
    weight = staleness_weight(version - update.base_version)
    out = scaled(values, weight, clipped, mixing * steps * 1.0 / steps)  # x tau_eff x share / steps, as ``aggregate``
    return Aggregate(out, 1.0, layout)


def _per_device(
    updates: list[Update],
    version: int,
    sizes: dict[str, int],
    clips: Mapping[str, Clip] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float], dict[str, int]]:
    """Each device's updates summed as one flat vector (each scaled by its staleness
    weight, the sum by its ``clips`` scale), its local steps (as ``clips`` counts them), and its
    data size (``sizes``; a device whose size is unknown counts as holding the samples it trained on)."""
    if not updates:
        raise ValueError("nothing to aggregate")
    summed: dict[str, np.ndarray] = {}
    steps: dict[str, float] = defaultdict(float)
    for u in updates:
        weight = np.float32(staleness_weight(version - u.base_version))
        values, _ = u.vector()
        if u.device in summed:
            summed[u.device] += weight * values
        else:  # 0 + w * x, as the sum from zeros would make it
            summed[u.device] = np.float32(0) + weight * values
        steps[u.device] += u.steps
    for device, clip in (clips or {}).items():
        if device not in summed:
            continue
        steps[device] = clip.steps
        if clip.scale < 1:
            summed[device] = np.float32(clip.scale) * summed[device]
    data = {d: sizes.get(d) or sum(u.samples for u in updates if u.device == d) for d in summed}
    return summed, steps, data


def partial(
    updates: list[Update], version: int, sizes: dict[str, int], clips: Mapping[str, Clip] | None = None
) -> Partial:
    """The ``Partial`` of ``updates`` (some devices' updates of the aggregate made at ``version``)."""
    summed, steps, data = _per_device(updates, version, sizes, clips)
    _, layout = updates[0].vector()
    weighted = np.zeros(layout.size, np.float32)
    spread = 0.0
    for device, delta in summed.items():
        per_step = delta / np.float32(steps[device])
        weighted += np.float32(data[device]) * per_step
        spread += data[device] * _squared_norm(layout.views(per_step))
    return Partial(layout.views(weighted), float(sum(data.values())), tuple(steps[d] for d in summed), spread)


def combine(parts: list[Partial], mixing: float = 1.0, max_extrapolation: float = 1.0, kept: float = 1.0) -> Aggregate:
    """The aggregate of the updates behind ``parts`` (each device in one part): ``aggregate``'s delta
    and step, to float rounding (the sums run in another order)."""
    if not parts:
        raise ValueError("nothing to aggregate")
    total = sum(p.data for p in parts)
    tau_eff = float(statistics.median(s for p in parts for s in p.steps))
    scale = np.float32(mixing * tau_eff / total)
    out = {name: scale * np.sum([p.weighted[name] for p in parts], axis=0) for name in parts[0].weighted}
    layout = layout_of(out)
    if max_extrapolation <= 1:
        return Aggregate(layout.flatten(out), 1.0, layout)
    spread = (mixing * tau_eff) ** 2 * sum(p.spread for p in parts) / total
    return stepped(layout.flatten(out), fedexp_step(spread, _squared_norm(out), kept), max_extrapolation, layout)


def aggregate_all(
    contributions: list[Contribution],
    version: int,
    sizes: dict[str, int],
    mixing: float = 1.0,
    max_extrapolation: float = 1.0,
    kept: float = 1.0,
    clips: Mapping[str, Clip] | None = None,
) -> Aggregate:
    """``aggregate`` over devices' commits and sites' summed commits together: the devices' own
    commits become one more ``Partial`` (weighted by ``sizes``, bounded by ``clips``), each site's
    is taken as the server bounded it (ps_service.robust ``bounded_part``), and ``combine`` finishes
    the aggregate. Without site commits this is ``aggregate`` itself."""
    updates = [c for c in contributions if isinstance(c, Update)]
    sites = [c for c in contributions if isinstance(c, SiteUpdate)]
    if not sites:
        return aggregate(updates, version, sizes, mixing, max_extrapolation, kept, clips)
    parts = [partial(updates, version, sizes, clips)] if updates else []
    return combine([*parts, *(site_part(s, version) for s in sites)], mixing, max_extrapolation, kept)


def site_part(site: SiteUpdate, version: int) -> Partial:
    """A site commit's ``Partial`` as part of the aggregate made at ``version``. Its aggregator
    weighted each commit's staleness at ``site.version``; a site commit that arrives versions later
    (its site missed a round) is discounted once more, as a whole, by the versions it lags:
    ``staleness_weight`` of the lag, which is 1 at a lag of one version or none."""
    lag = np.float32(staleness_weight(version - site.version))
    if lag == 1:
        return site.part
    weighted = {name: lag * values for name, values in site.part.weighted.items()}
    return site.part._replace(weighted=weighted, spread=float(lag) ** 2 * site.part.spread)


def stepped(mean: np.ndarray, fedexp: float, max_extrapolation: float, layout: Layout) -> Aggregate:
    """``mean`` (one vector in ``layout``) scaled by the server step: halfway (``DAMPING``) from 1 to
    FedExP's step ``fedexp``, at most ``max_extrapolation``."""
    eta = min(max_extrapolation, 1.0 + DAMPING * (fedexp - 1.0))
    out = np.float32(eta) * mean
    return Aggregate(out, eta, layout)


def extrapolation(contributions: dict[str, Params], share: dict[str, float], mean: Params, kept: float = 1.0) -> float:
    """FedExP's server step (Jhunjhunwala et al., 2023): ``max(1, sum_i p_i |D_i|^2 / (2 |D|^2))``
    for device contributions D_i and their weighted mean D, divided by ``kept`` inside the max.

    When the devices agree, D_i ~ D and the step is 1 (plain averaging). Near an optimum their
    updates are mostly noise, and non-IID data pulls them in different directions: averaging
    cancels most of each and D shrinks far faster than the progress each device made, so the
    server steps further along D; the server goes halfway to this step (``DAMPING``; measured in
    docs/PACES.md)."""
    spread = sum(share[d] * _squared_norm(c) for d, c in contributions.items())
    return fedexp_step(spread, _squared_norm(mean), kept)


def fedexp_step(spread: float, length: float, kept: float = 1.0) -> float:
    """``max(1, spread / (2 length kept))``; 1 for a zero (or non-finite) mean."""
    if not length > 0:
        return 1.0
    return max(1.0, spread / (2.0 * length * kept))


@functools.cache
def norms_hold(codec: str) -> bool:
    """Whether FedExP's step can be trusted with updates that travel in ``codec``. A biased codec
    here (sign, top-k) only shrinks a tensor's norm, which errs towards a smaller step. An unbiased
    one adds its error's square to every squared norm: beyond a typical relative error of 1 the
    spread is mostly codec noise and the step would sit at its cap (docs/PACES.md)."""
    return make_codec(codec).biased or typical_error(codec) <= 1.0


@functools.cache
def norm_kept(codec: str) -> float:
    """The share of an update's squared norm that reaches the server in ``codec``: the biased
    codec's ``typical_energy`` (sign about 0.65, topk:0.01 about 0.08), 1 for the others. FedExP's
    step is computed from these norms, and a biased codec under-reads them: sign's step sat at
    2.0 where fp32's was 2.35, while the average it scales carried only part of each update (the
    rest waits in the devices' error feedback). Divided by this share, sign's step is about 2.9
    and its plateau rose on each of five seeds (docs/CODECS.md)."""
    return typical_energy(codec) if make_codec(codec).biased else 1.0


def _squared_norm(params: Params) -> float:
    return float(sum(np.vdot(v, v) for v in params.values()))
