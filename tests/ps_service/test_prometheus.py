"""The server's HTTP endpoint: the dashboard (where an operator types a password) only over HTTPS
or on loopback; /metrics anywhere."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from broker.secure import make_ca, make_certificate
from ps_service.prometheus import MetricsEndpoint


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
    from ps_service.prometheus import DASHBOARD

    script = (DASHBOARD / "app.js").read_text()
    assert 'params.get("password")' not in script and 'params.get("username")' not in script
