"""A discrete-event driver of the same server and device cores, on a virtual clock.

Compute time per local step comes from each device's profile, transfer time from the
frame's bytes over the device's link bandwidth plus its latency; the arithmetic (local
SGD, aggregation, evaluation, encoding) is real. The broker is a lossless relay with
per-device FIFO links. Deterministic for a given scenario and seed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable
from functools import partial

from edge_client.core import DeviceCore
from edge_client.trainer import NumpyTrainer
from edgeps.scenario import RunResult, Scenario
from learning.data import Dataset, dirichlet_partition, load_digits, stratified_split
from learning.losses import get_loss
from learning.model import init_mlp
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.server.core import ServerCore
from ps_service.site.aggregator import SiteAggregator
from ps_service.site.config import SiteConfig
from schemas.messages import Metrics
from schemas.topics import Inbound, Publish

SERVER_LOG, DEVICE_LOG = logging.getLogger("edgeps.ps"), logging.getLogger("edgeps.device")


def scenario_data(scenario: Scenario, data: Dataset | None = None) -> tuple[Dataset, list[Dataset]]:
    """(held-out set, one shard per device) for the scenario."""
    train, holdout = stratified_split(data or load_digits(), scenario.holdout, scenario.seed)
    parts = dirichlet_partition(train.y, scenario.devices, scenario.alpha, scenario.seed)
    return holdout, [train.subset(p) for p in parts]


class Simulation:
    """One run of one pace on a scenario."""

    JOB = "sim"

    def __init__(self, scenario: Scenario, pace: str, data: tuple[Dataset, list[Dataset]] | None = None) -> None:
        holdout, shards = data or scenario_data(scenario)
        self.scenario = scenario
        members = {
            f"site-{k}": frozenset(f"dev-{i:02d}" for i in range(k, scenario.devices, scenario.sites))
            for k in range(scenario.sites)
        }  # device i is site i % sites's
        changes = {
            "job": self.JOB,
            "pace": pace,
            "min_devices": scenario.devices,
            "duration_s": scenario.duration_s,
            "site_devices": {k: m for k, m in members.items() if m} or None,
        }
        config = ServerConfig.model_validate({**scenario.server.model_dump(), **changes})
        loss = get_loss(config.loss)
        sizes = [holdout.x.shape[1], *scenario.hidden, loss.outputs(holdout.classes if loss.classification else 1)]
        self.server = ServerCore(
            config,
            init_mlp(sizes, scenario.seed),
            Evaluator(holdout, clock=time.perf_counter, loss=config.loss, metrics=config.metric_names),
            run=scenario.seed + 1,
        )
        self.judge = Evaluator(
            holdout, loss=config.loss, metrics=config.metric_names
        )  # the bench's own measurement, apart from the server's
        self.profiles = scenario.profiles()
        self.devices = [
            DeviceCore(
                self.JOB,
                f"dev-{i:02d}",
                shard,
                NumpyTrainer(config.loss),
                seed=scenario.seed * 1000 + i,
                incarnation=i + 1,
            )
            for i, shard in enumerate(shards)
        ]
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._up_free = [0.0] * len(self.devices)
        self._down_free = [0.0] * len(self.devices)
        self._stepping = [False] * len(self.devices)
        self._idle_since: list[float | None] = [None] * len(self.devices)
        self._idle = [0.0] * len(self.devices)
        self._subscribed = [set(device.subscriptions()) for device in self.devices]
        self._retained: dict[str, Publish] = {}
        self._curve: list[tuple[float, float]] = []
        self._traffic: list[tuple[int, int, float]] = []
        self.now = 0.0
        # sites: device i talks to aggregator i % sites, which sends its site commits up its uplink
        self.aggregators = [
            SiteAggregator(SiteConfig(job=self.JOB, site=f"site-{k}", flush_s=scenario.site_flush_s))
            for k in range(scenario.sites)
        ]
        self._site_free = [0.0] * scenario.sites
        self._site_timer: list[float | None] = [None] * scenario.sites

    # ------------------------------------------------------------- plumbing
    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def _server_publishes(self, messages: list[Publish]) -> None:
        for event in self.server.events.take():  # logged as a server process would
            SERVER_LOG.log(event.level, event.message)
        for message in messages:
            if message.retain:
                self._retained[message.topic] = message
            for i, topics in enumerate(self._subscribed):
                if message.topic in topics:
                    self._send_down(i, message)
            for k in range(len(self.aggregators)):
                if self._site_wants(k, message.topic):
                    self._at(self.now + self.scenario.site_latency_s, partial(self._site_receives, k, message))

    def _send_down(self, i: int, message: Publish) -> None:
        profile = self.profiles[i]
        start = max(self.now, self._down_free[i])
        self._down_free[i] = start + profile.transfer_s(len(message.payload), up=False)
        self._at(self._down_free[i] + profile.latency_s, lambda: self._device_receives(i, message))

    def _device_publishes(self, i: int, messages: list[Publish]) -> None:
        profile = self.profiles[i]
        for message in messages:
            start = max(self.now, self._up_free[i])
            self._up_free[i] = start + profile.transfer_s(len(message.payload), up=True)
            arrives = self._up_free[i] + profile.latency_s
            kind, _ = self.server.topics.parse(message.topic)
            if self.aggregators and kind in ("grad", "status"):  # to the site broker, which the aggregator reads
                self._at(arrives, partial(self._site_receives, i % len(self.aggregators), message))
            if not self.aggregators or kind != "grad":  # commits cross to the core only as site commits
                self._at(
                    arrives + (self.scenario.site_latency_s if self.aggregators else 0.0),
                    partial(self._server_receives, message),
                )

    @staticmethod
    def _index(device: str) -> int:
        """Device ``dev-NN``'s index NN (its site: NN modulo the sites)."""
        return int(device.rsplit("-", 1)[1])

    def _site_wants(self, k: int, topic: str) -> bool:
        """What of the server's a site's aggregator subscribes to: the broadcasts, and its devices'
        controls (their statuses come from the devices, ``_device_publishes``)."""
        kind, device = self.server.topics.parse(topic)
        return kind in ("params", "delta", "barrier") or (
            kind == "ctrl" and device is not None and self._index(device) % len(self.aggregators) == k
        )

    def _site_receives(self, k: int, message: Publish) -> None:
        aggregator = self.aggregators[k]
        out = aggregator.receive(Inbound(message.topic, message.payload), self.now)
        self._site_publishes(k, [*out, *aggregator.after_batch(self.now)])

    def _site_publishes(self, k: int, messages: list[Publish]) -> None:
        aggregator = self.aggregators[k]
        for event in aggregator.events.take():
            SERVER_LOG.log(event.level, event.message)
        aggregator.acknowledge([])  # (nothing to acknowledge on a simulated link)
        for message in messages:
            if message.topic == self.server.topics.part(aggregator.config.site):
                start = max(self.now, self._site_free[k])
                self._site_free[k] = start + len(message.payload) * 8 / self.scenario.site_up_bps
                self._at(self._site_free[k] + self.scenario.site_latency_s, partial(self._server_receives, message))
            else:  # a notice to one of its devices
                _, device = self.server.topics.parse(message.topic)
                assert device is not None
                self._send_down(self._index(device), message)
        due = aggregator.next_deadline()
        if due is not None and self._site_timer[k] != due:
            self._site_timer[k] = due
            self._at(max(due, self.now), lambda: self._site_tick(k))

    def _site_tick(self, k: int) -> None:
        self._site_timer[k] = None
        aggregator = self.aggregators[k]
        self._site_publishes(k, [*aggregator.on_tick(self.now), *aggregator.after_batch(self.now)])

    def _server_receives(self, message: Publish) -> None:
        self._server_publishes(self.server.receive(Inbound(message.topic, message.payload), self.now))

    def _device_receives(self, i: int, message: Publish) -> None:
        if message.topic not in self._subscribed[i]:
            return  # unsubscribed while it was on its way
        device = self.devices[i]
        device.on_message(message.topic, message.payload)
        wanted = set(device.subscriptions())
        again = set(device.resubscriptions())
        for topic in (wanted - self._subscribed[i]) | again:  # a (re)subscription gets the retained message
            if topic in self._retained:
                self._send_down(i, self._retained[topic])
        self._subscribed[i] = wanted
        self._kick(i)

    def _kick(self, i: int) -> None:
        """Start device ``i``'s next local step if it can train; keep its idle clock."""
        device = self.devices[i]
        for event in device.events.take():  # logged as a device process would
            DEVICE_LOG.log(event.level, event.message)
        if device.ready and not self._stepping[i]:
            self._stepping[i] = True
            self._at(self.now + self.profiles[i].step_time(), lambda: self._step_done(i))
        idle, since = not self._stepping[i] and not device.finished, self._idle_since[i]
        if idle and since is None:
            self._idle_since[i] = self.now
        elif not idle and since is not None:
            self._idle[i] += self.now - since
            self._idle_since[i] = None

    def _step_done(self, i: int) -> None:
        self._stepping[i] = False
        device = self.devices[i]
        if device.ready:
            self._device_publishes(i, device.step())
            if device.trained:
                self._device_publishes(i, device.timed_step(self.profiles[i].step_time()))
        self._kick(i)

    def _sample(self) -> None:
        """Measure the global model on the fixed grid, so every pace is judged at the same times.

        (Judging by the server's own per-version metrics would favour paces that make
        more versions: the best of more noisy evaluations is higher.)"""
        value = self.judge(self.server.store.view()).values[self.judge.metric.name]  # accuracy, unless a task says
        self._curve.append((round(self.now, 6), value))
        traffic, assigned = self.server.traffic, self.server.frequency.assigned
        push_every = sum(assigned.values()) / len(assigned) if assigned else float(self.server.frequency.base)
        self._traffic.append((traffic.commits, traffic.bytes_up + traffic.bytes_down, push_every))
        if not self.server.finished:
            self._at(self.now + self.scenario.sample_s, self._sample)

    def _tick(self, every: float) -> None:
        self._server_publishes(self.server.on_tick(self.now))
        if not self.server.finished:
            self._at(self.now + every, lambda: self._tick(every))

    # ------------------------------------------------------------------ run
    def run(self, on_metrics: Callable[[Metrics], None] | None = None) -> RunResult:
        self._server_publishes(self.server.start(0.0))
        for i, device in enumerate(self.devices):
            self._device_publishes(i, [device.status("online")])
            self._kick(i)
        self._at(0.0, lambda: self._tick(min(0.05, (self.scenario.server.round_deadline_s or 1.0) / 4)))
        self._at(0.0, self._sample)
        seen = 0
        while self._events and not self.server.finished:
            self.now, _, action = heapq.heappop(self._events)
            action()
            if on_metrics is not None and len(self.server.history) > seen:
                for metrics in self.server.history[seen:]:
                    on_metrics(metrics)
                seen = len(self.server.history)
        end = self.now
        for i, since in enumerate(self._idle_since):
            if since is not None:
                self._idle[i] += end - since
        traffic = self.server.traffic
        return RunResult(
            pace=self.server.pace.name,
            history=self.server.history,
            idle_fraction=sum(self._idle) / (end * len(self.devices)) if end > 0 else 0.0,
            commits=traffic.commits,
            bytes_up=traffic.bytes_up,
            bytes_down=traffic.bytes_down,
            run_s=end,
            target=self.scenario.target,
            curve=self._curve,
            traffic=self._traffic,
        )
