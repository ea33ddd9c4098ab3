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
            assert service["image"].split(":")[0] in ("eclipse-mosquitto", "prom/prometheus", "grafana/grafana"), name
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


def test_prometheus_and_grafana_are_provisioned_for_what_the_server_exports() -> None:
    """The compose file's Prometheus scrapes the server, Grafana's data source is that Prometheus, and
    every series the provisioned dashboard queries is one the server's /metrics has."""
    import json

    from prometheus_client import generate_latest

    from ps_service.io.prometheus import MetricsEndpoint
    from schemas.messages import Metrics

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())["scrape_configs"][0]
    ps_port = compose["ps"]["command"][compose["ps"]["command"].index("--metrics-port") + 1]
    assert scrape["static_configs"][0]["targets"] == [f"ps:{ps_port}"]
    provisioning = ROOT / "docker" / "grafana" / "provisioning"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "edgeps.yml").read_text())["providers"][0]
    mounted = dict(v.split(":")[:2][::-1] for v in compose["grafana"]["volumes"])
    folder = ROOT / mounted[provider["options"]["path"]].removeprefix("./")
    dashboard = json.loads((folder / "edgeps.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b((?:edgeps|process)_[a-z_]+)", target["expr"])
    }
    assert all(p["datasource"]["uid"] == source["uid"] for p in dashboard["panels"])
    endpoint = MetricsEndpoint(0)
    try:
        endpoint.update(
            Metrics(
                job="j",
                version=3,
                round=3,
                pace="bsp",
                metric="mae",
                value=0.5,
                values={"mae": 0.5},
                accuracy=None,
                loss=0.4,
                commits=9,
                applied=8,
                rejected={"malformed": 1, "invalid_command": 1},
                bytes_up=10,
                bytes_down=20,
                devices_online=2,
                elapsed_s=1.0,
                push_every={"a": 4},
            )
        )
        exported = set(re.findall(r"^([a-z_]+)(?:\{| )", generate_latest(endpoint.registry).decode(), flags=re.M))
    finally:
        endpoint.close()
    assert len(queried) >= 12 and queried <= exported, queried - exported


def test_every_package_goes_into_the_wheel() -> None:
    """0.1's explicit package list left edgeps.cli, schemas.codecs, ps_service.paces and edgeps.bench out of
    a non-editable install (the Docker images, pip install edgeps)."""
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = ("edgeps", "schemas", "ps_service", "edge_client", "learning", "broker")
    on_disk = {
        ".".join(path.parent.relative_to(ROOT).parts) for top in tops for path in (ROOT / top).rglob("*.py")
    }  # every folder of Python files, with or without its __init__.py
    assert {"edgeps.cli", "schemas.codecs", "ps_service.paces", "edgeps.bench"} <= on_disk
    assert on_disk <= set(find_packages(where=str(ROOT), include=include))
