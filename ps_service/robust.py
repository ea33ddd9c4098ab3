"""Bounds on what one device can do to the model: its weight, the size of its update and the
local work it claims.

The server cannot check what a device says about itself (how many samples it holds, how many
steps it made, what its update is), only compare it with the rest of the fleet. Three bounds,
applied to every aggregate before the FedNova average (ps_service.aggregate), to a device's own
commits and to each device a site commit names alike:

* **weight**: a device's data size counts at most ``size_factor`` times the median of the sizes
  the job's devices declared (and at most ``max_samples``, when the operator sets a ceiling), so
  one device claiming a billion samples cannot drown the others;
* **norm** (norm-bounded FedAvg): a device's mean per-step update (FedNova's d_i: its commits'
  sum over its steps) longer than ``factor`` (2) times the lower median of the fleet's per-step
  norms is **clipped** to that length, not refused: a device far from the rest (one back after
  a long absence, one with data unlike the others') still counts, and a hostile one moves the
  model by at most its share of that length, whatever it sends (1e30, fp16's largest value, a
  flipped update just under any bound). The reference is each device's newest norm, this
  aggregate's where it is in it, else the one last taken from it (at most ``memory`` versions
  old), recorded after clipping: a device cannot raise the reference by sending more, and the
  median moves only when most of the fleet moves. One shorter than 1/16 of the upper median
  (with three devices or more to tell who is out of line; a commit of zeros) is left out as
  ``outlier``. With one device and nothing to compare with yet, the bound is ``model_fraction``
  of the model's norm;
* **steps**: the local steps a device claims count at most ``steps_factor`` (2) times the lower
  median of the fleet's recent step counts, so that devices claiming huge step counts cannot
  stretch the aggregate's step length (the median of the steps) and amplify the others' updates.

``FleetBounds.limits`` gives the bounds in force; the server publishes them on the barrier
(``max_norm``), so that a site aggregator clips its devices to them before summing
(docs/PROTOCOL.md §7). Pure logic: numbers in, numbers out.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ps_service.aggregate import staleness_weight
from ps_service.flat import sum_squares
from ps_service.update import Partial, SiteUpdate, Update

#: Below this share of the upper median, a per-step norm is no update (a commit of zeros).
SMALL = 1 / 16
#: With nothing to compare with, a whole update is held to this share of the model's norm.
MODEL_FRACTION = 0.5


def size_cap(declared: Mapping[str, int], factor: float, ceiling: int | None = None) -> float:
    """The largest data size a device is weighted by: ``factor`` times the lower median of the
    sizes the job's devices ``declared`` (0: none declared; of two sizes the smaller, so that no
    device's claim sets its own cap), at most ``ceiling`` (inf with neither)."""
    cap = float(ceiling) if ceiling is not None else math.inf
    reference = [size for size in declared.values() if size > 0]
    if reference:
        cap = min(cap, factor * float(statistics.median_low(reference)))  # a few numbers: no numpy call
    return cap


def claimed_sizes(updates: list[Update], declared: Mapping[str, int]) -> dict[str, int]:
    """Each device's data size as it says: what it ``declared``, else the samples its commits consumed."""
    claimed = {u.device: declared.get(u.device) or 0 for u in updates}
    for u in updates:
        if not declared.get(u.device):
            claimed[u.device] += u.samples
    return claimed


def bounded_sizes(claimed: dict[str, int], cap: float) -> dict[str, int]:
    """Each device's data size for weighting: what it ``claimed``, at most ``cap`` (``size_cap``), at least 1."""
    return {device: max(1, int(min(float(size), cap))) for device, size in claimed.items()}


class Seen(NamedTuple):
    """What the server last took from a device: its per-step norm (after clipping), its steps
    (after bounding) and the version it was taken at."""

    norm: float
    steps: float
    version: int


class Judged(NamedTuple):
    """One device's update under the bounds: the factor its update is scaled by (1: within the
    norm bound), the steps it counts with, and whether it is left out (``outlier``)."""

    scale: float
    steps: float
    refused: bool


class Limits(NamedTuple):
    """The bounds in force for one aggregate: ``norm`` (per-step norms are clipped to it),
    ``small`` (shorter ones are refused), ``steps`` (step counts are bounded by it). (A NamedTuple:
    one is made at every version.)"""

    norm: float = math.inf
    small: float = 0.0
    steps: float = math.inf

    @property
    def published(self) -> float | None:
        """The norm bound as the barrier says it (``max_norm``; None: no bound)."""
        return self.norm if math.isfinite(self.norm) else None

    def judge(self, norm: float, steps: float) -> Judged:
        """The verdict on a device whose per-step norm is ``norm`` and which claims ``steps``."""
        if not math.isfinite(norm) or norm < self.small:
            return Judged(0.0, steps, True)
        scale = self.norm / norm if norm > self.norm else 1.0
        return Judged(scale, min(float(steps), self.steps), False)


