"""The real jobs of ``edgeps bench embedded``: the demo task over Mosquitto with Python devices, C
devices (edgeps-device) or firmware images under QEMU; best accuracy, refusals, peak RSS per device."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from broker.launcher import BrokerProcess
from edgeps.report import read_report
from learning.prepare import ShardPaths


def _hwm_kib(pid: int) -> int | None:
    """The peak RSS of a running process (VmHWM, since its exec), or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("VmHWM:")[1].split()[0]) if "VmHWM:" in status else None


def real_job(
    kind: str,
    device_bin: Path | None,
    broker: BrokerProcess,
    shards: ShardPaths,
    workdir: Path,
    rounds: int,
    codecs: tuple[str, str],
    firmware: dict[int, Path] | None = None,
    pace: str = "bsp",
) -> dict[str, Any]:
    """A job of the demo task in ``pace`` with ``kind`` devices (``c``: edgeps-device, ``python``:
    edgeps client; ``firmware``: edgeps client but device i of ``firmware``, the image in that
    folder under QEMU), commits and pulls in ``codecs``; best accuracy, commits refused, peak RSS
    per device."""
    firmware = firmware or {}
    workdir.mkdir(parents=True, exist_ok=True)
    job, report = f"embedded-{kind}-{pace}-{codecs[0]}-{codecs[1]}", workdir / "metrics.json"
    common = ["--broker", f"{broker.host}:{broker.port}", "--job", job]
    from edgeps.localjob import spawn

    server = spawn(
        [
            "ps",
            *common,
            "--pace",
            pace,
            "--rounds",
            str(rounds),
            "--min-devices",
            str(len(shards.devices)),
            "--eval-data",
            str(shards.holdout),
            "--report",
            str(report),
            "--codec",
            codecs[0],
            "--pull-codec",
            codecs[1],
        ],
        workdir / "ps.log",
    )
    devices = []
    for i, shard in enumerate(shards.devices):
        log = workdir / f"dev-{i}.log"
        if i in firmware:
            from edgeps.firmware import run_image

            devices.append(run_image(firmware[i], broker.host, broker.port, log))
            continue
        if kind == "c":
            args = [*common, "--device", f"dev-{i}", "--data", str(shard.with_suffix(".epsf")), "--seed", str(i)]
            devices.append(spawn(args, log, program=device_bin))
        else:
            devices.append(
                spawn(["client", *common, "--device", f"dev-{i}", "--data", str(shard), "--seed", str(i)], log)
            )
    rss = [0] * len(devices)  # sampled while they run (wait4's maxrss would count the forking parent)
    try:
        deadline = time.monotonic() + 600
        while server.poll() is None or any(d.poll() is None for d in devices):
            for i, device in enumerate(devices):
                rss[i] = max(rss[i], _hwm_kib(device.pid) or 0)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not end within 600 s; see {workdir}")
            time.sleep(0.05)
        if server.returncode != 0:
            raise RuntimeError(f"the parameter server failed; see {workdir / 'ps.log'}")
    finally:
        for process in [server, *devices]:
            if process.poll() is None:
                process.kill()
    history = read_report(report)["metrics"]
    final = history[-1]
    return {
        "devices": kind,
        "pace": pace,
        "codecs": "/".join(codecs),
        "best_accuracy": max(m["accuracy"] for m in history),
        "final_accuracy": final["accuracy"],
        "versions": final["version"],
        "applied": final["applied"],
        "rejected": final["rejected"],
        "accuracy_by_version": [(m["version"], m["accuracy"]) for m in history],
        "peak_rss_kib": rss,
        "exit_codes": [d.returncode for d in devices],
    }
