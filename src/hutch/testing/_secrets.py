"""The fake's ``/v1/secrets``: write-only values, as the REST contract describes them.

Values are kept in memory in clear (``FakeSecrets.values``, for a test to check what its
code stored); like the daemon, no route answers one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

import httpx

from hutch.contract.auth import DEFAULT_PROJECT
from hutch.contract.names import validate_secret_name, validate_secret_value
from hutch.errors import Conflict, InvalidArgument, NotFound

__all__ = ["FakeSecrets"]

TIME = "2026-01-01T00:00:00Z"


class FakeSecrets:
    def __init__(self, users: Callable[[str], list[str]]) -> None:
        #: name -> current value (test-side only).
        self.values: dict[str, str] = {}
        self.versions: dict[str, int] = {}
        self._users = users

    def view(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "project": DEFAULT_PROJECT,
            "version": self.versions[name],
            "created_at": TIME,
            "updated_at": TIME,
        }

    def check_refs(self, env_secrets: Mapping[str, str]) -> None:
        for var, name in env_secrets.items():
            if name not in self.values:
                raise InvalidArgument(
                    f"env_secrets[{var!r}] names secret {name!r}, which does not exist in "
                    f"project {DEFAULT_PROJECT!r}; create it first (hutch secret set {name})"
                )

    def route(self, method: str, path: str, request: httpx.Request) -> httpx.Response:
        if path == "/v1/secrets" and method == "GET":
            return httpx.Response(
                200, json={"secrets": [self.view(n) for n in sorted(self.values)]}
            )
        match = re.fullmatch(r"/v1/secrets/([^/]+)", path)
        if not match:
            raise NotFound(f"no route {method} {path}")
        name = validate_secret_name(unquote(match.group(1)))
        if method == "PUT":
            body = json.loads(request.content or b"{}")
            if not isinstance(body, dict) or set(body) - {"value"}:
                raise InvalidArgument("body: only 'value' is accepted")
            if "value" not in body:
                raise InvalidArgument("value: Field required")
            value = body["value"]
            if not isinstance(value, str):
                raise InvalidArgument("value: Input should be a valid string")
            validate_secret_value(value)
            created = name not in self.values
            self.values[name] = value
            self.versions[name] = self.versions.get(name, 0) + 1
            return httpx.Response(201 if created else 200, json=self.view(name))
        if name not in self.values:
            raise NotFound(f"no secret named {name!r} in project {DEFAULT_PROJECT!r}")
        if method == "GET":
            return httpx.Response(200, json=self.view(name))
        if method == "DELETE":
            users = self._users(name)
            if users:
                raise Conflict(
                    f"secret {name!r} is used by the env_secrets of sandbox(es) "
                    f"{', '.join(users)}; delete them first (a replace needs no delete: PUT "
                    "a new value)"
                )
            del self.values[name], self.versions[name]
            return httpx.Response(204)
        raise NotFound(f"no route {method} {path}")
