"""The egress proxy's certificate authorities (TLS inspection ``full``, and ``partial``
for the names a request rule needs).

One CA per project (:class:`ProjectCAs`), made on the project's first use (EC P-256,
``cryptography``): ``<state>/egress-ca/projects/<project>/ca.pem`` (public: it is what
that project's sandboxes trust) and ``ca.key`` (0600, in 0700 directories; it never
leaves the host and never enters a guest). A guest trusts only its own project's CA, so
a leaf minted for one project's sandbox is worth nothing to another's clients.
Rotation: stop the daemon (or let no inspected sandbox run), remove the project's
directory; the next use makes a new CA, and sandboxes get it at their next create or
egress PUT (running ones keep trusting the old one until then). For each server
name a guest asks for (TLS SNI) the proxy presents a leaf certificate for exactly that
name, signed by the CA and minted on first use; leaves are kept in memory (an LRU of
:data:`LEAF_CACHE` names) as ready ``ssl.SSLContext`` objects, so a name costs one
signature per daemon run, not one per connection.

Leaves share one key made per daemon run (in memory only): minting is then a signature,
not a key generation, and a leaf's key is worth no more than the CA key that signs it.
A leaf lives :data:`LEAF_DAYS` days, starts an hour in the past (guest clocks drift) and
is re-minted when fewer than 1 day remains. ``ssl`` loads certificates only from files,
so a leaf's PEM is written to a private temporary file, loaded and deleted at once.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hutch.contract.names import NAME_RE
from hutch.errors import NetworkError

__all__ = ["LEAF_CACHE", "LEAF_DAYS", "EgressCA", "ProjectCAs", "upstream_context"]

LEAF_CACHE = 1024
LEAF_DAYS = 7
CA_YEARS = 10
_CA_NAME = "hutch egress inspection CA"
_CA_USAGE = dict.fromkeys(
    ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
     "key_agreement", "encipher_only", "decipher_only"),
    False,
) | {"key_cert_sign": True, "crl_sign": True}  # fmt: skip


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class _Leaf:
    context: ssl.SSLContext
    not_after: datetime.datetime


class EgressCA:
    """Load or create the CA in ``directory`` (see the module docstring). Raises
    NetworkError naming the file when it cannot be read or written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cert_path = directory / "ca.pem"
        self.key_path = directory / "ca.key"
        self._key, self._cert = self._load_or_create()
        self.cert_pem: bytes = self._cert.public_bytes(serialization.Encoding.PEM)
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        self._leaves: OrderedDict[str, _Leaf] = OrderedDict()
        self._lock = threading.Lock()  # the data path mints; tests may call from others

    def _load_or_create(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        try:
            if self.key_path.exists() and self.cert_path.exists():
                key = serialization.load_pem_private_key(self.key_path.read_bytes(), None)
                cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
                if not isinstance(key, ec.EllipticCurvePrivateKey):
                    raise NetworkError(f"{self.key_path}: not an EC private key")
                return key, cert
            self.directory.mkdir(parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)
            key = ec.generate_private_key(ec.SECP256R1())
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME)])
            now = _now()
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(**_CA_USAGE),
                    critical=True,
                )
                .add_extension(
                    x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
                )
                .sign(key, hashes.SHA256())
            )
            key_pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            # The key first, created 0600 (never readable by others, not even briefly);
            # the certificate last: its presence says the pair is complete.
            tmp = self.key_path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(key_pem)
            os.replace(tmp, self.key_path)
            tmp_cert = self.cert_path.with_suffix(".tmp")
            tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            os.replace(tmp_cert, self.cert_path)
            return key, cert
        except (OSError, ValueError) as exc:
            raise NetworkError(f"egress CA in {self.directory}: {exc}") from exc

    def server_context(self, name: str) -> ssl.SSLContext:
        """A server-side context presenting a leaf for ``name`` (a normalized host name),
        ALPN ``h2`` then ``http/1.1`` (both inspected), TLS 1.2 or later."""
        with self._lock:
            leaf = self._leaves.get(name)
            if leaf is not None and leaf.not_after - _now() > datetime.timedelta(days=1):
                self._leaves.move_to_end(name)
                return leaf.context
            leaf = self._mint(name)
            self._leaves[name] = leaf
            while len(self._leaves) > LEAF_CACHE:
                self._leaves.popitem(last=False)
            return leaf.context

    def _mint(self, name: str) -> _Leaf:
        now = _now()
        not_after = now + datetime.timedelta(days=LEAF_DAYS)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["h2", "http/1.1"])  # net/h2_relay.py, net/inspected_http.py
        pem = cert.public_bytes(serialization.Encoding.PEM) + self._leaf_key_pem
        with tempfile.NamedTemporaryFile(prefix="leaf-", suffix=".pem") as tmp:
            tmp.write(pem)  # NamedTemporaryFile is 0600
            tmp.flush()
            ctx.load_cert_chain(tmp.name)
        return _Leaf(ctx, not_after)


class ProjectCAs:
    """The CA of each project, under ``root/projects/<project>/`` (see the module
    docstring), loaded or made on first use and then kept. Thread-safe: the API thread
    asks for a project's certificate (to install it in a guest), the data path for its
    leaves. Raises NetworkError naming the directory when a CA cannot be read or made,
    InvalidArgument-free: a project name that is not a plain name is refused here."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cas: dict[str, EgressCA] = {}
        self._lock = threading.Lock()

    def directory(self, project: str) -> Path:
        if not NAME_RE.match(project):
            raise NetworkError(f"egress CA: {project!r} is not a project name")
        return self.root / "projects" / project

    def for_project(self, project: str) -> EgressCA:
        with self._lock:
            ca = self._cas.get(project)
            if ca is None:
                directory = self.directory(project)
                try:
                    for parent in (self.root, directory.parent):
                        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                        os.chmod(parent, 0o700)
                except OSError as exc:
                    raise NetworkError(f"egress CA in {directory}: {exc}") from exc
                ca = self._cas[project] = EgressCA(directory)
            return ca

    def cert_pem(self, project: str) -> bytes:
        """The project's CA certificate (PEM), made now if it does not exist yet."""
        return self.for_project(project).cert_pem


def upstream_context(cafile: Path | None) -> ssl.SSLContext:
    """How the proxy verifies the real servers when it terminates TLS: the host's trust
    store, or only the CAs in ``cafile`` (``HUTCH_EGRESS_UPSTREAM_CA``). Names and
    certificates are always checked; HTTP/1.1 only (a guest's HTTP/2 streams go up as
    HTTP/1.1 requests, :mod:`hutch.net.h2_relay`)."""
    try:
        ctx = ssl.create_default_context(cafile=str(cafile) if cafile else None)
    except (OSError, ssl.SSLError) as exc:
        raise NetworkError(f"egress upstream CA {cafile}: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
