"""``edgeps bench footprint``: what a gateway carries. Installs ``edgeps[device]`` into a
fresh virtual environment (and then a TFLite runtime), measures it on disk, and runs a real
client from it against a short job over Mosquitto, once per backend, for its peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path
from typing import Any

from edgeps.bench.common import Say
from edgeps.tables import Table

ROOT = Path(__file__).resolve().parents[2]  # the repository
#: Runs ``edgeps`` in the device environment and writes its peak RSS (KiB) to argv[1]. VmHWM,
#: not getrusage: a child forked from this (TensorFlow-laden) process inherits the parent's
#: ru_maxrss across exec, which would report ours instead of the client's.
_RSS_WRAPPER = (
    "import resource, sys; from edgeps.cli import main; out = sys.argv[1]; code = main(sys.argv[2:]); "
    "status = open('/proc/self/status').read().split('VmHWM:')[1].split()[0] if sys.platform == 'linux' "
    "else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; open(out, 'w').write(str(status)); sys.exit(code)"
)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _site_packages(env: Path) -> Path:
    return next((env / "lib").glob("python*/site-packages"))


def _pip(env: Path, *args: str) -> None:
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True)


def _distributions(env: Path) -> set[str]:
    out = subprocess.run(
        [str(env / "bin" / "python"), "-m", "pip", "list", "--format=json"], check=True, capture_output=True, text=True
    ).stdout
    return {d["name"].lower() for d in json.loads(out)}


def _client_peak_rss(env: Path, backend: str, workdir: Path, rounds: int, say: Say) -> dict[str, Any]:
    """Run one device from ``env`` through a ``rounds``-version job served from this process."""
    from broker.client import BrokerAddress
    from broker.launcher import start_broker
    from learning.data import Dataset, load_digits
    from learning.model import init_mlp
    from learning.prepare import prepare_shards
    from ps_service.config import ServerConfig
    from ps_service.evaluator import Evaluator
    from ps_service.io.mqtt import connect_server, serve
    from ps_service.server.core import ServerCore

    shards = prepare_shards(load_digits(), workdir / "data", devices=2, alpha=0.5, seed=0)
    holdout = Dataset.load(shards.holdout)
    params = init_mlp([holdout.x.shape[1], 64, holdout.classes], seed=0)
    artifact = None
    if backend == "tflite":
        from ps_service.export import build_artifact

        artifact = build_artifact(params, batch_size=32)
    job = f"footprint-{backend}"
    config = ServerConfig(job=job, pace="bsp", rounds=rounds, min_devices=1)
    with start_broker(workdir=workdir / "broker") as broker:
        address = BrokerAddress(broker.host, broker.port)
        core = ServerCore(config, params, Evaluator(holdout, clock=time.perf_counter), artifact=artifact)
        transport = connect_server(core, address)
        server = threading.Thread(target=serve, args=(core, transport), daemon=True)
        server.start()
        rss_file = workdir / f"rss-{backend}"
        client = [
            str(env / "bin" / "python"),
            "-c",
            _RSS_WRAPPER,
            str(rss_file),
            "client",
            "--broker",
            f"{broker.host}:{broker.port}",
            "--job",
            job,
            "--device",
            "gw-0",
            "--data",
            str(shards.devices[0]),
            "--backend",
            backend,
            "--cache",
            str(workdir / "cache"),
        ]
        env_vars = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
        done = subprocess.run(client, capture_output=True, text=True, timeout=300, env=env_vars, cwd=workdir)
        server.join(timeout=30)
        transport.close()
    if done.returncode != 0 or not rss_file.exists():
        raise RuntimeError(f"the {backend} client failed: {done.stderr[-2000:]}")
    best = max(m.accuracy for m in core.history if m.accuracy is not None)
    peak_mib = int(rss_file.read_text()) / 1024
    say(f"  {backend}: {core.store.version} versions, best accuracy {best:.4f}, peak RSS {peak_mib:.1f} MiB")
    return {"backend": backend, "peak_rss_mib": round(peak_mib, 1), "best_accuracy": round(best, 4)}


def bench_footprint(rounds: int = 20, say: Say = print) -> dict[str, Any]:
    """Install the device package fresh, measure it, run a client per backend; return the report."""
    with tempfile.TemporaryDirectory(prefix="edgeps-footprint-") as tmp:
        work = Path(tmp)
        env = work / "device-env"
        say(f"creating a fresh virtual environment and installing edgeps[device] from {ROOT} ...")
        venv.EnvBuilder(with_pip=True).create(env)
        empty = _size(_site_packages(env))
        _pip(env, f"{ROOT}[device]")
        device = _size(_site_packages(env)) - empty
        installed = _distributions(env)
        heavy = sorted(installed & {"tensorflow", "tensorflow-cpu", "scikit-learn", "matplotlib", "torch"})
        say(f"  edgeps[device]: {device / 2**20:.1f} MiB in site-packages; heavy packages: {heavy or 'none'}")
        runs = [_client_peak_rss(env, "numpy", work / "numpy", rounds, say)]
        say("installing a TFLite runtime (ai-edge-litert) ...")
        _pip(env, "ai-edge-litert")
        with_runtime = _size(_site_packages(env)) - empty
        say(f"  edgeps[device] + ai-edge-litert: {with_runtime / 2**20:.1f} MiB")
        runs.append(_client_peak_rss(env, "tflite", work / "tflite", rounds, say))
    return {
        "python": sys.version.split()[0],
        "install": {
            "device_mib": round(device / 2**20, 1),
            "device_with_tflite_mib": round(with_runtime / 2**20, 1),
            "heavy_packages": heavy,
            "distributions": sorted(installed),
        },
        "clients": runs,
    }


def format_footprint(report: dict[str, Any]) -> Table:
    install, clients = report["install"], report["clients"]
    table = Table(["what", "size on disk", "client peak RSS", "best acc"])
    table.add(
        "edgeps[device] (numpy backend)",
        f"{install['device_mib']:.1f} MiB",
        f"{clients[0]['peak_rss_mib']:.1f} MiB",
        f"{clients[0]['best_accuracy']:.4f}",
    )
    table.add(
        "+ ai-edge-litert (tflite backend)",
        f"{install['device_with_tflite_mib']:.1f} MiB",
        f"{clients[1]['peak_rss_mib']:.1f} MiB",
        f"{clients[1]['best_accuracy']:.4f}",
    )
    heavy = install["heavy_packages"] or "none"
    table.after += ["", f"TensorFlow, scikit-learn, matplotlib or torch installed: {heavy}"]
    return table
