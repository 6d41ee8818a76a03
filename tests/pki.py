"""A throwaway PKI for TLS tests: CAs, and certificates they sign for 127.0.0.1/localhost.

EC P-256 keys, so a whole set takes milliseconds. Every file is PEM, written under the
directory a test module gives.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_LOCAL_NAMES = x509.SubjectAlternativeName(
    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
)


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as files and as bytes."""

    cert: Path
    key: Path

    @property
    def cert_bytes(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_bytes(self) -> bytes:
        return self.key.read_bytes()


@dataclass(frozen=True)
class Authority:
    """A CA that signs certificates into `directory`."""

    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / f"{self.name}-ca.pem"

    def issue(
        self, name: str, *, server: bool, client: bool | None = None, dns_names: tuple = ()
    ) -> Pem:
        """A certificate for 127.0.0.1, localhost and `dns_names`, for a server, a client
        (the default for a non-server), or both."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        if client if client is not None else not server:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            _builder(name, key, self.certificate.subject)
            .add_extension(
                x509.SubjectAlternativeName([*_LOCAL_NAMES, *map(x509.DNSName, dns_names)]),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        certificate = builder.sign(self.key, hashes.SHA256())
        return _write(self.directory / f"{self.name}-{name}", certificate, key)


def authority(name: str, directory: Path) -> Authority:
    """A new self-signed CA whose certificate is written to `directory`/`name`-ca.pem."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pergrad test CA {name}")])
    certificate = (
        _builder(f"CA {name}", key, subject, subject=subject)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    ca = Authority(name, key, certificate, directory)
    ca.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return ca


def _builder(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    *,
    subject: x509.Name | None = None,
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = subject or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(stem: Path, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    pem = Pem(stem.with_name(stem.name + ".pem"), stem.with_name(stem.name + "-key.pem"))
    pem.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pem


@dataclass(frozen=True)
class Pki:
    """The set the TLS tests use: a trusted CA with a server and a client certificate,
    and a second CA (trusted by no server) with a client certificate of its own."""

    ca: Authority
    server: Pem
    client: Pem
    other_ca: Authority
    other_client: Pem
    other_server: Pem


def make_pki(directory: Path) -> Pki:
    ca, other = authority("trusted", directory), authority("other", directory)
    return Pki(
        ca=ca,
        server=ca.issue("server", server=True),
        client=ca.issue("client", server=False),
        other_ca=other,
        other_client=other.issue("client", server=False),
        other_server=other.issue("server", server=True),
    )