@dataclass
class FleetBounds:
    """The fleet's recent per-step norms and step counts (``recent``, one ``Seen`` a device, the
    newest last), and the ``Limits`` they set (see the module's docstring). What is more than
    ``memory`` versions old counts no more and is forgotten, so that ``recent`` holds the devices
    of the last ``memory`` versions, not every device ever seen: ``limits`` costs O(those), not
    O(fleet), under asp a few dozen entries whatever the fleet."""

    factor: float = 2.0
    steps_factor: float = 2.0
    model_fraction: float = MODEL_FRACTION
    memory: int = 50
    recent: OrderedDict[str, Seen] = field(default_factory=OrderedDict)
    #: ``recent``'s counted norms (finite, > 0) and steps (> 0), each sorted: kept by ``remember``,
    #: so that an aggregate's limits need no sort of the fleet (``recent`` changes only through it).
    _norms: list[float] = field(default_factory=list, init=False, repr=False, compare=False)
    _steps: list[float] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rank()

    def limits(
        self,
        version: int,
        model_norm: float | Callable[[], float],
        current: Mapping[str, tuple[float, float]] | None = None,
        steps_ceiling: float = math.inf,
    ) -> Limits:
        """The bounds for an aggregate made at ``version`` of the devices in ``current`` (device ->
        (its per-step norm, its steps) in this aggregate); with none, the bounds as they stand
        (what the barrier publishes). ``steps_ceiling``: the most local steps any device may claim
        (what the server let it hold: ``max_uncommitted_steps``). ``model_norm``: the model's L2 norm,
        or what gives it (asked only when nothing compares: the one bound it sets)."""
        current = current or {}
        norms, steps, stale = self._norms.copy(), self._steps.copy(), set()
        for device, seen in self.recent.items():  # the oldest first: those too old to count at ``version``
            if version - seen.version <= self.memory:
                break
            stale.add(device)
            _unrank(norms, steps, seen.norm, seen.steps)
        count = len(self.recent) - len(stale)
        if len(current) == 1 and count == sum(d in self.recent and d not in stale for d in current):
            # alone (nothing counted but, maybe, its own last update): against that
            latest = {d: (s.norm, s.steps) for d, s in self.recent.items() if d not in stale}
            return self._limits(self._reference(latest, current), model_norm, current, steps_ceiling)
        for device, (norm, step) in current.items():  # this aggregate's in place of what was taken before
            before = self.recent.get(device)
            if before is None or device in stale:
                count += 1
            else:
                _unrank(norms, steps, before.norm, before.steps)
            _rank(norms, steps, norm, step)
        return self._limits((count, norms, steps), model_norm, current, steps_ceiling)

    @staticmethod
    def _reference(
        latest: Mapping[str, tuple[float, float]], current: Mapping[str, tuple[float, float]]
    ) -> tuple[int, list[float], list[float]]:
        """What the bounds compare with, from the counted ``latest`` and this aggregate's ``current``:
        how many devices, their counted norms and steps, sorted."""
        if len(current) == 1 and len(latest.keys() - current.keys()) == 0:  # alone: against its own last update
            [(device, _)] = current.items()
            reference = {device: latest[device]} if device in latest else {}
        else:
            reference = {**latest, **current}
        norms = sorted(n for n, _ in reference.values() if math.isfinite(n) and n > 0)
        steps = sorted(s for _, s in reference.values() if s > 0)
        return len(reference), norms, steps

    def _limits(
        self,
        reference: tuple[int, list[float], list[float]],
        model_norm: float | Callable[[], float],
        current: Mapping[str, tuple[float, float]],
        steps_ceiling: float,
    ) -> Limits:
        count, norms, steps = reference
        step_bound = steps_ceiling
        if count >= 2 and steps:
            step_bound = min(step_bound, self.steps_factor * steps[(len(steps) - 1) // 2])
        if count >= 2 and norms:
            bound = self.factor * norms[(len(norms) - 1) // 2]
        elif count and norms:  # one device to compare with: its own last update
            bound = self.factor * norms[0]
        elif (model := model_norm() if callable(model_norm) else model_norm) > 0:
            # nothing to compare with: the whole update within a share of the model
            claimed = min([s for _, s in current.values()], default=step_bound)
            bound = self.model_fraction * model / max(1.0, min(claimed, step_bound))
        else:
            bound = math.inf
        small = SMALL * norms[len(norms) // 2] if count >= 3 and norms else 0.0
        return Limits(bound, small, step_bound)

    def remember(self, device: str, norm: float, steps: float, version: int) -> None:
        """``device``'s update was taken at ``version``, at per-step ``norm`` and ``steps`` (bounded);
        what no aggregate from ``version`` on counts is forgotten (the oldest first)."""
        seen = self.recent.get(device)
        if seen is not None:
            _unrank(self._norms, self._steps, seen.norm, seen.steps)
        self.recent[device] = Seen(norm, steps, version)
        self.recent.move_to_end(device)
        _rank(self._norms, self._steps, norm, steps)
        while self.recent:
            oldest = next(iter(self.recent.values()))
            if version - oldest.version <= self.memory:
                break
            _, gone = self.recent.popitem(last=False)
            _unrank(self._norms, self._steps, gone.norm, gone.steps)

    def _rank(self) -> None:
        """``_norms`` and ``_steps`` anew from ``recent``."""
        self._norms = sorted(s.norm for s in self.recent.values() if math.isfinite(s.norm) and s.norm > 0)
        self._steps = sorted(s.steps for s in self.recent.values() if s.steps > 0)

    def to_state(self) -> dict[str, Any]:
        return {"recent": {d: list(s) for d, s in sorted(self.recent.items())}}

    def load_state(self, state: dict[str, Any]) -> None:
        """From ``to_state``; a checkpoint before 1.6 holds [norm, version] (steps unknown: 0, not counted)."""
        recent = state["recent"].items()
        seen = [(str(d), Seen(float(s[0]), float(s[1]) if len(s) == 3 else 0.0, int(s[-1]))) for d, s in recent]
        self.recent = OrderedDict(sorted(seen, key=lambda item: item[1].version))  # the newest last
        self._rank()


def _rank(norms: list[float], steps: list[float], norm: float, step: float) -> None:
    """Count a device's ``norm`` and ``step`` into the sorted lists (each where it counts)."""
    if math.isfinite(norm) and norm > 0:
        bisect.insort(norms, norm)
    if step > 0:
        bisect.insort(steps, step)


def _unrank(norms: list[float], steps: list[float], norm: float, step: float) -> None:
    """Take out what ``_rank`` counted of ``norm`` and ``step``."""
    if math.isfinite(norm) and norm > 0:
        del norms[bisect.bisect_left(norms, norm)]
    if step > 0:
        del steps[bisect.bisect_left(steps, step)]


def per_device(updates: list[Update], version: int) -> dict[str, tuple[float, float]]:
    """Each device's (per-step norm, steps) in an aggregate made at ``version``: the norm of its
    staleness-weighted commits' sum over its steps (FedNova's d_i), in double precision. A device's
    lone commit's norm is its staleness weight times the root of its squares, which the receiver
    summed already (``Update.squares``): no pass over its values."""
    by_device: dict[str, list[Update]] = {}
    for u in updates:
        by_device.setdefault(u.device, []).append(u)
    out: dict[str, tuple[float, float]] = {}
    for device, own in by_device.items():
        steps = sum(u.steps for u in own)
        if len(own) == 1:
            [u] = own
            squares = u.squares if u.squares is not None else sum_squares(u.vector()[0])
            norm = staleness_weight(version - u.base_version) * math.sqrt(squares)
        else:
            norm = math.sqrt(_squares(own, version))
        out[device] = (norm / steps, float(steps))
    return out


def _squares(updates: list[Update], version: int) -> float:
    """The squared norm of ``updates``' staleness-weighted sum (one device's), in double precision."""
    total: np.ndarray | None = None
    for u in updates:
        flat, _ = u.vector()
        weighted = staleness_weight(version - u.base_version) * flat.astype(np.float64)
        total = weighted if total is None else total + weighted
    assert total is not None
    return float(np.dot(total, total))


def bounded_part(site: SiteUpdate, limits: Limits, weight_cap: float) -> tuple[Partial | None, dict[str, Judged]]:
    """A site commit's sums under the fleet's bounds, as its devices' own commits are bounded, and
    the verdict on each entry (by the norm and steps it states, which the door checked against the
    sums: ps_service.door). A sum cannot be taken apart, so a site's part is scaled as a whole: by
    the smallest ``weight_cap`` / weight of its entries (weights and sums, so that no device counts
    for more than the cap) and by the smallest scale the norm bound gives an entry (the sums).
    Entries refused as too short leave their weight and steps out (their sums, that short, stay).
    None when every entry is refused."""
    verdicts = {e.device: limits.judge(e.norm, float(e.steps)) for e in site.entries}
    kept = [e for e in site.entries if not verdicts[e.device].refused]
    if not kept:
        return None, verdicts
    by_weight = min(1.0, min(weight_cap / e.weight for e in kept))
    by_norm = min(verdicts[e.device].scale for e in kept)
    scale = np.float32(by_weight * by_norm)
    weighted = site.part.weighted if scale == 1 else {n: scale * v for n, v in site.part.weighted.items()}
    spread = by_weight * by_norm**2 * sum(e.weight * e.norm**2 for e in kept)
    part = Partial(
        weighted, by_weight * sum(e.weight for e in kept), tuple(verdicts[e.device].steps for e in kept), spread
    )
    return part, verdicts
