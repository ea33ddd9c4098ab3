"""Start a broker for a job: Mosquitto with broker/mosquitto.conf, or the embedded fallback."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("edgeps.broker")

CONFIG = Path(__file__).with_name("mosquitto.conf")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Return once ``host:port`` accepts TCP connections; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"broker exited with code {process.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def render_config(port: int, host: str, data_dir: Path, template: Path = CONFIG, ws_port: int | None = None) -> str:
    """The project's config with the listener and persistence folder put in place (and the
    WebSockets listener, if the config has one, moved to ``ws_port``)."""
    text = template.read_text()
    ws = re.compile(r"(?m)^listener\s+\d+(\s+\S+)?\s*\n(protocol\s+websockets\s*)$")
    text = ws.sub(lambda m: f"listener {ws_port} {host}\n{m.group(2)}", text) if ws_port else ws.sub("", text)
    text, listeners = re.subn(r"(?m)^listener\s+\d+(\s+\S+)?\s*$", f"listener {port} {host}", text, count=1)
    text, stores = re.subn(r"(?m)^persistence_location\s+.*$", f"persistence_location {data_dir}/", text)
    if listeners != 1 or stores != 1:
        raise ValueError(f"{template} needs one 'listener' and one 'persistence_location' line")
    return text


@dataclass
class BrokerProcess:
    """A running broker; ``stop()`` ends it."""

    host: str
    port: int
    process: subprocess.Popen
    kind: str
    workdir: Path
    ws_port: int | None = None  # MQTT over WebSockets (Mosquitto with a websockets listener)
    _owned_dir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._owned_dir is not None:
            self._owned_dir.cleanup()

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_broker(
    port: int | None = None,
    host: str = "127.0.0.1",
    workdir: Path | None = None,
    embedded: bool | None = None,
    timeout: float = 10.0,
    template: Path = CONFIG,
) -> BrokerProcess:
    """Start Mosquitto with the project's config (or, if it is not installed, the embedded broker).

    ``embedded=None`` picks Mosquitto when it is on PATH (or in /usr/sbin). ``template``: another
    Mosquitto config to start from, e.g. the one ``edgeps broker init`` wrote (its first
    listener and its persistence folder are moved to ``port`` and ``workdir``).
    """
    port = port or free_port(host)
    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="edgeps-broker-")
        workdir = Path(owned.name)
    workdir.mkdir(parents=True, exist_ok=True)
    mosquitto = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
    if embedded is None:
        embedded = mosquitto is None
    if embedded:
        why = "Mosquitto is not installed" if mosquitto is None else "embedded broker requested"
        log.warning(
            "%s: starting the embedded amqtt broker (MQTT 3.1.1 only, about 4x slower, no queue for absent "
            "subscribers). Install Debian's 'mosquitto' package for real use.",
            why,
        )
        cmd = [sys.executable, "-m", "broker.embedded", "--host", host, "--port", str(port)]
        kind = "amqtt"
    else:
        conf = workdir / "mosquitto.conf"
        ws_port = free_port(host) if "protocol websockets" in template.read_text() else None
        text = render_config(port, host, workdir, template, ws_port)
        if os.geteuid() == 0:
            # Started as root, Mosquitto would drop to the 'mosquitto' user, which cannot write
            # the database into our folders: sessions and queued messages would silently not
            # survive a restart. A local broker run by root stays root; deployments use their
            # own service account and config.
            text += "\n# added by edgeps: started as root, keep the identity that owns the data folder\nuser root\n"
        conf.write_text(text)
        cmd = [mosquitto, "-c", str(conf)]
        kind = "mosquitto"
    stderr = open(workdir / f"{kind}.log", "ab")  # noqa: SIM115 - owned by the child process
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    stderr.close()
    broker = BrokerProcess(host, port, process, kind, workdir, ws_port if not embedded else None, owned)
    try:
        wait_for_port(host, port, timeout, process)
    except Exception:
        broker.stop()
        raise
    log.info("%s listening on %s:%d", kind, host, port)
    return broker
