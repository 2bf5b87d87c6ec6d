"""A throwaway test CA and one server certificate for every fake-internet name, made with
the ``openssl`` CLI (no extra Python dependency). Keys are EC P-256: fast to generate."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CertFiles", "make_certs"]


@dataclass(frozen=True)
class CertFiles:
    ca_cert: Path  # PEM; what clients trust
    server_cert: Path  # PEM; SANs = every name passed to make_certs
    server_key: Path  # PEM, unencrypted


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def make_certs(directory: Path, names: Sequence[str], days: int = 2) -> CertFiles:
    """Write ``ca.pem``, ``server.pem`` and ``server.key`` into ``directory``.

    One certificate covers all ``names`` (SNI decides nothing about which certificate is
    served: the servers *record* the SNI they saw, which is what the tests check).
    Raises RuntimeError with openssl's message when it fails.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(days),
        "-subj", "/CN=hutch fake internet test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", *ec, "-keyout", "server.key", "-out", "server.csr",
        "-subj", f"/CN={names[0]}", cwd=directory,
    )  # fmt: skip
    san = ",".join(f"DNS:{n}" for n in names)
    (directory / "server.ext").write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", str(days),
        "-extfile", "server.ext", cwd=directory,
    )  # fmt: skip
    return CertFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
