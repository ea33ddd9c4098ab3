"""The server's HTTP endpoint: Prometheus metrics at ``/metrics`` (the latest metrics record in the
text exposition format) and the dashboard (a static page that talks MQTT over WebSockets) at ``/``."""

from __future__ import annotations

import ipaddress
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from schemas.messages import Metrics


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def exposition(metrics: Metrics | None) -> str:
    """The text format (version 0.0.4) for one metrics record; only the help lines without one."""
    families = [
        ("edgeps_version", "gauge", "global model version"),
        ("edgeps_accuracy", "gauge", "held-out accuracy of the evaluated version (tasks that measure it)"),
        ("edgeps_metric", "gauge", "the task's metrics on the held-out set, by metric"),
        ("edgeps_loss", "gauge", "held-out loss of the evaluated version"),
        ("edgeps_commits_total", "counter", "commits received, accepted or not"),
        ("edgeps_applied_total", "counter", "commits folded into the model"),
        ("edgeps_rejected_total", "counter", "messages refused, by reason"),
        ("edgeps_bytes_up_total", "counter", "commit payload bytes received"),
        ("edgeps_bytes_down_total", "counter", "parameter payload bytes delivered"),
        ("edgeps_devices_online", "gauge", "devices online"),
        ("edgeps_push_every", "gauge", "local steps per commit, by device"),
        ("edgeps_eval_seconds_total", "counter", "server seconds spent evaluating"),
        ("edgeps_server_step", "gauge", "the last aggregate's step (1: plain averaging; more: extrapolated)"),
        ("edgeps_elapsed_seconds", "gauge", "seconds since the job started"),
        ("edgeps_finished", "gauge", "1 once the job finished"),
    ]
    lines: list[str] = []
    for name, kind, text in families:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        if metrics is None:
            continue
        job = f'job="{_label(metrics.job)}"'
        if name == "edgeps_rejected_total":
            lines += [f'{name}{{{job},reason="{_label(r)}"}} {n}' for r, n in sorted(metrics.rejected.items())]
        elif name == "edgeps_metric":
            lines += [f'{name}{{{job},metric="{_label(m)}"}} {v}' for m, v in metrics.values.items()]
        elif name == "edgeps_accuracy":
            lines += [] if metrics.accuracy is None else [f"{name}{{{job}}} {metrics.accuracy}"]
        elif name == "edgeps_push_every":
            lines += [f'{name}{{{job},device="{_label(d)}"}} {p}' for d, p in sorted(metrics.push_every.items())]
        else:
            value = {
                "edgeps_version": metrics.version,
                "edgeps_loss": metrics.loss,
                "edgeps_commits_total": metrics.commits,
                "edgeps_applied_total": metrics.applied,
                "edgeps_bytes_up_total": metrics.bytes_up,
                "edgeps_bytes_down_total": metrics.bytes_down,
                "edgeps_devices_online": metrics.devices_online,
                "edgeps_eval_seconds_total": metrics.eval_s,
                "edgeps_server_step": metrics.server_step,
                "edgeps_elapsed_seconds": metrics.elapsed_s,
                "edgeps_finished": int(metrics.finished),
            }[name]
            lines.append(f"{name}{{{job}}} {value}")
    return "\n".join(lines) + "\n"


DASHBOARD = Path(__file__).with_name("dashboard")
PAGES = {"/": "index.html", "/index.html": "index.html", "/app.js": "app.js", "/mqtt-lite.js": "mqtt-lite.js"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class MetricsEndpoint:
    """Serves ``/metrics`` and the dashboard on ``host:port`` from a thread; ``update`` sets the
    metrics record ``/metrics`` shows. The dashboard, where an operator types a password, is
    served only over HTTPS (``tls_cert`` and ``tls_key``) or on a loopback address; elsewhere only
    ``/metrics`` is (a Prometheus scrape carries no secret)."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", tls_cert: str | None = None, tls_key: str | None = None
    ) -> None:
        self.latest: Metrics | None = None
        self.dashboard = bool(tls_cert) or is_loopback(host)
        self.scheme = "https" if tls_cert else "http"
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body, kind = exposition(endpoint.latest).encode(), "text/plain; version=0.0.4; charset=utf-8"
                elif path in PAGES and endpoint.dashboard:  # a fixed list of files: nothing else is reachable
                    page = DASHBOARD / PAGES[path]
                    body, kind = page.read_bytes(), TYPES[page.suffix]
                else:
                    self.send_error(404, "/metrics, or the dashboard at / (over HTTPS, or on loopback)")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes are not news
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        if tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls_cert, tls_key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def update(self, metrics: Metrics) -> None:
        self.latest = metrics

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
