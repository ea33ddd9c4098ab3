"""The distribution, the container files and the docs reference things that exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_file_is_valid_and_its_files_exist() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"broker", "data", "ps", "dev-00"} <= set(services)
    for name, service in services.items():
        if "build" in service:
            dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
            assert dockerfile.exists(), name
            for source in re.findall(r"^COPY (\S+)", dockerfile.read_text(), flags=re.M):
                assert (ROOT / source).exists(), (name, source)
        else:
            assert service["image"].startswith("eclipse-mosquitto:2"), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in compose["volumes"] or (ROOT / source).exists(), (name, volume)
        deps = service.get("depends_on", [])
        assert all(dep in services for dep in deps), name
    for name in (n for n in services if n.startswith("dev-")):
        command = services[name]["command"]
        assert services[name]["build"]["dockerfile"] == "docker/device.Dockerfile"
        assert command[command.index("--device") + 1] == name  # each device its own id
    device_image = (ROOT / "docker" / "device.Dockerfile").read_text()
    assert '".[device,tflite]"' in device_image and "server" not in device_image.split("RUN")[-1]
    broker_conf = (ROOT / "broker" / "mosquitto-compose.conf").read_text()
    assert "protocol websockets" in broker_conf and "max_queued_messages 0" in broker_conf


def test_device_extra_stays_light() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    device = " ".join(project["optional-dependencies"]["device"]).lower()
    for heavy in ("tensorflow", "scikit", "matplotlib", "torch"):
        assert heavy not in device


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash .ci/run" in readme
    assert "python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_a_device_runs_without_tensorflow_or_scikit_learn() -> None:
    """What `edgeps client` imports, in a fresh interpreter: none of the server's heavy packages."""
    import subprocess
    import sys

    code = (
        "import sys, edge_client.core, edge_client.mqtt, edge_client.tflite, edge_client.cache, edgeps.cli;"
        "heavy = [m for m in ('tensorflow', 'sklearn', 'matplotlib') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
