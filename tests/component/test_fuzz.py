"""Fuzz the REST API from the committed ``openapi.json`` (schemathesis), plus hand-written
malformed requests.

The app runs in-process (real service, store and REST app; the real guest agent in
bubblewrap via ``FakeBackend``) behind a real uvicorn on loopback, in a thread with its own
event loop: schemathesis' tests are synchronous and call it over HTTP with ``requests``.

What must hold for every generated request: no 5xx (except the documented 504 of an exec
whose own ``timeout_s`` ran out) and, for the answers the spec describes, a body that
matches the spec. ``HUTCH_FUZZ_EXAMPLES`` raises the number of examples per operation
(default 10: the run stays under a minute on a busy 2-core host).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from hutch.api import create_app
from hutch.config import Limits, Settings
from hutch.daemon import build_services
from hutch.models import SandboxSpec
from hutch.net.dataplane import MemoryDataplane
from hutch.services.composed import Services
from hutch.services.network import NetworkService as NetworkManager
from hutch.store import Store
from tests.component.conftest import API_KEY, FakeImages
from tests.component.fake_backend import FakeBackend
from tests.conftest import delete_live_sandboxes

REPO = Path(__file__).resolve().parents[2]
SPEC_PATH = REPO / "openapi.json"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = int(os.environ.get("HUTCH_FUZZ_EXAMPLES", "10"))
# Generous bound per request: a generated exec may legitimately run a while (the fake
# sandbox runs whatever string it is given under /bin/sh).
REQUEST_TIMEOUT_S = 30.0

# Streams that end only when the client leaves (watch, a process's output or its wait, a
# sandbox's followed events: ``follow=true`` on the live fuzz sandbox), or tar streams (an
# archive of "/" would tar the whole guest; schemathesis cannot generate tar bodies): their
# own tests cover them, malformed archives included.
schema = (
    schemathesis.openapi.from_path(SPEC_PATH)
    .exclude(path_regex=r"/files/(watch|archive)$")
    .exclude(path_regex=r"/processes/\{pid\}/(output|wait)$")
    .exclude(path_regex=r"/sandboxes/\{sandbox_id\}/events$")
    # Image pulls would reach out to registries named by generated refs: never (the
    # fuzz app takes no imports anyway); tests/component/test_api_images.py covers them.
    .exclude(path=r"/v1/images", method="POST")
)


@dataclass(frozen=True)
class Served:
    url: str
    #: A running sandbox; operations on one sandbox are pointed at it so the fuzzer
    #: reaches exec and the file handlers instead of stopping at 404.
    sandbox_id: str
    backend: FakeBackend


class _AppThread:
    """The service and a uvicorn server on a private event loop in a daemon thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-app", daemon=True)
        self.backend = FakeBackend(root / "run")
        self.svc: Services | None = None
        self.server: uvicorn.Server | None = None
        self.serve_task: asyncio.Task[None] | None = None
        self.sock = socket.socket()

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    async def _start(self) -> str:
        settings = Settings(
            state_dir=self.root / "state",
            # Generated creates pile up; past this they get 429, which is also an answer
            # the fuzzer must see handled.
            limits=Limits(max_sandboxes=12, max_memory_mib=64 * 1024),
            dns_upstream=("127.0.0.1", 1),
        )
        store = Store(settings.database)
        # The real NetworkManager on an in-memory dataplane: the networking routes are
        # fuzzed too, without taps or nft on the host.
        net = NetworkManager(settings, store, names=lambda _sid: None, dataplane=MemoryDataplane())
        self.svc = build_services(settings, store, self.backend, FakeImages(self.root), net=net)
        await self.svc.start()
        rec = await self.svc.sandboxes.create(SandboxSpec(image="base"))
        app = create_app(self.svc, API_KEY, manage_service=False)
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.serve_task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
            if self.serve_task.done():
                self.serve_task.result()
        return rec.id

    async def _stop(self) -> None:
        if self.server is not None and self.serve_task is not None:
            self.server.should_exit = True
            await self.serve_task
        if self.svc is not None:
            await delete_live_sandboxes(self.svc)
            await self.svc.close()

    def start(self) -> Served:
        self.thread.start()
        sandbox_id = self.run(self._start())
        port = self.sock.getsockname()[1]
        return Served(f"http://127.0.0.1:{port}", sandbox_id, self.backend)

    def stop(self) -> None:
        try:
            self.run(self._stop(), timeout=120.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.sock.close()
            self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    app = _AppThread(tmp_path_factory.mktemp("fuzz"))
    try:
        yield app.start()
    finally:
        app.stop()
        assert app.backend.leftover_ids() == set(), "the fuzz run leaked sandbox resources"


# Operations that keep the generated (mostly unknown) id: deleting the fixture sandbox
# would stop the fuzzer from reaching exec and files for the rest of the run.
_KEEP_ID = {"DELETE /v1/sandboxes/{sandbox_id}"}


def _body_sets_timeout(case: schemathesis.Case[Any]) -> bool:
    return isinstance(case.body, dict) and case.body.get("timeout_s") is not None


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_committed_spec(case: schemathesis.Case[Any], served: Served) -> None:
    if "sandbox_id" in (case.path_parameters or {}) and case.operation.label not in _KEEP_ID:
        case.path_parameters = {**(case.path_parameters or {}), "sandbox_id": served.sandbox_id}
    response = case.call(base_url=served.url, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
    if response.status_code == 504 and _body_sets_timeout(case):
        # The documented answer to an exec that outlived its own timeout_s.
        assert response.json()["error"]["code"] == "timeout"
        return
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


def test_fixture_sandbox_survived_the_fuzzing(served: Served) -> None:
    """Whatever was thrown at the fixture sandbox, it still runs and answers."""
    r = httpx.get(f"{served.url}/v1/sandboxes/{served.sandbox_id}", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    r = httpx.post(
        f"{served.url}/v1/sandboxes/{served.sandbox_id}/exec",
        json={"cmd": ["echo", "ok"]},
        headers=AUTH,
        timeout=REQUEST_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert r.json()["stdout"] == "ok\n"


# -- hand-written malformed requests ---------------------------------------------------


def _post(served: Served, path: str, content: bytes, content_type: str) -> httpx.Response:
    return httpx.post(
        served.url + path,
        content=content,
        headers={**AUTH, "Content-Type": content_type},
        timeout=REQUEST_TIMEOUT_S,
    )


def _assert_client_error(response: httpx.Response, *codes: str) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["message"], body
    if codes:
        assert body["error"]["code"] in codes, body


@pytest.mark.parametrize(
    "content",
    [
        b"{",
        b"{'image': 'base'}",
        b'{"image": "base",}',
        b"\xff\xfe\x00garbage",
        b"",
        b"null",
        b"[]",
        b'"base"',
        b"1e999",
        b"[" * 10_000 + b"]" * 10_000,
    ],
    ids=[
        "truncated",
        "single-quotes",
        "trailing-comma",
        "not-utf8",
        "empty",
        "null",
        "array",
        "string",
        "huge-number",
        "deep-nesting",
    ],
)
def test_malformed_json_is_a_400(served: Served, content: bytes) -> None:
    for path in ("/v1/sandboxes", f"/v1/sandboxes/{served.sandbox_id}/exec"):
        _assert_client_error(_post(served, path, content, "application/json"), "invalid_argument")


@pytest.mark.parametrize(
    "body",
    [
        {"vcpus": "2"},
        {"vcpus": 1.5},
        {"vcpus": True},
        {"memory_mib": None},
        {"memory_mib": 127},
        {"memory_mib": 2**70},
        {"disk_gib": 0},
        {"image": ""},
        {"image": 5},
        {"env": {"A": 1}},
        {"env": ["A=1"]},
        {"env": {"1BAD": "x"}},
        {"metadata": "k=v"},
        {"metadata": {"k": ["v"]}},
        {"name": "UPPER"},
        {"name": "-leading"},
        {"timeout_s": 0},
        {"timeout_s": "10"},
    ],
)
def test_wrong_create_fields_are_a_400(served: Served, body: dict[str, Any]) -> None:
    r = _post(served, "/v1/sandboxes", json.dumps(body).encode(), "application/json")
    _assert_client_error(r, "invalid_argument")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"cmd": None},
        {"cmd": 5},
        {"cmd": []},
        {"cmd": ""},
        {"cmd": [1, 2]},
        {"cmd": ["true"], "timeout_s": 0},
        {"cmd": ["true"], "timeout_s": "soon"},
        {"cmd": ["true"], "env": {"BAD-NAME": "x"}},
        {"cmd": ["true"], "stream": [True]},
        {"cmd": ["true"], "stdin": 5},
        {"cmd": ["true"], "cwd": ""},
    ],
)
def test_wrong_exec_fields_are_a_400(served: Served, body: dict[str, Any]) -> None:
    path = f"/v1/sandboxes/{served.sandbox_id}/exec"
    _assert_client_error(_post(served, path, json.dumps(body).encode(), "application/json"))


@pytest.mark.parametrize(
    "body",
    [
        {"cmd": ["echo", "a\x00b"]},
        {"cmd": "echo a\x00b"},
        {"cmd": ["true"], "user": "ro\x00ot"},
        {"cmd": ["true"], "user": "9" * 30},
        {"cmd": ["true"], "cwd": "/tm\x00p"},
        {"cmd": ["true"], "env": {"A": "x\x00y"}},
    ],
    ids=["argv", "shell", "user", "huge-uid", "cwd", "env"],
)
def test_nul_bytes_in_exec_fields_are_a_400(served: Served, body: dict[str, Any]) -> None:
    path = f"/v1/sandboxes/{served.sandbox_id}/exec"
    _assert_client_error(
        _post(served, path, json.dumps(body).encode(), "application/json"), "invalid_argument"
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/sandboxes", {"image": "base", "gpu": True}),
        ("/v1/sandboxes", {"image": "base", "Vcpus": 2}),
        ("/v1/sandboxes/{sid}/exec", {"cmd": ["true"], "shell": True}),
        ("/v1/sandboxes/{sid}/files/mkdir", {"path": "/root/x", "parents": True}),
        ("/v1/sandboxes/{sid}/files/rename", {"source": "a", "destination": "b", "force": 1}),
    ],
)
def test_unknown_fields_are_a_400(served: Served, path: str, body: dict[str, Any]) -> None:
    url = path.format(sid=served.sandbox_id)
    r = _post(served, url, json.dumps(body).encode(), "application/json")
    _assert_client_error(r, "invalid_argument")
    # The field is named, so the user knows what to remove.
    unknown = next(k for k in body if k not in ("image", "cmd", "path", "source", "destination"))
    assert unknown in r.json()["error"]["message"]


