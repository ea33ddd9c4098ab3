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
        port: int = s.getsockname()[1]
        return port


def wait_for_port(host: str, port: int, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
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


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (a bind, as a broker would make it, fails)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Mosquitto: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port`` on any address (Linux), None where /proc cannot tell."""
    inodes: set[str] = set()
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    return inodes if found else None


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the socket listening on ``port`` (Linux); None if unknown."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    try:
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return None
    return any(f"socket:[{inode}]" in links for inode in inodes)


def _socket_domain(host: str) -> str:
    """Mosquitto 2.0's WebSockets listener binds every address unless its socket domain is set."""
    return "socket_domain ipv6" if ":" in host else "socket_domain ipv4"


def render_config(port: int, host: str, data_dir: Path, template: Path = CONFIG, ws_port: int | None = None) -> str:
    """The project's config with the listener and persistence folder put in place (and the
    WebSockets listener, if the config has one, moved to ``ws_port`` on ``host``, and bound to it:
    without ``socket_domain`` Mosquitto 2.0.11 binds a WebSockets listener on every address)."""
    text = template.read_text()
    ws = re.compile(r"(?m)^listener\s+\d+(\s+\S+)?\s*\n(protocol\s+websockets\s*)\n(socket_domain\s+\S+\s*\n)?")
    if ws_port:
        text = ws.sub(lambda m: f"listener {ws_port} {host}\n{m.group(2)}\n{_socket_domain(host)}\n", text)
    else:
        text = ws.sub("", text)
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
    process: subprocess.Popen[bytes]
    kind: str
    workdir: Path
    ws_port: int | None = None  # MQTT over WebSockets (Mosquitto with a websockets listener)
    _owned_dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def listeners(self) -> list[str]:
        """Every listener, for people: ``mqtt://HOST:PORT`` and ``ws://HOST:PORT``."""
        out = [f"mqtt://{self.host}:{self.port}"]
        return out + ([f"ws://{self.host}:{self.ws_port}"] if self.ws_port else [])

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
    ws_port: int | None = None,
) -> BrokerProcess:
    """Start Mosquitto with the project's config (or, if it is not installed, the embedded broker).

    ``embedded=None`` picks Mosquitto when it is on PATH (or in /usr/sbin). ``template``: another
    Mosquitto config to start from, e.g. the one ``edgeps broker init`` wrote (its first
    listener and its persistence folder are moved to ``port`` and ``workdir``). ``ws_port``: the
    WebSockets listener's port (default: a free one). RuntimeError, naming it, if a port is taken:
    another broker holding it would otherwise serve every client instead of this one.
    """
    port = port or free_port(host)
    for taken in (port, ws_port):
        if taken and port_in_use(host, taken):
            raise RuntimeError(f"port {taken} on {host} is already in use (another broker?): choose another --port")
    owned = None
    if workdir is None:
        owned = tempfile.TemporaryDirectory(prefix="edgeps-broker-")
        workdir = Path(owned.name)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)  # the broker's database holds every queued message
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
        cmd = [sys.executable, "-m", "broker.fallback", "--host", host, "--port", str(port)]
        kind = "amqtt"
    else:
        assert mosquitto is not None  # embedded otherwise
        conf = workdir / "mosquitto.conf"
        ws_port = (ws_port or free_port(host)) if "protocol websockets" in template.read_text() else None
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
        for listening in (port, broker.ws_port):
            if listening:
                wait_for_port(host, listening, timeout, process)
                if listens(process.pid, listening) is False:  # someone else answered on the port
                    raise RuntimeError(f"port {listening} on {host} is held by another process; see {workdir}")
    except Exception:
        broker.stop()
        raise
    log.info("%s listening on %s:%d", kind, host, port)
    return broker
