"""The secrets' crypto envelope: AES-256-GCM under the key file ``<state>/secrets.key``.

Each value is sealed with a fresh random 96-bit nonce; the associated data binds the
ciphertext to its row, ``hutch.secret.v1 NUL project NUL name NUL version``, so a
ciphertext copied to another project, name or version (a swapped or replayed row) fails
authentication instead of decrypting as another secret. The key id stored with each row
(a keyed digest of the key, not the key) tells "sealed under another key" (the key file
was replaced) apart from "altered" (the row was tampered with).

The key file (64 hex characters and a newline, mode 0600) lives outside the database, so
a copy of ``hutch.db`` alone reveals nothing. It is created on the first start of a
daemon with no secrets; a file that is missing, unreadable, open to group or others, or
malformed is a :class:`~hutch.errors.SecretError` at the first use that needs it (never
an empty value), and is never silently replaced while sealed secrets exist.
"""

from __future__ import annotations

import hashlib
import os
import secrets as stdlib_secrets
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hutch.errors import SecretError
from hutch.store.secrets import SealedValue

__all__ = ["KEY_BYTES", "NONCE_BYTES", "SecretKey", "associated_data", "open_value", "seal"]

KEY_BYTES = 32
NONCE_BYTES = 12
_AAD_LABEL = b"hutch.secret.v1"
_KEY_ID_LABEL = b"hutch.secrets.key-id\0"


def associated_data(project: str, name: str, version: int) -> bytes:
    """What a ciphertext is bound to (names and projects never contain NUL)."""
    return b"\0".join((_AAD_LABEL, project.encode(), name.encode(), str(version).encode()))


class SecretKey:
    """The key file. Read at every use (a few microseconds), so what a call sees is
    always the file as it is now: a removed or replaced file shows at once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def exists(self) -> bool:
        return self.path.exists()

    def create(self) -> None:
        """Write a new random key, 0600, atomically (a temporary file linked into
        place: two daemons racing keep one key, a crash leaves no half-written file).
        ``SecretError`` if it exists already."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(stdlib_secrets.token_bytes(KEY_BYTES).hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise SecretError(f"the secrets key file {self.path} exists already") from None
        finally:
            tmp.unlink(missing_ok=True)

    def load(self) -> tuple[str, AESGCM]:
        """(key id, cipher). ``SecretError`` naming the file and the fix otherwise."""
        try:
            st = os.stat(self.path)
            if st.st_mode & 0o077:
                raise SecretError(
                    f"the secrets key file {self.path} is open to group or others (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}); make it 0600 (chmod 600) and check "
                    "who read it"
                )
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            raise SecretError(
                f"the secrets key file {self.path} is missing, so no stored secret can be "
                "decrypted; restore it from your backup (mode 0600)"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SecretError(f"cannot read the secrets key file {self.path}: {exc}") from exc
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != KEY_BYTES:
            raise SecretError(
                f"the secrets key file {self.path} is not a hutch secrets key (expected "
                f"{2 * KEY_BYTES} hex characters); restore it from your backup"
            )
        return key_id_of(key), AESGCM(key)


def key_id_of(key: bytes) -> str:
    return hashlib.sha256(_KEY_ID_LABEL + key).hexdigest()[:16]


def seal(key: SecretKey, project: str, name: str, version: int, value: bytes) -> SealedValue:
    key_id, aead = key.load()
    nonce = stdlib_secrets.token_bytes(NONCE_BYTES)
    ciphertext = aead.encrypt(nonce, value, associated_data(project, name, version))
    return SealedValue(key_id, nonce, ciphertext)


def open_value(key: SecretKey, project: str, name: str, version: int, sealed: SealedValue) -> bytes:
    """The value, or ``SecretError`` (wrong key, or a row that fails authentication)."""
    key_id, aead = key.load()
    what = f"secret {name!r} (version {version}) of project {project!r}"
    if sealed.key_id != key_id:
        raise SecretError(
            f"{what} was sealed with key {sealed.key_id}, but {key.path} holds key "
            f"{key_id}: the key file was replaced; restore the original key file"
        )
    try:
        return aead.decrypt(
            sealed.nonce, sealed.ciphertext, associated_data(project, name, version)
        )
    except InvalidTag:
        raise SecretError(
            f"{what} fails authentication: its stored row was altered or copied from "
            "another secret; set the secret again"
        ) from None
