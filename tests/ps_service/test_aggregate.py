"""Hierarchical aggregation: sites' partial sums give the server the aggregate it makes from every update."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.aggregate import Clip, _fednova, aggregate, aggregate_all, combine, partial, site_part
from ps_service.flat import sum_squares
from ps_service.robust import per_device
from ps_service.update import SiteUpdate, Update
from schemas.sitecommit import SiteEntry

SHAPES = {"w": (3, 2), "b": (2,)}


@st.composite
def rounds(draw):
    """(updates of one aggregate, its version, data sizes, a site for each device)."""
    version = draw(st.integers(0, 6))
    devices = draw(st.integers(1, 7))
    updates = []
    for d in range(devices):
        for c in range(draw(st.integers(1, 3))):  # a device may bring several commits
            delta = {
                name: draw(
                    st.lists(st.floats(-5, 5, width=32), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
                )
                for name, shape in SHAPES.items()
            }
            updates.append(
                Update(
                    f"d{d}",
                    c + 1,
                    draw(st.integers(max(0, version - 4), version)),
                    draw(st.integers(1, 64)),
                    draw(st.integers(1, 30)),
                    {n: np.float32(v).reshape(SHAPES[n]) for n, v in delta.items()},
                )
            )
    sizes = {f"d{d}": draw(st.integers(1, 500)) for d in range(devices) if draw(st.booleans())}  # some unknown
    sites = [draw(st.integers(0, 2)) for _ in range(devices)]
    return updates, version, sizes, sites


@settings(max_examples=300, deadline=None)
@given(
    case=rounds(),
    mixing=st.sampled_from([1.0, 0.5]),
    cap=st.sampled_from([1.0, 3.0]),
    kept=st.sampled_from([1.0, 0.65]),
)
def test_sites_partial_sums_combine_to_the_direct_aggregate(case, mixing, cap, kept) -> None:
    updates, version, sizes, sites = case
    direct = aggregate(updates, version, sizes, mixing, cap, kept)
    by_site: dict[int, list[Update]] = {}
    for u in updates:
        by_site.setdefault(sites[int(u.device[1:])], []).append(u)
    parts = [partial(site_updates, version, sizes) for site_updates in by_site.values()]
    combined = combine(parts, mixing, cap, kept)
    assert combined.step == pytest.approx(direct.step, rel=1e-4)
    scale = max(1.0, max(float(np.abs(v).max()) for v in direct.delta.values()))
    for name, values in direct.delta.items():
        np.testing.assert_allclose(combined.delta[name], values, rtol=1e-4, atol=1e-5 * scale)


def site_update(site: str, updates: list[Update], version: int, sizes: dict[str, int]) -> SiteUpdate:
    """What the server holds of ``updates`` summed by site ``site``'s aggregator at ``version``."""
    norms = per_device(updates, version)
    weight = {d: sizes.get(d) or sum(u.samples for u in updates if u.device == d) for d in norms}
    entries = tuple(
        SiteEntry(
            device=u.device,
            seq=u.seq,
            base_version=u.base_version,
            samples=u.samples,
            steps=u.steps,
            weight=weight[u.device],
            norm=norms[u.device][0],
        )
        for u in {u.device: u for u in updates}.values()
    )
    return SiteUpdate(site, 1, version, entries, partial(updates, version, sizes))


@settings(max_examples=200, deadline=None)
@given(case=rounds(), cap=st.sampled_from([1.0, 3.0]))
def test_the_server_aggregates_site_commits_beside_direct_commits_as_every_commit_directly(case, cap) -> None:
    """Site 0's devices commit to the server directly, the others' through their sites' aggregators."""
    updates, version, sizes, sites = case
    direct = aggregate(updates, version, sizes, 0.5, cap)
    own = [u for u in updates if sites[int(u.device[1:])] == 0]
    summed = [
        site_update(f"s{k}", [u for u in updates if sites[int(u.device[1:])] == k], version, sizes)
        for k in (1, 2)
        if any(sites[int(u.device[1:])] == k for u in updates)
    ]
    mixed = aggregate_all([*own, *summed], version, sizes, 0.5, cap)
    assert mixed.step == pytest.approx(direct.step, rel=1e-4)
    scale = max(1.0, max(float(np.abs(v).max()) for v in direct.delta.values()))
    for name, values in direct.delta.items():
        np.testing.assert_allclose(mixed.delta[name], values, rtol=1e-4, atol=1e-5 * scale)


