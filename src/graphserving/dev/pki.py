"""Certificates and keys for the local control plane, made with ``cryptography``.

One self-signed CA signs the apiserver's serving certificate and the client certificates of
each identity (admin in ``system:masters``, the controller-manager, the scheduler, the node
agent as ``system:node:<name>`` in ``system:nodes``). A separate RSA key pair signs and verifies
service-account tokens. Everything is written PEM-encoded, keys with mode 0600.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Validity of every certificate: long enough for a demo left running, short enough to be harmless.
VALIDITY = dt.timedelta(days=30)


@dataclasses.dataclass(frozen=True)
class CertPair:
    """A PEM certificate file and its PEM private key file."""

    cert: Path
    key: Path


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


class CertificateAuthority:
    """A self-signed CA (EC P-256) that issues serving and client certificates into ``directory``."""

    def __init__(self, directory: Path, common_name: str = "graphserving-dev-ca") -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        subject = _name(common_name)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.pair = CertPair(
            cert=_write(directory / "ca.crt", self.cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(directory / "ca.key", _key_pem(self.key), private=True),
        )

    def issue(self, name: str, common_name: str, organizations: tuple[str, ...] = (),
              dns_names: tuple[str, ...] = (), ip_addresses: tuple[str, ...] = (),
              server: bool = False) -> CertPair:
        """Issue ``<name>.crt``/``<name>.key``: a client certificate, or a serving one if ``server``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organizations)).issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                         content_commitment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                           critical=False)
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return CertPair(
            cert=_write(self.directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(self.directory / f"{name}.key", _key_pem(key), private=True),
        )


def service_account_keys(directory: Path) -> CertPair:
    """An RSA-2048 key pair for service-account tokens: ``sa.pub`` (verify), ``sa.key`` (sign)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return CertPair(cert=_write(directory / "sa.pub", public),
                    key=_write(directory / "sa.key", _key_pem(key), private=True))
