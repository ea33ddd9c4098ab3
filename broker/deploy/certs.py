"""The deployment's certificates: a CA of its own, and certificates it signs for the broker and
for clients that present one, with the hostnames and IP addresses they are reached by."""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def subject_alt_names(hostnames: list[str]) -> list[str]:
    """``IP:`` or ``DNS:`` entries for a certificate; ValueError, naming it, for a value that is
    neither an IP address nor a DNS name (a newline in one used to make the broker's certificate a
    sub-CA; ``::1`` became ``DNS:::1``)."""
    out = []
    for name in hostnames:
        try:
            out.append(f"IP:{ipaddress.ip_address(name)}")
            continue
        except ValueError:
            pass
        labels = name.rstrip(".").split(".")
        if not name or len(name) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
            raise ValueError(f"--hostnames: {name!r} is neither an IP address nor a DNS name")
        out.append(f"DNS:{name}")
    return out


def _names(hostnames: list[str]) -> list[x509.GeneralName]:
    """``subject_alt_names`` as the cryptography library's names."""
    return [
        x509.IPAddress(ipaddress.ip_address(n[3:])) if n.startswith("IP:") else x509.DNSName(n[4:])
        for n in subject_alt_names(hostnames)
    ]


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private(path, pem.decode())


def _sign(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    days: int,
    ca: bool,
    names: list[x509.GeneralName],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


def make_ca(directory: Path) -> None:
    """``ca.key`` and ``ca.crt`` in ``directory`` (EC P-256, ten years), with the cryptography library."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgeps CA")])
    cert = _sign("edgeps CA", key, name, key, 3650, ca=True, names=[])
    _write_key(directory / "ca.key", key)
    (directory / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_certificate(directory: Path, name: str, hosts: list[str] | None = None, ca: Path | None = None) -> None:
    """``{name}.crt`` and ``{name}.key`` in ``directory``, signed by the CA in ``ca`` (default:
    ``directory``); ``hosts`` (validated) become subjectAltNames. Never a CA itself."""
    ca = ca or directory
    names = _names(hosts or [])  # a bad name is refused before anything is written
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca / 'ca.key'}: not the EC key `edgeps broker init` writes")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _sign(name, key, ca_cert.subject, ca_key, 825, ca=False, names=names)
    _write_key(directory / f"{name}.key", key)
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file of mode 600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
