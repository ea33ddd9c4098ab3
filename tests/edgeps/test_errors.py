"""A newcomer's mistakes, met as a user meets them: the command, its exit status, its one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest


def edgeps(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeps.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["demo", "--codec", "bogus"], "--codec 'bogus': unknown codec 'bogus'; known: fp32"),
        (["demo", "--pace", "foo"], "--pace 'foo': unknown pace 'foo'; known: bsp"),
        (["demo", "--rounds", "-1"], "--rounds -1: Input should be greater than or equal to 1"),
        (["demo", "--hidden", "64,x"], "--hidden '64,x': hidden layer sizes must be positive integers"),
        (["demo", "--metrics-port", "99999"], "--metrics-port 99999: Input should be less than or equal to 65535"),
        (["ps", "--codec", "qsgd:abc"], "--codec 'qsgd:abc': bad codec spec 'qsgd:abc'"),
        (["client", "--device", "dev/00", "--data", "x.npz"], "--device 'dev/00': String should match pattern"),
        (["ctl", "set-codec", "bogus"], "set-codec 'bogus': unknown codec 'bogus'"),
        (["ctl", "set-pace", "foo"], "set-pace 'foo': unknown pace 'foo'"),
    ],
)
def test_a_bad_option_is_one_line_naming_it_before_anything_starts(tmp_path, args, expected) -> None:
    line = one_line(
        edgeps(*args, "--out", str(tmp_path / "out"), cwd=tmp_path)
        if args[0] == "demo"
        else edgeps(*args, cwd=tmp_path)
    )
    assert expected in line, line
    assert not (tmp_path / "out").exists()  # no broker started, no data written


def test_a_port_in_use_is_one_line(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line(edgeps("ps", "--metrics-port", str(port), "--broker", "127.0.0.1:1", cwd=tmp_path))
    assert f"{port}" in line and "in use" in line.lower(), line


def test_verbose_shows_the_traceback(tmp_path) -> None:
    result = edgeps("-v", "ps", "--codec", "qsgd:abc", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_no_broker_at_the_address_is_said_at_once(tmp_path) -> None:
    import numpy as np

    np.savez(tmp_path / "d.npz", x=np.zeros((4, 3), np.float32), y=np.array([0, 1, 0, 1]))
    for args in (["ps"], ["client", "--device", "d1", "--data", "d.npz"]):
        result = edgeps(*args, "--broker", "127.0.0.1:1", cwd=tmp_path)
        line = one_line(result)
        assert "cannot reach the MQTT broker at 127.0.0.1:1: Connection refused" in line, line
        assert float(line.rsplit("(after ", 1)[1].split(" s)")[0]) < 5  # not after a connection timeout


def _options(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {role}", a) for role, a in _options(sub))
        elif action.option_strings and action.dest not in ("help", "version"):
            yield action.option_strings[-1], action


def test_every_option_has_help_and_shows_its_default() -> None:
    from edgeps.cli import build_parser

    missing, undefaulted = [], []
    for where, action in _options(build_parser()):
        if not action.help:
            missing.append(where)
        elif action.default not in (None, False, [], "") and "default" not in action.help:
            undefaulted.append(where)
    assert missing == [] and undefaulted == []


def test_version(tmp_path) -> None:
    import edgeps

    result = edgeps_cli = subprocess.run(
        [sys.executable, "-m", "edgeps.cli", "--version"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0 and edgeps_cli.stdout.strip() == f"edgeps {edgeps.__version__}"


def test_the_demo_refuses_a_metrics_port_in_use_before_starting_anything(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = edgeps("demo", "--metrics-port", str(port), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert f"--metrics-port {port}: Address already in use" in one_line(result)
    assert not (tmp_path / "out").exists()


def test_logs_as_json_lines_for_loki_or_elk(tmp_path) -> None:
    import json

    result = edgeps("--log-format", "json", "ps", "--codec", "nope", cwd=tmp_path)
    records = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(records) == 1
    assert records[0]["level"] == "error" and records[0]["logger"] == "edgeps"
    assert records[0]["message"].startswith("--codec 'nope': unknown codec") and records[0]["time"].endswith("+00:00")
    quiet = edgeps("--log-level", "error", "ps", "--broker", "127.0.0.1:1", cwd=tmp_path)
    assert " INFO " not in quiet.stderr and " ERROR " in quiet.stderr


@pytest.mark.parametrize(
    ("flag", "where", "expected"),
    [
        ("--save-model", "runs/x/model.npz", "--save-model runs/x/model.npz: no folder runs/x to write it in"),
        ("--report", "runs/x/report.json", "--report runs/x/report.json: no folder runs/x to write it in"),
        ("--checkpoint", "runs/x/state.ckpt", "--checkpoint runs/x/state.ckpt: no folder runs/x to write it in"),
        ("--report", ".", "--report .: a folder, not a file"),
    ],
)
def test_an_output_the_server_could_not_write_is_refused_before_it_waits_for_a_device(
    tmp_path, flag, where, expected
) -> None:
    # no broker listens on port 9: had the check come after training, the job would be lost for it
    line = one_line(edgeps("ps", "--broker", "127.0.0.1:9", flag, where, cwd=tmp_path))
    assert expected in line, line
