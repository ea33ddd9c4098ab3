"""What `edgeps broker init` writes, checked without a job: the broker starting as root and as its
service account, certificate names, a broker certificate that is never a CA, the password file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from broker.client import BrokerAddress, MqttTransport
from broker.deploy.secure import init_secure_broker
from broker.launcher import start_broker
from tests.broker.test_secure import JOB


def test_the_generated_broker_starts_as_root_and_as_its_service_account(tmp_path) -> None:
    """1.0: started as root, the generated config failed ("Unable to open pwfile"); the broker's
    folder held the plaintext passwords and the CA key (OPERATIONS.md said chown -R the whole folder)."""
    import os
    import shutil

    from broker.launcher import free_port

    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("needs root and runuser to start the broker as root and as the mosquitto account")
    import tempfile

    port, ws_port = free_port(), free_port()
    # pytest's own folders are private to root: the mosquitto account could not reach one inside them
    with tempfile.TemporaryDirectory(prefix="edgeps-init-") as where:
        os.chmod(where, 0o755)
        setup = init_secure_broker(
            Path(where) / "setup", JOB, devices=["dev-a"], port=port, host="127.0.0.1", ws_port=ws_port
        )
        _start_as_root_and_as_mosquitto(setup, port)


def _start_as_root_and_as_mosquitto(setup, port: int) -> None:
    import shutil
    import subprocess

    from broker.launcher import wait_for_port

    inside = {p.relative_to(setup.broker_dir).as_posix() for p in setup.broker_dir.rglob("*")}
    assert inside == {"mosquitto.conf", "passwd", "acl", "ca.crt", "server.crt", "server.key", "data"}
    assert not any(setup.passwords["dev-a"] in p.read_text() for p in setup.broker_dir.rglob("*") if p.is_file())
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    for prefix in ([], ["runuser", "-u", "mosquitto", "--"]):
        broker = subprocess.Popen([*prefix, mosquitto, "-c", str(setup.config)], stderr=subprocess.PIPE)
        try:
            wait_for_port("127.0.0.1", port, 10, broker)
            device = MqttTransport(
                BrokerAddress("127.0.0.1", port, "dev-a", setup.passwords["dev-a"], tls_ca=str(setup.ca_cert)),
                "x",
                [],
                persistent=False,
            )
            device.wait_connected(5)
            device.close()
        finally:
            broker.terminate()
            broker.wait(timeout=10)


@pytest.mark.parametrize("bad", ["a.example\nbasicConstraints=CA:TRUE", "-x", "a b", "", "x" * 300])
def test_bad_hostnames_are_refused_with_one_line_and_ip_addresses_become_ip_names(tmp_path, bad) -> None:
    import subprocess

    from broker.deploy.certs import subject_alt_names

    assert subject_alt_names(["::1", "10.0.0.5", "broker.example.org"]) == [
        "IP:::1",
        "IP:10.0.0.5",
        "DNS:broker.example.org",
    ]
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
        subject_alt_names([bad])
    if bad:  # the whole command, as a user meets it
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgeps.cli",
                "broker",
                "init",
                str(tmp_path / "s"),
                "--devices",
                "d1",
                "--hostnames",
                f"localhost,{bad}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "s").exists()


def test_the_broker_certificate_is_never_a_ca(tmp_path) -> None:
    import ipaddress

    from cryptography import x509

    setup = init_secure_broker(tmp_path / "s", JOB, devices=["d1"], hostnames=("localhost", "::1"))
    cert = x509.load_pem_x509_certificate((setup.broker_dir / "server.crt").read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("::1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    ca = x509.load_pem_x509_certificate(setup.ca_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    cert.verify_directly_issued_by(ca)  # signed by the job's CA


def test_the_password_file_works_with_or_without_mosquitto_passwd(tmp_path, monkeypatch) -> None:
    """Hashed by mosquitto_passwd where it is installed; else here, in the same format: Mosquitto
    takes both (a real login each)."""
    import shutil as shutil_module

    from broker.deploy.secure import write_password_file

    assert write_password_file(tmp_path / "with", {"a": "pw"}) == "mosquitto_passwd"
    assert (tmp_path / "with").read_text().startswith("a:$7$")
    real_which = shutil_module.which
    monkeypatch.setattr(
        shutil_module, "which", lambda cmd, **kw: None if cmd == "mosquitto_passwd" else real_which(cmd, **kw)
    )
    setup = init_secure_broker(tmp_path / "s", JOB, devices=["d1"], operators=["op"])
    monkeypatch.undo()
    assert (setup.broker_dir / "passwd").read_text().startswith("ps:$7$101$")
    broker = start_broker(workdir=tmp_path / "run", embedded=False, template=setup.config)
    try:
        ok = MqttTransport(
            BrokerAddress(broker.host, broker.port, "d1", setup.passwords["d1"], tls_ca=str(setup.ca_cert)),
            "d1",
            [],
            persistent=False,
        )
        ok.wait_connected(5)
        ok.close()
    finally:
        broker.stop()
