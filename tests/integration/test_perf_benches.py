"""The performance benches end to end, through a real Mosquitto and a real ``edgeps ps``:
``bench load --capacity`` (the broker's raw rate and the server's apply rate for the same commit
payload) and ``bench latency`` (each version's time, split between devices and server)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="needs Mosquitto's clients"),
]


def test_capacity_reports_both_rates_and_their_ratio(tmp_path) -> None:
    from edgeps.bench.capacity import bench_capacity

    report = bench_capacity(
        devices=10,
        seconds=2.0,
        count=2000,
        generators=1,
        checkpoint=True,
        say=lambda *a: None,
        workers=(2,),
        repeats=2,
    )
    assert report["payload_bytes"] > 19_000  # the demo model's fp32 commit
    assert report["broker_rate"] > 0 and report["broker_rate_mosquitto_pub"] > 0
    for server in (report["server"], report["server_checkpoint"]):
        assert 0 < server["apply_rate"] <= server["offered_rate"] * 1.5  # the server applied the load's commits
        assert server["apply_rate"] >= 0.9 * server["receive_rate"]  # valid commits, none refused (rate limits)
    for rate, ratio in (("apply_rate", "ratio"), ("apply_rate_checkpoint", "ratio_checkpoint")):
        assert report[ratio] == pytest.approx(report[rate] / report["broker_rate"], abs=1e-3)
    assert report["cpu_per_commit_us"] > report["broker_cpu_per_message_us"] > 0  # both from /proc, in one run
    assert report["cpu_ratio"] == pytest.approx(
        report["cpu_per_commit_us"] / report["broker_cpu_per_message_us"], rel=0.02
    )
    phases = report["checkpoint_phases"]  # ABBA: a drift of the machine's speed weighs on both alike
    assert [phase["checkpoint"] for phase in phases] == [False, True, True, False]
    assert (
        phases[0]["apply_rate"] == report["apply_rate"]
        and phases[1]["apply_rate"] == report["server_checkpoint"]["apply_rate"]
    )
    saved, plain = ([phase for phase in phases if phase["checkpoint"] is kind] for kind in (True, False))
    rates = [sum(phase["apply_rate"] for phase in runs) for runs in (saved, plain)]
    assert report["checkpoint_rate_ratio"] == pytest.approx(rates[0] / rates[1], abs=2e-3)
    assert report["apply_rate_checkpoint"] == pytest.approx(rates[0] / 2, abs=0.1)
    cpu = [
        sum(phase["server_cores"] for phase in runs) / rate * 1e6
        for runs, rate in zip((saved, plain), rates, strict=True)
    ]
    assert report["cpu_per_commit_us_checkpoint"] == pytest.approx(cpu[0], rel=0.01)
    assert report["checkpoint_cpu_ratio"] == pytest.approx(cpu[0] / cpu[1], rel=0.02)
    shared = report["workers"][2]  # behind two ingest workers: each took a share, the server none directly
    assert shared["apply_rate"] > 0 and not shared["rejected"]
    assert shared["cores"]["ingest-0"] > 0 and shared["cores"]["ingest-1"] > 0


def test_the_cli_writes_the_json_keys_the_issue_names(tmp_path) -> None:
    out = tmp_path / "cap.json"
    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "bench",
        "load",
        "--capacity",
        "--devices",
        "8",
        "--seconds",
        "2",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert {"broker_rate", "apply_rate", "ratio", "cpu_per_commit_us", "broker_cpu_per_message_us", "cpu_ratio"} <= set(
        report
    )
    assert "server applies" in done.stdout


def test_latency_splits_each_version_between_devices_and_server() -> None:
    from edgeps.bench.latency import bench_latency

    report = bench_latency(rounds=12, devices=2, say=lambda *a: None)
    assert report["versions_measured"] >= 10  # every version but the last has both ends seen
    for row in report["versions"]:  # by construction: parameters -> last commit -> parameters
        assert row["round_s"] == pytest.approx(row["device_s"] + row["server_s"])
    assert report["round_ms"] > 0 and report["server_ms"] > 0 and report["best"] > 0.5


def test_the_devices_links_carry_little_besides_frames() -> None:
    """sign commits and ternary pulls through a counting relay: at most 1.25x the frame bytes (the
    barrier went out after every commit and made it 1.37x)."""
    from edgeps.bench.wire import bench_wire

    report = bench_wire("sign", "ternary", rounds=15, say=lambda *a: None)
    assert report["connections"] >= 8  # every device went through the relay
    assert sum(row["bytes"] for row in report["by_kind"]) == report["link_bytes"]
    assert report["frame_bytes"] > 0 and report["overhead"] <= 1.25