def test_wrong_content_type_is_a_4xx(served: Served) -> None:
    r = _post(served, "/v1/sandboxes", b"image=base", "application/x-www-form-urlencoded")
    _assert_client_error(r)


def test_huge_json_bodies_are_refused_with_413(served: Served) -> None:
    big = json.dumps({"cmd": ["true"], "stdin": "x" * (17 << 20)}).encode()
    r = _post(served, f"/v1/sandboxes/{served.sandbox_id}/exec", big, "application/json")
    _assert_client_error(r, "payload_too_large")

    # Within the limit but past a field's maxLength: a 400 naming the field.
    long_stdin = json.dumps({"cmd": ["true"], "stdin": "z" * (9 << 20)}).encode()
    r = _post(served, f"/v1/sandboxes/{served.sandbox_id}/exec", long_stdin, "application/json")
    _assert_client_error(r, "invalid_argument")
    assert "stdin" in r.json()["error"]["message"]


def test_huge_chunked_body_is_refused_with_413(served: Served) -> None:
    """Without a Content-Length (chunked), the limit holds while the body streams in."""

    def chunks() -> Iterator[bytes]:
        yield b'{"cmd": ["true"], "stdin": "'
        for _ in range(20):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(
        f"{served.url}/v1/sandboxes/{served.sandbox_id}/exec",
        content=chunks(),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=REQUEST_TIMEOUT_S,
    )
    # Refused either way; the code tells the user why.
    assert 400 <= r.status_code < 500, r.text
    _assert_client_error(r, "payload_too_large")


