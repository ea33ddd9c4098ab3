"""The deployable broker setup, enforced by a real Mosquitto started from the generated config."""

from __future__ import annotations

import json
import threading
import time

import pytest

from broker.client import BrokerAddress, MqttTransport
from broker.deploy.certs import make_ca
from broker.deploy.secure import acl_rules, hash_password, init_secure_broker
from broker.launcher import start_broker
from edge_client.core import DeviceCore
from edge_client.mqtt import connect_device, run_device
from edge_client.trainer import NumpyTrainer
from learning.data import Dataset, load_digits
from learning.model import init_mlp
from learning.prepare import prepare_shards
from ps_service.config import ServerConfig
from ps_service.evaluator import Evaluator
from ps_service.io.mqtt import connect_server, serve
from ps_service.server.core import ServerCore
from schemas.topics import Publish, Topics
from tests.helpers import next_message, wait_until

JOB = "sec"
T = Topics(JOB)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A setup for devices a and b, one operator, and its Mosquitto (TLS, accounts, ACLs)."""
    root = tmp_path_factory.mktemp("secure")
    setup = init_secure_broker(root / "setup", JOB, devices=["dev-a", "dev-b"], operators=["op"])
    broker = start_broker(workdir=root / "run", embedded=False, template=setup.config)
    yield setup, broker
    broker.stop()


def address(secure, account: str | None, password: str | None = None, ca: str | None = None) -> BrokerAddress:
    setup, broker = secure
    if account is not None and password is None:
        password = setup.passwords[account]
    ca = ca or str(setup.ca_cert)
    return BrokerAddress(broker.host, broker.port, account, password, tls_ca=ca)


def client(secure, account: str | None, subscriptions=(), **kw) -> MqttTransport:
    transport = MqttTransport(address(secure, account, **kw), f"test-{account}", list(subscriptions), persistent=False)
    transport.wait_connected(5)
    return transport


def refused(secure, account: str | None, **kw) -> bool:
    transport = MqttTransport(address(secure, account, **kw), f"refused-{account}", [], persistent=False)
    try:
        transport.wait_connected(3)
    except ConnectionError:
        return True
    transport.close()
    return False


def drain(transport: MqttTransport, seconds: float = 1.0) -> dict[str, bytes]:
    """Every message that arrives within ``seconds``, by topic."""
    seen = {}
    while (message := transport.receive(timeout=seconds)) is not None:
        seen[message.topic] = message.payload
        transport.ack(message)
    return seen


def test_the_password_file_uses_mosquittos_format() -> None:
    first, second = hash_password("secret"), hash_password("secret")
    assert first.startswith("$7$101$") and first != second  # salted
    assert hash_password("secret", b"0" * 12) == hash_password("secret", b"0" * 12)


def test_wrong_passwords_and_anonymous_clients_are_refused(secure) -> None:
    assert refused(secure, "dev-a", password="not-it")
    assert refused(secure, None)  # anonymous access is off
    assert refused(secure, "nobody", password="x")
    assert not refused(secure, "dev-a")


def test_a_broker_certificate_from_another_ca_is_refused(secure, tmp_path) -> None:
    make_ca(tmp_path)  # a CA the broker's certificate was not signed by
    assert refused(secure, "dev-a", ca=str(tmp_path / "ca.crt"))


def test_a_device_can_neither_publish_as_another_nor_send_commands(secure) -> None:
    server = client(secure, "ps", [T.grad("+"), T.status("+"), T.cmd, T.cmd_of("+")])
    for topic in (T.grad("dev-b"), T.status("dev-b"), T.cmd, T.cmd_of("dev-a"), T.cmd_of("op")):
        intruder = client(secure, "dev-a")  # Mosquitto drops a client after a denied publish
        intruder.publish(Publish(topic, b"forged by a", qos=1))
        intruder.close()
    for topic in (T.cmd, T.cmd_of("op2")):  # an operator writes its own command topic only
        other = client(secure, "op")
        other.publish(Publish(topic, b"forged by op", qos=1))
        other.close()
    device_a, operator = client(secure, "dev-a"), client(secure, "op")
    device_a.publish(Publish(T.grad("dev-a"), b"from a", qos=1))
    operator.publish(Publish(T.cmd_of("op"), b'{"cmd": "pause"}', qos=1))
    seen = drain(server, 2.0)
    assert seen == {T.grad("dev-a"): b"from a", T.cmd_of("op"): b'{"cmd": "pause"}'}
    for transport in (server, device_a, operator):
        transport.close()


def test_a_device_reads_only_its_own_control_and_the_jobs_broadcasts(secure) -> None:
    server = client(secure, "ps")
    for topic in (T.ctrl("dev-a"), T.ctrl("dev-b"), T.params, T.barrier):
        server.publish(Publish(topic, topic.encode(), qos=1, retain=True))
    server.publish(Publish(T.metrics, b"m", qos=1))
    device_a = client(secure, "dev-a", [T.ctrl("+"), T.params, T.barrier, T.notice("+"), T.cmd, T.grad("+")])
    assert set(drain(device_a)) == {T.ctrl("dev-a"), T.params, T.barrier}
    device_a.close()
    server.close()


def test_only_the_server_writes_parameters_and_control(secure) -> None:
    device_b = client(secure, "dev-b", [T.params, T.ctrl("dev-b")])
    drain(device_b, 0.5)  # the retained ones from the test before, if any
    for account in ("dev-a", "op"):
        for topic in (T.params, T.ctrl("dev-b")):
            intruder = client(secure, account)
            intruder.publish(Publish(topic, b"forged", qos=1))
            intruder.close()
    assert drain(device_b, 2.0) == {}
    device_b.close()


def test_the_acl_names_every_account_explicitly() -> None:
    rules = acl_rules("j", "ps", ["d1"], ["op"])
    assert "pattern" not in rules
    assert "user d1\ntopic write edgeps/j/grad/d1\ntopic write edgeps/j/status/d1\n" in rules


def test_client_certificates_when_required(tmp_path) -> None:
    setup = init_secure_broker(tmp_path / "setup", JOB, devices=["dev-a"], operators=["op"], client_certs=True)
    broker = start_broker(workdir=tmp_path / "run", embedded=False, template=setup.config)
    tls = setup.credentials_dir
    try:
        base = {"tls_ca": str(tls / "ca.crt")}
        good = BrokerAddress(
            broker.host,
            broker.port,
            "dev-a",
            setup.passwords["dev-a"],
            **base,
            tls_cert=str(tls / "dev-a.crt"),
            tls_key=str(tls / "dev-a.key"),
        )
        MqttTransport(good, "certified", [], persistent=False).wait_connected(5)
        without = BrokerAddress(broker.host, broker.port, "dev-a", setup.passwords["dev-a"], **base)
        with pytest.raises(ConnectionError):
            MqttTransport(without, "uncertified", [], persistent=False).wait_connected(3)
        make_ca(tmp_path)  # a certificate from a CA the broker does not trust
        other = tmp_path / "other"
        other.mkdir()
        for name in ("ca.crt", "ca.key"):
            (other / name).write_bytes((tmp_path / name).read_bytes())
        from broker.deploy.certs import make_certificate

        make_certificate(other, "dev-a")
        forged = BrokerAddress(
            broker.host,
            broker.port,
            "dev-a",
            setup.passwords["dev-a"],
            **base,
            tls_cert=str(other / "dev-a.crt"),
            tls_key=str(other / "dev-a.key"),
        )
        with pytest.raises(ConnectionError):
            MqttTransport(forged, "forged", [], persistent=False).wait_connected(3)
    finally:
        broker.stop()


def test_a_job_trains_over_tls_with_accounts_and_acls(tmp_path) -> None:
    devices = ["dev-0", "dev-1"]
    setup = init_secure_broker(tmp_path / "setup", "tls-job", devices=devices)
    broker = start_broker(workdir=tmp_path / "run", embedded=False, template=setup.config)
    ca = str(setup.ca_cert)
    try:
        shards = prepare_shards(load_digits(), tmp_path / "data", devices=2, alpha=0.5, seed=0)
        holdout = Dataset.load(shards.holdout)
        config = ServerConfig(job="tls-job", rounds=10, min_devices=2, allowed_devices=frozenset(devices))
        core = ServerCore(config, init_mlp([64, 32, 10], seed=0), Evaluator(holdout))
        server_address = BrokerAddress(broker.host, broker.port, "ps", setup.passwords["ps"], tls_ca=ca)
        transport = connect_server(core, server_address)
        server = threading.Thread(target=serve, args=(core, transport), daemon=True)
        server.start()
        runners = []
        for name, shard in zip(devices, shards.devices, strict=True):
            device = DeviceCore("tls-job", name, Dataset.load(shard), NumpyTrainer())
            device_address = BrokerAddress(broker.host, broker.port, name, setup.passwords[name], tls_ca=ca)
            runner = threading.Thread(target=run_device, args=(device, connect_device(device, device_address)))
            runner.start()
            runners.append(runner)
        wait_until(lambda: core.finished, timeout=60, what="the job over TLS")
        assert core.store.version == 10 and core.traffic.applied == 20 and not core.traffic.rejected
        server.join(timeout=10)
        for runner in runners:
            runner.join(timeout=10)
        transport.close()
    finally:
        broker.stop()


def test_the_broker_refuses_packets_over_its_limit(secure) -> None:
    server = client(secure, "ps", [T.grad("+")])
    oversized = client(secure, "dev-a")
    oversized.publish(Publish(T.grad("dev-a"), b"\0" * (9 << 20), qos=1))  # over 8 MiB + 64 KiB
    oversized.close()
    device_a = client(secure, "dev-a")
    device_a.publish(Publish(T.grad("dev-a"), b"small", qos=1))
    assert drain(server, 2.0) == {T.grad("dev-a"): b"small"}
    device_a.close()
    server.close()


def test_edgeps_ctl_logs_in_as_an_operator_over_tls(secure) -> None:
    from edgeps.cli import main

    setup, broker = secure
    server = client(secure, "ps", [T.cmd, T.cmd_of("+")])
    ca = str(setup.ca_cert)
    for account in ("op", "dev-a"):  # only the operator may command
        argv = [
            "ctl",
            "pause",
            "--broker",
            f"{broker.host}:{broker.port}",
            "--job",
            JOB,
            "--username",
            account,
            "--password",
            setup.passwords[account],
            "--tls-ca",
            ca,
            "--reason",
            f"by {account}",
            "--timeout",
            "0.5",
        ]
        assert main(argv) == 2  # sent, but no server runs here to reply
    seen = drain(server, 2.0)
    assert list(seen) == [T.cmd_of("op")] and json.loads(seen[T.cmd_of("op")])["reason"] == "by op"
    server.close()


def test_the_dashboards_secure_websockets_listener_takes_the_same_accounts(secure) -> None:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    setup, broker = secure
    assert broker.ws_port

    def connects(username: str | None, password: str | None) -> bool:
        result = threading.Event()
        outcome = {}
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"ws-{username}", transport="websockets")
        client.tls_set(ca_certs=str(setup.ca_cert))
        if username:
            client.username_pw_set(username, password)

        def on_connect(client, userdata, flags, reason_code, properties) -> None:
            outcome["ok"] = not reason_code.is_failure
            result.set()

        client.on_connect = on_connect
        client.connect(broker.host, broker.ws_port, keepalive=10)
        client.loop_start()
        result.wait(5)
        client.loop_stop()
        client.disconnect()
        return outcome.get("ok", False)

    assert connects("op", setup.passwords["op"])
    assert not connects("op", "wrong")
    assert not connects(None, None)


def test_no_account_can_take_over_another_accounts_session(secure) -> None:
    """1.0: client ids were predictable and any account could use any of them: a device took over
    another's session, and with the server's id and a clean session it kicked the server off and
    deleted its queued messages (a queued operator command was lost; bsp then waited forever)."""
    server_id = "edgeps-ps-sec"  # what edgeps ps calls itself
    server = MqttTransport(address(secure, "ps"), server_id, [T.cmd_of("+")], persistent=True)
    server.wait_connected(5)
    server.close()  # away for a moment: its session keeps what comes for it
    operator = client(secure, "op")
    operator.publish(Publish(T.cmd_of("op"), b'{"cmd": "pause"}', qos=1))
    operator.close()
    for victim_id in (server_id, "test-dev-b"):  # the server's id, and another device's
        thief = MqttTransport(address(secure, "dev-a"), victim_id, [T.cmd], persistent=False)
        thief.wait_connected(5)
        assert thief.receive(timeout=0.5) is None  # dev-a may not read commands, under any id
        thief.close()
    device_b = client(secure, "dev-b")
    thief = MqttTransport(address(secure, "dev-a"), "test-dev-b", [], persistent=False)
    thief.wait_connected(5)
    time.sleep(0.5)  # a takeover would drop device_b now
    assert device_b.connected.is_set()  # not kicked off by a connection that named its id
    thief.close()
    device_b.close()
    back = MqttTransport(address(secure, "ps"), server_id, [T.cmd_of("+")], persistent=True)
    assert next_message(back, timeout=5).payload == b'{"cmd": "pause"}'  # the queued command survived
    back.close()
