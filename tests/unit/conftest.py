"""Shared fixtures of the unit tests: the CLI driven by CliRunner against the SDK fake."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hutch.cli._env import CliEnv
from hutch.cli.main import cli
from hutch.testing import FakeHutch


@pytest.fixture
def fake() -> FakeHutch:
    return FakeHutch()


@pytest.fixture
def hutch(fake: FakeHutch) -> Any:
    def run(*args: str) -> Result:
        argv = ["--api-key", fake.api_key, *args]
        result = CliRunner().invoke(cli, argv, obj=CliEnv(transport=fake.transport))
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result

    return run


def last(fake: FakeHutch) -> tuple[str, str, Any]:
    request = fake.requests[-1]
    body = json.loads(request.content) if request.content else None
    return request.method, request.url.path, body


def inspect_rows(text: str) -> dict[str, str]:
    """`hutch inspect` output ("key:  value" lines) as a dict."""
    rows = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        rows[key] = value.strip()
    return rows
