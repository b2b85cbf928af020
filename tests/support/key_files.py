"""Helpers of the Router key and TLS tests: a self-signed certificate, secret files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(directory: Path, name: str = "router", ip: str | None = None) -> tuple[Path, Path]:
    """A fresh self-signed certificate: ``(cert.pem, key.pem)``, for ``localhost`` / ``127.0.0.1``, or for the
    address ``ip`` alone when given.

    The certificate is its own CA, so a client verifies the server with ``verify=cert.pem``.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip or "localhost")])
    names: list[x509.GeneralName] = (
        [x509.IPAddress(ipaddress.ip_address(ip))]
        if ip
        else [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = directory / f"{name}-cert.pem"
    key_path = directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def secret_file(directory: Path, name: str, text: str) -> str:
    """Write ``text`` to ``directory/name`` (mode 600) and return its path."""
    path = directory / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)
