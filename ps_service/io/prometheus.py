"""The server's HTTP endpoint: Prometheus metrics at ``/metrics`` (the latest metrics record and the
process's CPU, memory and file descriptors, rendered by prometheus_client) and the dashboard (a static
page that talks MQTT over WebSockets) at ``/``."""

from __future__ import annotations

import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from schemas.messages import Metrics, RejectReason


class JobCollector:
    """The newest metrics record as Prometheus metric families (prometheus_client renders them).

    No ``job`` label: Prometheus's own ``job`` (the scrape target's) would turn it into
    ``exported_job``; ``edgeps_job_info`` names the job instead. Refused operator commands are
    counted apart from refused commits and statuses."""

    def __init__(self) -> None:
        self.latest: Metrics | None = None

    def collect(self) -> Iterator[Metric]:
        m = self.latest
        if m is None:
            return
        yield InfoMetricFamily(
            "edgeps_job",
            "the job this server serves",
            value={"job_name": m.job, "pace": m.pace, "metric": m.metric, "frequency": m.frequency},
        )
        gauges = {
            "edgeps_version": ("global model version", m.version),
            "edgeps_devices_online": ("devices online", m.devices_online),
            "edgeps_loss": ("held-out loss of the evaluated version", m.loss),
            "edgeps_server_step": ("the last aggregate's step (1: plain averaging; more: extrapolated)", m.server_step),
            "edgeps_elapsed_seconds": ("seconds since the job started", m.elapsed_s),
            "edgeps_finished": ("1 once the job finished", int(m.finished)),
        }
        if m.accuracy is not None:
            gauges["edgeps_accuracy"] = ("held-out accuracy of the evaluated version", m.accuracy)
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(name, text, value=value)
        values = GaugeMetricFamily("edgeps_metric", "the task's metrics on the held-out set", labels=["metric"])
        for metric, value in m.values.items():
            values.add_metric([metric], value)
        yield values
        push = GaugeMetricFamily("edgeps_push_every", "local steps per commit, by device", labels=["device"])
        for device, steps in sorted(m.push_every.items()):
            push.add_metric([device], steps)
        yield push
        counters = {
            "edgeps_commits": ("commits received, accepted or not", m.commits),
            "edgeps_applied": ("commits folded into the model", m.applied),
            "edgeps_bytes_up": ("commit payload bytes received", m.bytes_up),
            "edgeps_bytes_down": ("parameter payload bytes delivered", m.bytes_down),
            "edgeps_eval_seconds": ("server seconds spent evaluating", m.eval_s),
            "edgeps_rejected_commands": ("operator commands refused", m.rejected.get(COMMANDS, 0)),
        }
        for name, (text, value) in counters.items():
            yield CounterMetricFamily(name, text, value=value)
        rejected = CounterMetricFamily("edgeps_rejected", "commits and statuses refused, by reason", labels=["reason"])
        for reason, count in sorted(m.rejected.items()):
            if reason != COMMANDS:
                rejected.add_metric([reason], count)
        yield rejected


COMMANDS = RejectReason.INVALID_COMMAND.value


DASHBOARD = Path(__file__).with_name("dashboard")
PAGES = {
    "/": "index.html",
    "/index.html": "index.html",
    "/app.js": "app.js",
    "/vendor/mqtt.min.js": "vendor/mqtt.min.js",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}


#: Connections served at once; more are closed on arrival. Each has ``TIMEOUT_S`` for its TLS handshake
#: and for each read: an idle or half-open client never holds a thread (or the accept loop) for long.
MAX_CONNECTIONS = 64
TIMEOUT_S = 10.0


class _Server(ThreadingHTTPServer):
    """A threading HTTP server whose TLS handshake happens in each connection's own thread, under a
    timeout (not in the accept loop, where one idle TCP connection blocked every other client),
    with at most ``MAX_CONNECTIONS`` connections at once (each idle one used to hold a thread for ever)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of clients waits for accept, not for SYN retries

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], context: ssl.SSLContext | None
    ) -> None:
        self.context = context
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: this client is closed at once, the others go on
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(TIMEOUT_S)
            if self.context is not None:
                request = self.context.wrap_socket(request, server_side=True)  # the handshake, here, timed
            self.finish_request(request, client_address)
        except (OSError, ssl.SSLError):
            pass  # a client that stalls, leaves or speaks no TLS: its connection ends, nothing else
        finally:
            self.shutdown_request(request)
            self.slots.release()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


HISTORY_POINTS = 2000  # the most points of the job's curves the page is handed


class MetricsEndpoint:
    """Serves ``/metrics`` and the dashboard on ``host:port`` from a thread; ``update`` sets the
    metrics record ``/metrics`` shows. The dashboard, where an operator types a password, is
    served only over HTTPS (``tls_cert`` and ``tls_key``) or on a loopback address; elsewhere only
    ``/metrics`` is (a Prometheus scrape carries no secret). ``page`` (``job``, ``broker``: the
    broker's WebSockets URL) is the page's ``config.json``: where it finds its job."""

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        tls_cert: str | None = None,
        tls_key: str | None = None,
        page: dict[str, str] | None = None,
    ) -> None:
        self.page = page or {}
        self.history: list[list[float]] = []  # [elapsed_s, value, loss] of each record, for the page's charts
        self.collector = JobCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.dashboard = bool(tls_cert) or is_loopback(host)
        self.scheme = "https" if tls_cert else "http"
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            timeout = TIMEOUT_S  # each read: an idle connection ends

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body, kind = generate_latest(endpoint.registry), CONTENT_TYPE_LATEST
                elif path == "/config.json" and endpoint.dashboard:  # where the page finds its job and broker
                    body, kind = json.dumps(endpoint.page).encode(), "application/json"
                elif path == "/history.json" and endpoint.dashboard:  # the job's curves so far
                    body, kind = json.dumps(list(endpoint.history)).encode(), "application/json"
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

        context = None
        if tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls_cert, tls_key)
        self._server = _Server((host, port), Handler, context)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def update(self, metrics: Metrics) -> None:
        """Show ``metrics`` on ``/metrics`` and add it to the page's history: one point a record,
        thinned to every other point whenever it passes ``HISTORY_POINTS`` (the whole job, coarser)."""
        self.collector.latest = metrics
        value = metrics.value if metrics.value is not None else metrics.accuracy
        if value is None or (self.history and self.history[-1][0] == metrics.elapsed_s):
            return
        history = [*self.history, [metrics.elapsed_s, value, metrics.loss]]
        if len(history) > HISTORY_POINTS:
            history = [*history[:-1:2], history[-1]]  # every other point, and the newest
        self.history = history  # replaced whole: a page's request reads the old list or the new

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
