"""A newcomer's mistakes, met as a user meets them: the command, its exit status, its one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest


def edgeps(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeps.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)  # fmt: skip


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
    ],
)
def test_a_bad_option_is_one_line_naming_it_before_anything_starts(tmp_path, args, expected) -> None:
    line = one_line(edgeps(*args, "--out", str(tmp_path / "out"), cwd=tmp_path) if args[0] == "demo"
                    else edgeps(*args, cwd=tmp_path))  # fmt: skip
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