def test_huge_metadata_and_env_are_a_400(served: Served) -> None:
    body = {"metadata": {f"k{i}": "v" for i in range(65)}}
    r = _post(served, "/v1/sandboxes", json.dumps(body).encode(), "application/json")
    _assert_client_error(r, "invalid_argument")
    body = {"metadata": {"k": "v" * 1025}}
    r = _post(served, "/v1/sandboxes", json.dumps(body).encode(), "application/json")
    _assert_client_error(r, "invalid_argument")
    body = {"metadata": {"k" * 129: "v"}}
    r = _post(served, "/v1/sandboxes", json.dumps(body).encode(), "application/json")
    _assert_client_error(r, "invalid_argument")


@pytest.mark.parametrize(
    ("method", "path", "params"),
    [
        ("GET", "/v1/sandboxes", {"state": "sleeping"}),
        ("GET", "/v1/sandboxes", {"metadata": "no-equals-sign"}),
        ("GET", "/v1/sandboxes/{sid}/files", {}),
        ("GET", "/v1/sandboxes/{sid}/files", {"path": ""}),
        ("GET", "/v1/sandboxes/{sid}/files", {"path": "x" * 5000}),
        ("PUT", "/v1/sandboxes/{sid}/files", {"path": "/root/f", "mode": "rwx"}),
        ("DELETE", "/v1/sandboxes/{sid}/files", {"path": "/root", "recursive": "maybe"}),
    ],
)
def test_wrong_query_parameters_are_a_400(
    served: Served, method: str, path: str, params: dict[str, str]
) -> None:
    r = httpx.request(
        method,
        served.url + path.format(sid=served.sandbox_id),
        params=params,
        headers=AUTH,
        content=b"" if method == "PUT" else None,
        timeout=REQUEST_TIMEOUT_S,
    )
    _assert_client_error(r, "invalid_argument")


@pytest.mark.parametrize("sandbox_id", ["sb-000000000000", "nope", "sb-" + "a" * 200, "%00"])
def test_unknown_or_malformed_ids_are_a_404(served: Served, sandbox_id: str) -> None:
    r = httpx.get(f"{served.url}/v1/sandboxes/{sandbox_id}", headers=AUTH, timeout=10)
    _assert_client_error(r, "not_found")
    r = _post(served, f"/v1/sandboxes/{sandbox_id}/exec", b'{"cmd": ["true"]}', "application/json")
    _assert_client_error(r, "not_found")


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic abc", "Bearer", API_KEY])
def test_missing_or_wrong_key_is_a_401(served: Served, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    r = httpx.get(f"{served.url}/v1/sandboxes", headers=headers, timeout=10)
    _assert_client_error(r, "unauthorized")
