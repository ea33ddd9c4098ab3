"""The hostile-client audit against real deployments of `edgeps broker init` (TLS, accounts,
ACLs, client ids pinned): flat, a site broker bridged to the core with its aggregator, and two
ingest workers behind the server. One of three devices (or, for ``site_flood``, site s2's
aggregator account) is hostile within its ACL; beside a clean job on the same path. The whole
battery: ``edgeps bench attack`` (docs/OPERATIONS.md has its figures); here the attacks that
crashed or stalled the scale-out paths, and a flood on each path."""

from __future__ import annotations

import pytest

from edgeps.bench.attack.audit import bench_attack

CASES = {
    "flat": ("samples_flip", "flood"),
    "sites": ("huge_seq", "bomb", "site_flood"),
    "workers": ("huge_seq", "flood"),
}


@pytest.mark.parametrize("path", list(CASES))
def test_no_attack_crashes_a_process_or_costs_the_job_its_model(path: str) -> None:
    report = bench_attack(paths=(path,), attacks=CASES[path], rounds=60, say=lambda *_, **__: None)
    assert [e["name"] for e in report["attacks"]] == list(CASES[path])
    for e in report["attacks"]:
        what = f"{path}/{e['name']}: {e}"
        assert e["crashes"] == 0, what  # 1.5: seq >= 2^53 made every ingest worker's restart die
        assert e["sigterm_s"] <= 2.0, what  # 1.5: an aggregator twice needed SIGKILL after SIGTERM (> 8 s)
        assert e["versions"] == 60, what  # the job ran to its end
        assert e["attacked_metric"] >= 0.9 * e["clean_metric"], what
        assert e["attacked_mean"] >= 0.9 * e["clean_metric"], what  # during the attack too
        assert e["rss_mib_after"] <= e["rss_mib_before"] + 64, what  # 1.5: junk grew an aggregator to 3.5 GiB
        if "flood" in e["name"]:  # 1.5: a flood through workers cut the job 5.00 -> 0.17 versions/s
            assert e["versions_per_s"] >= 0.5 * e["clean_versions_per_s"], what
            assert e["rejected"].get("rate_limited", 0) > 0, what  # the refusals reach the job's metrics
