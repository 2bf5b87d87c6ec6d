"""Registry authentication, the pure parts: ``WWW-Authenticate`` challenges (RFC 7235
syntax), the token request of the Docker/OCI bearer flow, and the token answer.

The flow (https://distribution.github.io/distribution/spec/auth/token/): a request
answered 401 carries ``WWW-Authenticate: Bearer realm="…",service="…",scope="…"``; the
client GETs ``realm?service=…&scope=…`` (with basic credentials when it has them) and
retries with ``Authorization: Bearer <token>``. ``Basic realm="…"`` means: send the
credentials as HTTP basic auth.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import urlencode, urlsplit

from hutch.errors import InvalidArgument, RegistryError

__all__ = [
    "Challenge",
    "Credentials",
    "parse_token_response",
    "parse_www_authenticate",
    "token_url",
]

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_SCHEME_RE = re.compile(rf"\s*({_TOKEN})\s*")
_PARAM_RE = re.compile(rf"\s*({_TOKEN})\s*=\s*(?:\"((?:[^\"\\]|\\.)*)\"|({_TOKEN}))\s*")


@dataclass(frozen=True)
class Credentials:
    """Basic credentials (``username``/``password``) or a ready ``token`` (sent as
    ``Bearer``, or exchanged with the realm if the registry asks for its own)."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.username is None) != (self.password is None):
            raise InvalidArgument("registry credentials need both username and password")
        if self.token is not None and self.username is not None:
            raise InvalidArgument("give registry username/password or a token, not both")

    @property
    def basic(self) -> tuple[str, str] | None:
        if self.username is None or self.password is None:
            return None
        return (self.username, self.password)


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower case: "bearer", "basic"
    params: dict[str, str]

    @property
    def realm(self) -> str | None:
        return self.params.get("realm")


def parse_www_authenticate(header: str) -> list[Challenge]:
    """Every challenge in one ``WWW-Authenticate`` value, in order. Parameter names are
    lower-cased; values are unquoted. ``InvalidArgument`` for text that is not the
    RFC 7235 ``challenge`` syntax (token68 challenges are accepted as a ``token68``
    parameter)."""
    out: list[Challenge] = []
    pos = 0
    n = len(header)
    while pos < n:
        while pos < n and header[pos] in " ,\t":
            pos += 1
        if pos >= n:
            break
        m = _SCHEME_RE.match(header, pos)
        if m is None:
            raise InvalidArgument(f"WWW-Authenticate {header!r}: no scheme at offset {pos}")
        scheme = m.group(1).lower()
        pos = m.end()
        params: dict[str, str] = {}
        while pos < n:
            p = _PARAM_RE.match(header, pos)
            if p is None:
                # token68 (e.g. "Negotiate abc==") or the start of the next challenge.
                t68 = re.compile(r"\s*([A-Za-z0-9._~+/-]+=*)\s*(?:,|$)").match(header, pos)
                if t68 is not None and not params and not _starts_challenge(header, pos):
                    params["token68"] = t68.group(1)
                    pos = t68.end()
                break
            quoted = p.group(2)
            value = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else p.group(3)
            params[p.group(1).lower()] = value
            pos = p.end()
            if pos < n and header[pos] == ",":
                pos += 1
                if _starts_challenge(header, pos):
                    break
            elif pos < n:
                raise InvalidArgument(f"WWW-Authenticate {header!r}: expected ',' at offset {pos}")
        out.append(Challenge(scheme, params))
    return out


def _starts_challenge(header: str, pos: int) -> bool:
    """At ``pos`` a new challenge begins (``scheme`` then a param or end), not a param."""
    m = _SCHEME_RE.match(header, pos)
    if m is None:
        return False
    after = m.end()
    return after >= len(header) or (
        _PARAM_RE.match(header, after) is not None and (header[after - 1].isspace())
    )


def token_url(challenge: Challenge, scope: str) -> str:
    """The token request for a bearer challenge (``realm?service=…&scope=…``).
    ``RegistryError`` when the realm is missing or not an http(s) URL."""
    realm = challenge.realm
    if not realm or urlsplit(realm).scheme not in ("http", "https") or not urlsplit(realm).netloc:
        raise RegistryError(
            f"the registry's bearer challenge has no usable realm ({realm!r}); "
            "it must name an http(s) token service"
        )
    query = {}
    if "service" in challenge.params:
        query["service"] = challenge.params["service"]
    query["scope"] = challenge.params.get("scope") or scope
    sep = "&" if "?" in realm else "?"
    return realm + sep + urlencode(query)


def parse_token_response(body: bytes) -> str:
    """The token from the token service's JSON (``token``, or OAuth2 ``access_token``)."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise RegistryError("the registry's token service answered something not JSON") from exc
    token = data.get("token") or data.get("access_token") if isinstance(data, dict) else None
    if not isinstance(token, str) or not token:
        raise RegistryError("the registry's token service answered without a token")
    return token