def test_a_site_commit_that_lags_is_discounted_as_a_whole() -> None:
    rng = np.random.default_rng(1)
    updates = [Update("d0", 1, 2, 10, 4, {"w": rng.standard_normal(3).astype(np.float32)})]
    site = site_update("s", updates, 2, {})
    assert site_part(site, 3) is site.part  # one version behind counts fully, as a device's commit
    lagging = site_part(site, 6)  # four behind: 1/sqrt(4)
    np.testing.assert_allclose(lagging.weighted["w"], site.part.weighted["w"] / 2, rtol=1e-6)
    assert lagging.spread == pytest.approx(site.part.spread / 4)


def test_one_site_holding_every_device_is_the_direct_aggregate() -> None:
    rng = np.random.default_rng(0)
    updates = [
        Update(f"d{i}", 1, 3, 32, 5 + i, {"w": rng.standard_normal((4, 4)).astype(np.float32)}) for i in range(5)
    ]
    direct = aggregate(updates, 4, {"d0": 100}, max_extrapolation=3.0)
    combined = combine([partial(updates, 4, {"d0": 100})], max_extrapolation=3.0)
    np.testing.assert_allclose(combined.delta["w"], direct.delta["w"], rtol=1e-5, atol=1e-6)
    assert combined.step == pytest.approx(direct.step)


def test_nothing_to_combine_is_refused() -> None:
    with pytest.raises(ValueError):
        combine([])
    with pytest.raises(ValueError):
        partial([], 0, {})


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([0.0, -0.0, 1e-45, -3.5, 2.0**-126]) | st.floats(-5, 5, width=32), min_size=8, max_size=8
    ),
    staleness=st.integers(0, 9),
    steps=st.integers(1, 30),
    mixing=st.sampled_from([1.0, 0.5, 0.3]),
    clip=st.none() | st.tuples(st.floats(1e-6, 1.0), st.floats(1.0, 40.0)),
)
def test_a_lone_commit_aggregates_to_the_bits_of_the_device_by_device_path(
    values, staleness, steps, mixing, clip
) -> None:
    """asp's every version is one commit, aggregated on a path of its own: its bits, -0 included, are
    those of the general path (the sum from zeros, the median of one device's steps, a share of 1)."""
    flat = np.float32(values)
    update = Update("d0", 1, 10 - staleness, 20, steps, {"w": flat[:6].reshape(3, 2), "b": flat[6:]})
    clips = None if clip is None else {"d0": Clip(*clip)}
    lone = aggregate([update], 10, {"d0": 7}, mixing, 1.0, 1.0, clips)
    general = _fednova([update], 10, {"d0": 7}, mixing, 1.0, 1.0, clips)
    assert lone.step == general.step == 1.0
    assert lone.flat is not None and general.flat is not None
    assert lone.flat.tobytes() == general.flat.tobytes()
    for name, tensor in general.delta.items():
        assert lone.delta[name].tobytes() == tensor.tobytes() and lone.delta[name].shape == tensor.shape


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(-5, 5, width=32), min_size=8, max_size=8), staleness=st.integers(0, 9))
def test_a_lone_commits_norm_from_its_summed_squares_is_its_weighted_vectors(values, staleness) -> None:
    """``per_device`` takes a lone commit's norm from the squares its receiver summed: the norm of
    its staleness-weighted values to rounding, without the pass over them."""
    flat = np.float32(values)
    plain = Update("d0", 1, 10 - staleness, 20, 3, {"w": flat[:6].reshape(3, 2), "b": flat[6:]})
    summed = Update("d0", 1, 10 - staleness, 20, 3, plain.delta, flat, sum_squares(flat))
    [(norm, steps)] = per_device([summed], 10).values()
    [(reference, _)] = per_device([plain], 10).values()
    assert steps == 3.0 and math.isclose(norm, reference, rel_tol=1e-12, abs_tol=1e-300)
