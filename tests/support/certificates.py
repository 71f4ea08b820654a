"""Throw-away certificates for TLS tests, made with the openssl command line in a test's tmp_path
(never committed): a CA, a server certificate for 127.0.0.1, a client certificate the CA signed,
and a client certificate from a CA the server does not know."""

from __future__ import annotations

import subprocess
from pathlib import Path

KEY_OPTIONS = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _authority(directory: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        *KEY_OPTIONS,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        cwd=directory,
    )


def _signed(directory: Path, name: str, authority: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions + "\n")
    _openssl(
        "req", *KEY_OPTIONS, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{authority}.pem",
        "-CAkey",
        f"{authority}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-extfile",
        f"{name}.ext",
        cwd=directory,
    )


def make_certificates(directory: Path) -> Path:
    """Writes ca, server, client (signed by ca) and rogue-client (signed by rogue-ca) .pem/.key files."""
    _authority(directory, "ca")
    _authority(directory, "rogue-ca")
    _signed(directory, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    _signed(directory, "client", "ca", "extendedKeyUsage=clientAuth")
    _signed(directory, "rogue-client", "rogue-ca", "extendedKeyUsage=clientAuth")
    return directory
