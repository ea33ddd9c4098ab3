from __future__ import annotations

from pathlib import Path

import pytest

from broker.client import BrokerAddress, MqttTransport
from broker.launcher import render_config, start_broker
from schemas.topics import Publish
from tests.helpers import next_message


def test_render_config_sets_listener_and_persistence_only(tmp_path) -> None:
    text = render_config(12345, "127.0.0.1", tmp_path)
    assert "listener 12345 127.0.0.1" in text
    assert f"persistence_location {tmp_path}/" in text
    assert "max_queued_messages 0" in text and "max_inflight_messages 0" in text
    ws = render_config(12345, "127.0.0.1", tmp_path, ws_port=12346)
    assert "listener 12346 127.0.0.1\nprotocol websockets\nsocket_domain ipv4\n" in ws
    bad = tmp_path / "bad.conf"
    bad.write_text("persistence true\n")
    with pytest.raises(ValueError, match="listener"):
        render_config(1, "127.0.0.1", tmp_path, template=bad)


def burst(
    address: BrokerAddress, count: int, payload_size: int, client_id: str = "burst-sink", away: bool = True
) -> int:
    """Publish ``count`` QoS 1 messages while the (persistent) subscriber is away, as a busy
    parameter server would be; return how many reach it when it comes back."""
    sink = MqttTransport(address, client_id, ["burst/#"], persistent=True)
    sink.wait_connected(10)
    if away:
        sink.close()
    source = MqttTransport(address, f"{client_id}-source", [], persistent=False)
    source.wait_connected(10)
    for i in range(count):
        source.publish(Publish(f"burst/{i % 8}", bytes(payload_size), qos=1))
    source.close(timeout=60)
    if away:
        sink = MqttTransport(address, client_id, ["burst/#"], persistent=True)
    received = 0
    while (message := sink.receive(timeout=1)) is not None:
        received += 1
        sink.ack(message)
    sink.close()
    return received


def test_project_config_delivers_a_whole_qos1_burst(mosquitto) -> None:
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    assert burst(address, count=3000, payload_size=2_000) == 3000


def test_embedded_broker_fallback_carries_messages(tmp_path) -> None:
    pytest.importorskip("amqtt")
    with start_broker(workdir=tmp_path, embedded=True) as broker:
        assert broker.kind == "amqtt"
        address = BrokerAddress(broker.host, broker.port)
        # amqtt keeps no queue for an absent subscriber: check live delivery only.
        assert burst(address, count=200, payload_size=100, away=False) == 200


def test_retained_message_reaches_a_late_subscriber(mosquitto) -> None:
    address = BrokerAddress(mosquitto.host, mosquitto.port)
    pub = MqttTransport(address, "pub", [], persistent=False)
    pub.wait_connected(10)
    pub.close(last=Publish("edgeps/j/params", b"snapshot", qos=1, retain=True))
    sub = MqttTransport(address, "late", ["edgeps/j/params"], persistent=False)
    assert next_message(sub).payload == b"snapshot"
    sub.close()


def test_sessions_and_queued_messages_survive_a_broker_restart(tmp_path) -> None:
    broker = start_broker(workdir=tmp_path / "b", embedded=False)
    address = BrokerAddress(broker.host, broker.port)
    away = MqttTransport(address, "persistent-sink", ["keep/#"], persistent=True)
    away.wait_connected(10)
    away.close()
    broker.stop()
    assert (tmp_path / "b" / "mosquitto.db").exists()  # the broker could write its database
    broker = start_broker(port=address.port, workdir=tmp_path / "b", embedded=False)
    try:
        source = MqttTransport(address, "source", [], persistent=False)
        source.wait_connected(10)
        source.close(last=Publish("keep/x", b"kept for you", qos=1))
        # The subscription of the absent client survived the restart, so the message waited for it.
        back = MqttTransport(address, "persistent-sink", ["keep/#"], persistent=True)
        assert next_message(back).payload == b"kept for you"
        back.close()
    finally:
        broker.stop()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* give them) listening on ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                out.add(address)
    return out


def test_the_local_profile_listens_on_loopback_only_websockets_included(mosquitto) -> None:
    """1.0: the WebSockets listener, written as 127.0.0.1 and anonymous, was bound on every address
    by Mosquitto 2.0.11: anyone on the network could pause, stop or poison a demo."""
    assert mosquitto.ws_port is not None
    for port in (mosquitto.port, mosquitto.ws_port):
        assert _listening_addresses(port) == {"0100007F"}, port  # 127.0.0.1, and nothing else


def test_edgeps_broker_refuses_a_port_in_use_and_keeps_its_data(mosquitto, tmp_path) -> None:
    """1.0: `edgeps broker --port P` with P taken said "listening" and exited 0, and every client
    then used whatever broker held the port (on Debian: one that drops queued commits)."""
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "edgeps.cli",
        "broker",
        "--port",
        str(mosquitto.port),
        "--data-dir",
        str(tmp_path / "data"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"port {mosquitto.port}" in lines[0] and "already in use" in lines[0]
    # The data folder survives the broker (1.0 deleted it: "survives a broker restart" was false).
    from broker.launcher import free_port, start_broker

    with start_broker(workdir=tmp_path / "kept", embedded=False, ws_port=free_port()) as broker:
        assert broker.listeners == [f"mqtt://127.0.0.1:{broker.port}", f"ws://127.0.0.1:{broker.ws_port}"]
    assert (tmp_path / "kept" / "mosquitto.db").exists() and oct((tmp_path / "kept").stat().st_mode)[-3:] == "700"


def test_every_profile_expires_offline_persistent_sessions(tmp_path) -> None:
    """Without it the database grows with every job's sessions (804 MB over 25 demo jobs); the
    running brokers of the other tests show that Mosquitto takes the line."""
    from broker.deploy.secure import init_secure_broker

    setup = init_secure_broker(tmp_path / "setup", "j", devices=["d"])
    root = Path(__file__).parents[2] / "broker"
    expiry = {
        name: [line.split()[1] for line in text.splitlines() if line.startswith("persistent_client_expiration")]
        for name, text in (
            ("local", (root / "mosquitto.conf").read_text()),
            ("compose", (root / "mosquitto-compose.conf").read_text()),
            ("init", Path(setup.config).read_text()),
        )
    }
    assert expiry == {"local": ["1h"], "compose": ["1d"], "init": ["1d"]}
