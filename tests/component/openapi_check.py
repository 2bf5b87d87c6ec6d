"""An httpx transport that checks every answer against the committed ``openapi.json``.

Wrapped around the transport of a client under test, it fails the test (``AssertionError``
naming the operation) when an answer's status is not documented for its operation or a
JSON body does not match the documented schema. Streamed bodies (NDJSON, bytes) are
passed through unchecked: their own tests read them.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import httpx
from jsonschema import Draft202012Validator

SPEC_PATH = Path(__file__).resolve().parents[2] / "openapi.json"

__all__ = ["CheckedTransport", "Operations"]


class Operations:
    """The operations of the spec: (method, path template) -> its responses."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._routes: list[tuple[re.Pattern[str], str, str]] = []
        for template, ops in spec["paths"].items():
            pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$")
            for method in ops:
                self._routes.append((pattern, method.upper(), template))
        # Literal paths before templated ones: /files/list is not /files/{x}.
        self._routes.sort(key=lambda r: r[2].count("{"))

    def find(self, method: str, path: str) -> str | None:
        return next((t for p, m, t in self._routes if m == method and p.match(path)), None)

    def response(self, method: str, template: str, status: int) -> dict[str, Any] | None:
        responses: dict[str, Any] = self.spec["paths"][template][method.lower()]["responses"]
        found: dict[str, Any] | None = responses.get(str(status)) or responses.get("default")
        return found

    @cache  # noqa: B019 - one Operations per test session
    def validator(self, method: str, template: str, status: int) -> Draft202012Validator | None:
        documented = self.response(method, template, status) or {}
        schema = documented.get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            return None
        # References are "#/components/...": resolve them inside one document.
        whole = {**schema, "components": self.spec["components"]}
        return Draft202012Validator(whole, format_checker=Draft202012Validator.FORMAT_CHECKER)


@cache
def operations() -> Operations:
    return Operations(json.loads(SPEC_PATH.read_text()))


class CheckedTransport(httpx.AsyncBaseTransport):
    """Sends through ``inner``; checks each answer. ``checked`` counts JSON bodies checked."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.ops = operations()
        self.checked = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        method, path = request.method, request.url.path
        template = self.ops.find(method, path)
        assert template is not None, f"{method} {path} is not an operation of openapi.json"
        response = await self.inner.handle_async_request(request)
        status = response.status_code
        assert self.ops.response(method, template, status) is not None, (
            f"{method} {template} answered {status}, which openapi.json does not document"
        )
        if not response.headers.get("content-type", "").startswith("application/json"):
            return response
        body = await response.aread()
        await response.aclose()
        validator = self.ops.validator(method, template, status)
        if validator is not None and body:
            errors = sorted(validator.iter_errors(json.loads(body)), key=str)
            assert not errors, (
                f"{method} {template} -> {status}: the body does not match openapi.json: "
                f"{errors[0].message} at {list(errors[0].absolute_path)}\n{body[:500]!r}"
            )
            self.checked += 1
        headers = [
            (k, v)
            for k, v in response.headers.multi_items()
            if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")
        ]
        return httpx.Response(status, headers=headers, content=body, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()
