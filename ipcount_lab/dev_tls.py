"""A throwaway certificate authority for the embedded broker's TLS listeners (dev and tests).

One CA signs a broker certificate (SANs: 127.0.0.1 and localhost, the names clients connect
to) and a client certificate (for mutual TLS). Each key file is PEM in the layout Kafka's Java
PEM key store and Python's ``ssl`` both read: an unencrypted PKCS#8 key, then the certificate
chain, mode 0600. Made with ``cryptography`` in milliseconds, where keytool needs a JVM per step.
"""
from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ipcount.rules.private_files import write_private_file

VALID_DAYS = 825


@dataclass(frozen=True)
class DevTls:
    """The files of one dev CA under ``directory``."""
    directory: Path

    @property
    def ca_pem(self) -> Path:
        """The CA's certificate: what clients trust (``kafka_ssl_cafile``)."""
        return self.directory / "ca.pem"

    @property
    def broker_pem(self) -> Path:
        """The broker's key and chain (its PEM key store)."""
        return self.directory / "broker.pem"

    @property
    def client_pem(self) -> Path:
        """A client's key and chain (``kafka_ssl_client_pem``), for mutual TLS."""
        return self.directory / "client.pem"

    def ensure(self, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> DevTls:
        """Make the CA and both certificates unless all are there (idempotent)."""
        if all(p.exists() for p in (self.ca_pem, self.broker_pem, self.client_pem)):
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ipcount dev CA")])
        ca_cert = (_builder(ca_name, ca_name, ca_key)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(_usage(cert_sign=True), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        sans = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
        broker = _leaf("ipcount dev broker", ExtendedKeyUsageOID.SERVER_AUTH, ca_name, ca_key,
                       x509.SubjectAlternativeName(sans))
        client = _leaf("ipcount", ExtendedKeyUsageOID.CLIENT_AUTH, ca_name, ca_key)
        write_private_file(self.broker_pem, _key_and_chain(*broker, ca_cert))
        write_private_file(self.client_pem, _key_and_chain(*client, ca_cert))
        self.ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        return self


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=VALID_DAYS)))


def _usage(cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
                         encipher_only=False, decipher_only=False)


def _leaf(common_name: str, purpose: x509.ObjectIdentifier, ca_name: x509.Name, ca_key: ec.EllipticCurvePrivateKey,
          sans: x509.SubjectAlternativeName | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), ca_name, key)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_usage(), critical=True)
               .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False))
    if sans is not None:
        builder = builder.add_extension(sans, critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _key_and_chain(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, ca_cert: x509.Certificate) -> bytes:
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
            + cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ipcount_lab.dev_tls",
        description="Make a throwaway CA, a broker certificate for the given host names and a client "
                    "certificate in DIRECTORY (ca.pem, broker.pem, client.pem; the key files mode 0600), "
                    "unless they are there. For dev and test brokers only.")
    parser.add_argument("directory")
    parser.add_argument("--host", action="append", default=None,
                        help="a name or IP address clients connect to (repeat; default 127.0.0.1 and localhost)")
    args = parser.parse_args(argv)
    tls = DevTls(Path(args.directory)).ensure(tuple(args.host or ("127.0.0.1", "localhost")))
    print(f"dev CA {tls.ca_pem}, broker key and chain {tls.broker_pem}, client key and chain {tls.client_pem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
