"""The contract suite's two targets (``tests/component/test_contract*.py``): the in-memory
fake (``hutch.testing.FakeHutch``) and the real app (real service, store, NetworkManager on
its in-memory dataplane, the real guest agent in bubblewrap; in-process through httpx's
ASGI transport), each behind one transport that checks every JSON answer against the
committed ``openapi.json``. A test module imports ``target`` (the fixture) from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from hutch.api import create_app
from hutch.config import Settings
from hutch.sdk import AsyncClient, AsyncSandbox
from hutch.testing import FakeHutch
from tests.component.conftest import API_KEY, started_services
from tests.component.openapi_check import CheckedTransport

__all__ = ["BASE_URL", "HOST_LABELS", "Target", "error", "target"]

BASE_URL = "http://hutch.test"


@dataclass
class Target:
    """One implementation under test: an SDK client and a raw client on one checked
    transport."""

    kind: str
    #: The component tier's backend runs the agent without a disk (tmpfs /root, /tmp):
    #: files do not reach fork children or snapshot copies there. Real VMs prove that
    #: (tests/vm/test_pause_fork.py); the fake models it, and is checked here.
    has_disk: bool
    client: AsyncClient
    raw: httpx.AsyncClient
    checked: CheckedTransport

    async def sandbox(self, **kw: Any) -> AsyncSandbox:
        return await AsyncSandbox.create(client=self.client, **kw)


#: The one host's labels (HUTCH_HOST_LABELS) on both targets.
HOST_LABELS = {"zone": "eu-1", "tier": "gpu"}


@pytest.fixture(params=["fake", "real"])
async def target(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> AsyncIterator[Target]:
    async with contextlib.AsyncExitStack() as stack:
        inner: httpx.AsyncBaseTransport
        if request.param == "fake":
            fake = FakeHutch(api_key=API_KEY)
            fake.host_labels = dict(HOST_LABELS)
            inner = fake.transport
        else:
            labelled = replace(settings.cluster, labels=tuple(HOST_LABELS.items()))
            settings = replace(settings, cluster=labelled)
            svc = await stack.enter_async_context(
                started_services(settings, tmp_path, networked=True)
            )
            inner = httpx.ASGITransport(app=create_app(svc, API_KEY, manage_service=False))
        checked = CheckedTransport(inner)
        client = AsyncClient(base_url=BASE_URL, api_key=API_KEY, transport=checked)
        stack.push_async_callback(client.aclose)
        raw = httpx.AsyncClient(
            base_url=BASE_URL, transport=checked, headers={"Authorization": f"Bearer {API_KEY}"}
        )
        stack.push_async_callback(raw.aclose)
        yield Target(request.param, request.param == "fake", client, raw, checked)
        assert checked.checked > 0, "no JSON answer was checked against openapi.json"


def error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    message: str = body["message"]
    return message
