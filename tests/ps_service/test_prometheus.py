"""The server's HTTP endpoint: the dashboard (where an operator types a password) only over HTTPS
or on loopback; /metrics anywhere."""

from __future__ import annotations

import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest

from broker.deploy.certs import make_ca, make_certificate
from ps_service.io.prometheus import MetricsEndpoint


def fetch(url: str, context: ssl.SSLContext | None = None) -> int:
    try:
        return urllib.request.urlopen(url, timeout=5, context=context).status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_off_loopback_the_dashboard_needs_https(tmp_path) -> None:
    """1.0 served the page, and took the operator's password in its URL, over plain HTTP anywhere."""
    plain = MetricsEndpoint(0, host="0.0.0.0")
    try:
        assert fetch(f"http://127.0.0.1:{plain.port}/metrics") == 200
        assert fetch(f"http://127.0.0.1:{plain.port}/") == 404 and not plain.dashboard
    finally:
        plain.close()
    make_ca(tmp_path)
    make_certificate(tmp_path, "web", ["127.0.0.1"])
    secure = MetricsEndpoint(0, host="0.0.0.0", tls_cert=str(tmp_path / "web.crt"), tls_key=str(tmp_path / "web.key"))
    try:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        assert fetch(f"https://127.0.0.1:{secure.port}/", context) == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            fetch(f"http://127.0.0.1:{secure.port}/")  # no plain HTTP on it
    finally:
        secure.close()
    local = MetricsEndpoint(0)
    try:
        assert fetch(f"http://127.0.0.1:{local.port}/") == 200
    finally:
        local.close()


def test_the_page_never_takes_a_password_from_its_address() -> None:
    from ps_service.io.prometheus import DASHBOARD

    script = (DASHBOARD / "app.js").read_text()
    assert 'params.get("password")' not in script and 'params.get("username")' not in script


def test_the_page_uses_the_vendored_mqtt_js_with_its_licence_and_version() -> None:
    import re

    from ps_service.io.prometheus import DASHBOARD, PAGES

    vendor = DASHBOARD / "vendor"
    version = re.search(r"\| `mqtt\.min\.js` \|[^|]*\| (\d+\.\d+\.\d+) \| MIT", (vendor / "README.md").read_text())
    assert version is not None and version.group(1) in (vendor / "mqtt.min.js").read_text()
    assert "The MIT License" in (vendor / "mqtt-LICENSE.md").read_text()
    assert '<script src="vendor/mqtt.min.js">' in (DASHBOARD / "index.html").read_text()
    assert PAGES["/vendor/mqtt.min.js"] == "vendor/mqtt.min.js" and not (DASHBOARD / "mqtt-lite.js").exists()
    assert (
        "mqtt.connect(" in (DASHBOARD / "app.js").read_text()
        and "reconnectPeriod" in (DASHBOARD / "app.js").read_text()
    )


def test_the_server_tells_the_page_its_job_and_broker() -> None:
    import json
    import urllib.request

    endpoint = MetricsEndpoint(0, page={"job": "j1", "broker": "ws://10.0.0.2:9001"})
    try:
        config = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/config.json").read())
        assert config == {"job": "j1", "broker": "ws://10.0.0.2:9001"}
        script = urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/vendor/mqtt.min.js").read()
        assert len(script) > 100_000
    finally:
        endpoint.close()


def test_idle_connections_block_no_one_and_cannot_exhaust_the_threads(tmp_path, monkeypatch) -> None:
    """The audit: with HTTPS on, the TLS handshake ran in the accept loop with no timeout (one idle
    TCP connection blocked /metrics and the dashboard for everyone); each idle HTTP connection held
    a thread for ever (500 exhausted the threads)."""
    import socket

    import ps_service.io.prometheus as prometheus

    monkeypatch.setattr(prometheus, "TIMEOUT_S", 1.0)
    make_ca(tmp_path)
    make_certificate(tmp_path, "web", ["127.0.0.1"])
    secure = MetricsEndpoint(0, tls_cert=str(tmp_path / "web.crt"), tls_key=str(tmp_path / "web.key"))
    idle = [socket.create_connection(("127.0.0.1", secure.port)) for _ in range(prometheus.MAX_CONNECTIONS + 20)]
    try:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        deadline = time.monotonic() + 3 * prometheus.TIMEOUT_S
        while fetch_or_none(f"https://127.0.0.1:{secure.port}/metrics", context) != 200:
            assert time.monotonic() < deadline, "/metrics never answered beside idle clients"
        assert threading.active_count() < prometheus.MAX_CONNECTIONS + 20
    finally:
        for conn in idle:
            conn.close()
        secure.close()


def fetch_or_none(url: str, context: ssl.SSLContext) -> int | None:
    try:
        return fetch(url, context)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
