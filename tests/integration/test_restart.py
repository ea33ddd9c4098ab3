"""Restarts of real processes over Mosquitto (``edgeps bench restart``). 1.0: a device restarted
with the same id began again at seq 1, and its commits were refused as ``replayed`` until it
passed its old high-water mark (35 lost in one run); a server stopped with SIGTERM and started
again stalled the job (3 of 3 trials)."""

from __future__ import annotations

import pytest

from edgeps.bench.restart import bench_restart

pytestmark = pytest.mark.integration


def test_a_device_killed_and_started_again_loses_no_commit() -> None:
    (run,) = bench_restart(trials=2, rounds=30, targets=("device",), say=lambda *_: None)["runs"]
    assert run["versions"] == 30 and len(run["restarts"]) == 2
    assert run["lost_to_restarts"] == 0 and not {"replayed", "out_of_order"} & set(run["rejected"])


def test_a_server_stopped_with_sigterm_resumes_within_the_round_deadline() -> None:
    (run,) = bench_restart(trials=2, rounds=30, targets=("server",), say=lambda *_: None)["runs"]
    assert run["within_deadline"] == 2  # the next version came within one round deadline of the restart
    assert run["versions"] == 30 and run["applied"] == 30 * 3  # every commit applied once
