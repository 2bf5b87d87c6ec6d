"""Credentials of the E2B face: API keys, per-sandbox access tokens, signed file URLs.

**API keys.** E2B clients send ``X-API-KEY: e2b_<hex>``. hutch's form of that is the
*hutch key itself, hex-encoded*: ``e2b_`` + ``key.encode().hex()``. Decoding gives back
the hutch key, which is checked exactly as the REST API checks it (:func:`verify_api_key`;
a hutch key sent as is, ``hk_...``, is accepted too: today's E2B SDKs no longer check
the shape client-side). So no second key store exists: an E2B key *is* a hutch key,
with hutch's roles and projects. The daemon writes the admin key's E2B form to
``<state>/e2b-api-key`` (0600) next to ``api-key``.

A project key (issue 10) works the same way: ``verify_api_key`` hands the decoded
hutch secret to the REST API's :class:`~hutch.api.auth.Authenticator` and returns that
key's ``Principal``; every control route checks the principal's permission
(:func:`hutch.e2b.face.needs`) and looks sandboxes up in its project only.

**Access tokens.** E2B hands out ``envdAccessToken`` (sent by clients as
``X-Access-Token`` to the sandbox's envd) and ``trafficAccessToken``
(``E2B-Traffic-Access-Token``, to its other ports). hutch derives both from the sandbox
id with an HMAC keyed by ``<state>/e2b-token-secret`` (32 random bytes, 0600, made on
first start), so they are stable across daemon restarts, need no storage, are distinct
per sandbox (fork children included), and prove that whoever presents one got it from
the control plane with a valid key.

**Signed URLs.** ``Sandbox.download_url``/``upload_url`` sign ``path:operation:user:token
[:expiration]`` with SHA-256 client-side (E2B's "v1" signature). A signed URL names no
sandbox, so the face finds it by checking the signature against each live sandbox's
token (:func:`signature_matches`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from hutch.api.auth import Authenticator
from hutch.contract.auth import Principal
from hutch.errors import Unauthorized

__all__ = [
    "E2B_KEY_PREFIX",
    "E2bPrincipal",
    "TokenIssuer",
    "e2b_form",
    "file_signature",
    "hutch_form",
    "load_or_create_secret",
    "signature_matches",
    "verify_api_key",
    "write_e2b_key_file",
]

E2B_KEY_PREFIX = "e2b_"
_ENVD = "e2b_envd_"
_TRAFFIC = "e2b_traffic_"


#: The caller of an E2B request: the same principal the REST API makes.
E2bPrincipal = Principal


def e2b_form(hutch_key: str) -> str:
    """The E2B-shaped spelling of a hutch key: ``e2b_`` + the key's bytes in hex."""
    return E2B_KEY_PREFIX + hutch_key.encode().hex()


def hutch_form(presented: str) -> str:
    """The hutch key an E2B client presented (either spelling); Unauthorized when an
    ``e2b_`` key is not hex of a UTF-8 key."""
    if not presented.startswith(E2B_KEY_PREFIX):
        return presented
    try:
        return bytes.fromhex(presented[len(E2B_KEY_PREFIX) :]).decode()
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise Unauthorized(
            "wrong API key: hutch's E2B keys are e2b_ followed by the hutch key in hex "
            "(the daemon writes it to <state_dir>/e2b-api-key); the hutch key itself "
            "(hk_...) works too"
        ) from exc


def verify_api_key(presented: str | None, auth: Authenticator, source: str = "") -> Principal:
    """Check the ``X-API-KEY`` (or Bearer) value an E2B client sent: the hutch key it
    spells goes through the REST API's own key lookup (admin or project key)."""
    if not presented:
        raise Unauthorized(
            "missing API key: set E2B_API_KEY to the contents of <state_dir>/e2b-api-key "
            "(or to the hutch API key)"
        )
    return auth.principal(hutch_form(presented), None, source)


def load_or_create_secret(path: Path) -> bytes:
    """The token secret (32 random bytes, 0600), created on first use."""
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    data = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return data


def write_e2b_key_file(path: Path, hutch_key: str) -> None:
    """``<state>/e2b-api-key``: the admin key in E2B form and a newline (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(e2b_form(hutch_key) + "\n")
    os.chmod(path, 0o600)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class TokenIssuer:
    """Derives and checks the per-sandbox access tokens."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, purpose: str, sandbox_id: str) -> bytes:
        return hmac.new(self._secret, f"{purpose}:{sandbox_id}".encode(), hashlib.sha256).digest()

    def envd_token(self, sandbox_id: str) -> str:
        return _ENVD + _b64(self._mac("envd", sandbox_id))

    def traffic_token(self, sandbox_id: str) -> str:
        return _TRAFFIC + _b64(self._mac("traffic", sandbox_id))

    def accepts(self, sandbox_id: str, token: str | None) -> bool:
        """Whether ``token`` is either of ``sandbox_id``'s tokens (constant time)."""
        if not token:
            return False
        given = token.encode(errors="surrogatepass")
        ok_envd = hmac.compare_digest(given, self.envd_token(sandbox_id).encode())
        ok_traffic = hmac.compare_digest(given, self.traffic_token(sandbox_id).encode())
        return ok_envd or ok_traffic


def file_signature(
    path: str, operation: str, user: str | None, token: str, expiration: int | None
) -> str:
    """E2B's v1 file-URL signature (what the SDKs compute in ``get_signature``)."""
    raw = f"{path}:{operation}:{user or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode()


def signature_matches(
    signature: str,
    path: str,
    operation: str,
    user: str | None,
    token: str,
    expiration: int | None,
) -> bool:
    expected = file_signature(path, operation, user, token, expiration)
    return hmac.compare_digest(signature.encode(errors="surrogatepass"), expected.encode())
