"""An in-memory fake of the hutch REST API v1, as an ``httpx.MockTransport``.

For tests of code that uses the SDK (ours and yours): no daemon, no VMs. It follows the
contract's shapes, status codes and error codes; commands do not really run — an
``exec_handler`` decides what each one prints::

    fake = FakeHutch()
    fake.exec_handler = lambda sb, body: FakeRun([("stdout", "hi\\n")], exit_code=0)
    with Sandbox.create(transport=fake.transport, api_key=fake.api_key) as sb:
        assert sb.exec("echo hi").stdout == "hi\\n"

The transport works for both ``Client`` and ``AsyncClient``. Streamed answers keep the
chunk boundaries the handler gives, so decoders are exercised on split lines.

Pause, resume and fork follow the contract too: ``pause`` moves a running sandbox to
``paused`` (any other state: 409 ``invalid_state``); exec and file calls on a paused
sandbox answer 409 ``invalid_state`` unless it was created with ``auto_resume``, which
resumes it first; ``fork`` makes ``count`` running children with ``parent_id`` set and a
copy of the parent's files, and leaves the parent as it was.

Named snapshots: ``POST /v1/sandboxes/{id}/snapshots`` saves a running or paused sandbox's
files (its state is left alone); a create with ``snapshot`` starts from a copy of them,
with the snapshot's image and shape; deleting a snapshot succeeds in any order with what
is built on it, as in the daemon: it is gone for the API at once, and sandboxes started
from it run on.
``auto_pause_s`` and ``auto_delete_s`` are range-checked and reported back, but no clock
runs them.

Secrets (``_secrets``): ``PUT/GET/DELETE /v1/secrets[/{name}]`` with the daemon's
names, value bounds and versions; no route answers a value (``fake.secrets.values``
holds them for the test); a create's ``env_secrets`` must name existing secrets, and a
secret a live sandbox names cannot be deleted (409).

Networking (``_net``): egress rules are parsed with the daemon's own grammar and stored
canonically, with the mode they make; the counters and the log are whatever a test puts
on the ``FakeSandbox`` (``allowed``, ``denied``, ``egress_events``). Ports get host ports
from 40000 on 127.0.0.1 (409 with network ``none``); networks are created, joined, left
and deleted (409 while a live sandbox is on one). Forks keep the parent's rules and
networks and get their own address; a deleted sandbox leaves its networks and ports.

Errors are the real classes (:mod:`hutch.errors`) answered with the contract's table
(status and code exactly as the daemon's); limits, names, create fields and the egress
grammar are the contract's (:mod:`hutch.contract`). ``tests/component/test_contract.py``
runs one suite against this fake and the real REST app, so the two cannot drift apart.

The data types live in ``_state`` and the in-memory filesystem in ``_files``; this
module is the router.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httpx

from hutch.contract.enums import DEFAULT_PAUSE_MODE, PauseMode
from hutch.contract.http_errors import error_body, error_for, status_for
from hutch.contract.limits import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    DEFAULT_FORK_COUNT,
    DEFAULT_IMAGE,
    DISK_GIB_RANGE,
    FORK_COUNT_RANGE,
    MEMORY_MIB_RANGE,
    TIMEOUT_S_RANGE,
    VCPUS_RANGE,
)
from hutch.contract.names import (
    SANDBOX_ID_RE,
    check_range,
    validate_env_secrets,
    validate_name,
)
from hutch.contract.placement import parse_placement
from hutch.contract.requests import CREATE_FIELDS, SHAPE_FIELDS, CreateRequest
from hutch.errors import Conflict, HutchError, InvalidArgument, NotFound, UnknownImage
from hutch.testing._files import files_route
from hutch.testing._net import FakeNet, FakeNetwork
from hutch.testing._secrets import FakeSecrets
from hutch.testing._state import (
    Chunks,
    FakeError,
    FakeRun,
    FakeSandbox,
    FakeSnapshot,
    json_body,
    require,
)

__all__ = ["FakeError", "FakeHutch", "FakeNetwork", "FakeRun", "FakeSandbox", "FakeSnapshot"]

_ENDED = ("destroyed", "failed")
_RANGES = {
    "vcpus": (VCPUS_RANGE, ""),
    "memory_mib": (MEMORY_MIB_RANGE, " MiB"),
    "disk_gib": (DISK_GIB_RANGE, " GiB"),
    "timeout_s": (TIMEOUT_S_RANGE, " seconds"),
    "auto_pause_s": (AUTO_PAUSE_S_RANGE, " seconds"),
    "auto_delete_s": (AUTO_DELETE_S_RANGE, " seconds"),
}


def _default_exec(sandbox: FakeSandbox, body: dict[str, Any]) -> FakeRun:
    """``echo`` prints its arguments; anything else echoes its stdin and exits 0."""
    cmd = body["cmd"]
    argv = cmd if isinstance(cmd, list) else ["/bin/sh", "-c", cmd]
    if argv and argv[0] == "echo":
        return FakeRun([("stdout", " ".join(argv[1:]) + "\n")])
    return FakeRun([("stdout", body.get("stdin") or "")] if body.get("stdin") else [])


def _error_response(exc: HutchError) -> httpx.Response:
    return httpx.Response(status_for(exc), json=error_body(exc.code, exc.message))


class FakeHutch:
    """The fake daemon. ``transport`` is the ``httpx.MockTransport`` to pass to clients.

    ``requests`` logs every request received; ``fail_next(...)`` makes the next matching
    request fail with a given error; ``download_chunk`` sets the file download chunk size.
    """

    def __init__(self, api_key: str = "test-key") -> None:
        self.api_key = api_key
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.snapshots: dict[str, FakeSnapshot] = {}
        #: Private networks (``net.networks``) and the networking routes.
        self.net = FakeNet(self.sandboxes)
        #: Secrets (``secrets.values``: what was set, in clear, for tests to check).
        self.secrets = FakeSecrets(self._secret_users)
        self.requests: list[httpx.Request] = []
        self.exec_handler: Callable[[FakeSandbox, dict[str, Any]], FakeRun] = _default_exec
        self.images: list[dict[str, Any]] = [
            {
                "name": "base",
                "description": "Debian 12 with Python 3",
                "built": True,
                "digest": "d1g3st",
                "size_bytes": 1 << 30,
                "kernel_release": "6.1.0-cloud",
            },
            {
                "name": "devbox",
                "description": "base plus build tools",
                "built": False,
                "digest": None,
                "size_bytes": None,
                "kernel_release": None,
            },
        ]
        self.download_chunk = 1 << 16
        #: The labels of the one host it plays (``HUTCH_HOST_LABELS``, host ``local``): a
        #: create's ``placement.labels`` must all be among them, as on a daemon.
        self.host_labels: dict[str, str] = {}
        self._failures: list[tuple[str, str, FakeError]] = []
        self._counter = 0
        self._snapshot_counter = 0
        self.transport = httpx.MockTransport(self._handle)

    # -- test controls ------------------------------------------------------------

    def fail_next(self, method: str, path_re: str, status: int, code: str, message: str) -> None:
        """Answer the next ``method`` request whose path matches ``path_re`` with an error."""
        self._failures.append((method, path_re, FakeError(status, code, message)))

    def add_sandbox(self, **spec: Any) -> FakeSandbox:
        """A running sandbox with the create body ``spec`` (``auto_resume=True`` too).

        With ``snapshot=`` naming a snapshot of this fake, it starts from that snapshot:
        its image, shape and files (an unknown id is just recorded)."""
        self._counter += 1
        source = self.snapshots.get(spec.get("snapshot") or "")
        if source is not None:
            # The snapshot fixes the machine, as in the daemon: its image and shape win.
            spec = {**spec, **source.spec}
        sandbox = FakeSandbox(id=f"sb-{self._counter:012x}", spec={"image": DEFAULT_IMAGE, **spec})
        self.net.setup(sandbox, sandbox.spec)
        if source is not None:
            sandbox.files, sandbox.modes = dict(source.files), dict(source.modes)
            sandbox.dirs = set(source.dirs)
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def add_network(self, name: str) -> FakeNetwork:
        """A private network named ``name`` (ids count up: ``net-000000000001``...)."""
        return self.net.add_network(name)

    def add_snapshot(self, sandbox: FakeSandbox, name: str) -> FakeSnapshot:
        """A snapshot of ``sandbox`` as it is now (a copy of its files), whatever its state."""
        self._snapshot_counter += 1
        snapshot = FakeSnapshot(
            id=f"snap-{self._snapshot_counter:012x}",
            name=name,
            sandbox_id=sandbox.id,
            spec={k: v for k, v in sandbox.spec.items() if k in SHAPE_FIELDS},
            files=dict(sandbox.files),
            modes=dict(sandbox.modes),
            dirs=set(sandbox.dirs),
        )
        self.snapshots[snapshot.id] = snapshot
        return snapshot

    # -- dispatch -----------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        try:
            for i, (method, path_re, error) in enumerate(self._failures):
                if method == request.method and re.fullmatch(path_re, request.url.path):
                    del self._failures[i]
                    raise error
            return self._route(request)
        except FakeError as exc:
            return httpx.Response(exc.status, json=error_body(exc.code, exc.message))
        except HutchError as exc:
            return _error_response(exc)

    def _route(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if path == "/healthz" and method == "GET":
            return httpx.Response(200, json={"status": "ok", "version": "0.1.0", "accel": "tcg"})
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json=error_body("unauthorized", "missing or wrong API key"))
        if path == "/v1/images" and method == "GET":
            return httpx.Response(200, json={"images": self.images})
        if path == "/v1/egress-policies" or path.startswith("/v1/egress-policies/"):
            return self.net.policies_route(method, path, request)
        if path == "/v1/networks" or path.startswith("/v1/networks/"):
            return self.net.networks_route(method, path, request)
        if path == "/v1/secrets" or path.startswith("/v1/secrets/"):
            return self.secrets.route(method, path, request)
        if path == "/v1/snapshots" and method == "GET":
            found = [snap.to_json() for snap in self.snapshots.values()]
            return httpx.Response(200, json={"snapshots": found})
        match = re.fullmatch(r"/v1/snapshots/([^/]+)", path)
        if match and method in ("GET", "DELETE"):
            snapshot = self._snapshot(unquote(match.group(1)))
            if method == "GET":
                return httpx.Response(200, json=snapshot.to_json())
            return self._delete_snapshot(snapshot)
        if path == "/v1/sandboxes":
            if method == "POST":
                return self._create(json_body(request))
            if method == "GET":
                return self._list(request)
        match = re.fullmatch(r"/v1/sandboxes/([^/]+)(/.*)?", path)
        if match:
            sandbox = self._sandbox(unquote(match.group(1)))
            rest = match.group(2) or ""
            return self._sandbox_route(sandbox, method, rest, request)
        raise NotFound(f"no route {method} {path}")

    def _sandbox(self, sandbox_id: str) -> FakeSandbox:
        if not SANDBOX_ID_RE.match(sandbox_id):
            raise NotFound(f"sandbox id {sandbox_id!r} is malformed; ids look like sb-0123456789ab")
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"no sandbox {sandbox_id}")
        return sandbox

    def _snapshot(self, snapshot_id: str) -> FakeSnapshot:
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None:
            raise NotFound(f"no snapshot {snapshot_id!r}; ids look like snap-0123456789ab")
        return snapshot

    def _delete_snapshot(self, snapshot: FakeSnapshot) -> httpx.Response:
        # As in the daemon: any order works; what was built on it stays usable.
        del self.snapshots[snapshot.id]
        return httpx.Response(204)

    def _create(self, body: dict[str, Any]) -> httpx.Response:
        unknown = sorted(set(body) - set(CREATE_FIELDS))
        if unknown:
            raise InvalidArgument(f"{', '.join(unknown)}: Extra inputs are not permitted")
        request = CreateRequest(**body)
        if not isinstance(request.auto_resume, bool):
            raise InvalidArgument("auto_resume: Input should be a valid boolean")
        for key, (bounds, unit) in _RANGES.items():
            value = getattr(request, key)
            if value is not None:
                check_range(key, value, bounds, unit)
        if request.name is not None:
            validate_name(request.name)
        for mount in request.volumes:
            # The fake keeps no volumes (it has no /v1/volumes): every one is unknown,
            # as a volume of another project is to the daemon.
            ref = mount.get("volume") if isinstance(mount, dict) else mount
            raise NotFound(f"volume {ref!r} not found in project 'default'")
        if not isinstance(request.env_secrets, dict):
            raise InvalidArgument("env_secrets: Input should be a valid dictionary")
        validate_env_secrets(request.env_secrets, request.env)
        self.secrets.check_refs(request.env_secrets)
        self._check_labels(body.get("placement"))
        if request.snapshot is not None:
            self._snapshot(request.snapshot)  # 404 for an unknown one
        else:
            self._image(request.image)
        return httpx.Response(201, json=self.add_sandbox(**body).to_json())

    def _secret_users(self, name: str) -> list[str]:
        return [
            sb.id
            for sb in self.sandboxes.values()
            if sb.state not in ("destroyed", "failed")
            and name in (sb.spec.get("env_secrets") or {}).values()
        ]

    def _image(self, name: str) -> None:
        image = next((i for i in self.images if i["name"] == name), None)
        if image is None:
            names = ", ".join(i["name"] for i in self.images)
            raise UnknownImage(f"unknown image {name!r}; available: {names}")
        if not image["built"]:
            raise Conflict(
                f"image {name!r} is not built on this host; run `hutch image build {name}`"
            )

    def _list(self, request: httpx.Request) -> httpx.Response:
        state = request.url.params.get("state")
        wanted: dict[str, str] = {}
        for item in request.url.params.get_list("metadata"):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise InvalidArgument(f"metadata filter {item!r} is not key=value")
            wanted[key] = value
        found = [
            sb.to_json()
            for sb in self.sandboxes.values()
            if (sb.state == state if state else sb.state != "destroyed")
            and all((sb.spec.get("metadata") or {}).get(k) == v for k, v in wanted.items())
        ]
        return httpx.Response(200, json={"sandboxes": found})

    def _sandbox_route(
        self, sb: FakeSandbox, method: str, rest: str, request: httpx.Request
    ) -> httpx.Response:
        if rest == "" and method == "GET":
            return httpx.Response(200, json=sb.to_json())
        if rest == "" and method == "DELETE":
            if sb.state not in _ENDED:
                sb.state, sb.pause_mode = "destroyed", None
            sb.ports.clear()
            return httpx.Response(204)
        if rest.split("/")[1:2] in (["egress"], ["ports"], ["networks"]):
            return self.net.sandbox_route(sb, method, rest, request)
        if method == "POST" and rest in ("/pause", "/resume", "/fork"):
            return self._lifecycle(sb, rest, request)
        if method == "POST" and rest == "/snapshots":
            name = json_body(request).get("name")
            if not isinstance(name, str):
                raise InvalidArgument("name: Field required")
            validate_name(name)
            require(sb, "running", "paused")
            return httpx.Response(201, json=self.add_snapshot(sb, name).to_json())
        if sb.state == "paused" and sb.spec.get("auto_resume"):
            sb.resume()
        require(sb, "running")
        if rest == "/exec" and method == "POST":
            return self._exec(sb, json_body(request))
        return files_route(sb, method, rest, request, self.download_chunk)

    def _lifecycle(self, sb: FakeSandbox, rest: str, request: httpx.Request) -> httpx.Response:
        body = json_body(request)
        if rest == "/pause":
            mode = body.get("mode", DEFAULT_PAUSE_MODE.value)
            if mode not in {m.value for m in PauseMode}:
                raise InvalidArgument(f"mode: Input should be 'memory' or 'disk', got {mode!r}")
            require(sb, "running")
            sb.pause(mode)
            return httpx.Response(200, json=sb.to_json())
        if rest == "/resume":
            if sb.state != "running":  # resuming a running sandbox is a no-op
                require(sb, "paused", "running")
                sb.resume()
            return httpx.Response(200, json=sb.to_json())
        count = check_range("count", body.get("count", DEFAULT_FORK_COUNT), FORK_COUNT_RANGE)
        require(sb, "running", "paused")
        children = []
        for _ in range(count):
            child = self.add_sandbox(**{k: v for k, v in sb.spec.items() if k != "name"})
            child.parent_id = sb.id
            child.files, child.modes = dict(sb.files), dict(sb.modes)
            child.dirs = set(sb.dirs)
            # Rules and networks survive a fork; the address is the child's own.
            child.egress, child.networks = list(sb.egress), list(sb.networks)
            child.egress_doc = sb.egress_doc
            children.append(child.to_json())
        return httpx.Response(201, json={"sandboxes": children})

    def _check_labels(self, placement: Any) -> None:
        """The daemon's refusal of labels no host has (hutch.services.placement)."""
        wanted = parse_placement(placement).labels
        if any(self.host_labels.get(k) != v for k, v in wanted.items()):
            shown = ", ".join(f"{k}={v}" for k, v in sorted(wanted.items()))
            have = ", ".join(f"{k}={v}" for k, v in sorted(self.host_labels.items()))
            raise InvalidArgument(
                f"no host has the labels {shown}; the hosts' labels: local: {have or '(none)'}"
            )

    def _exec(self, sb: FakeSandbox, body: dict[str, Any]) -> httpx.Response:
        cmd = body.get("cmd")
        if not (isinstance(cmd, str) or (isinstance(cmd, list) and cmd)):
            raise InvalidArgument("cmd must be a string or a list")
        run = self.exec_handler(sb, body)
        if not body.get("stream"):
            if run.error:
                code, message = run.error
                # The daemon's status for that code; the code itself as given.
                raise FakeError(status_for(error_for(code, None, message)), code, message)
            out = "".join(d for s, d in run.output if s == "stdout")
            err = "".join(d for s, d in run.output if s == "stderr")
            return httpx.Response(
                200,
                json={
                    "exit_code": run.exit_code,
                    "signal": run.signal,
                    "stdout": out,
                    "stderr": err,
                    "duration_ms": run.duration_ms,
                },
            )
        lines: list[dict[str, Any]] = [{"type": s, "data": d} for s, d in run.output]
        if run.error:
            lines.append({"type": "error", "code": run.error[0], "message": run.error[1]})
        else:
            lines.append(
                {
                    "type": "exit",
                    "exit_code": run.exit_code,
                    "signal": run.signal,
                    "duration_ms": run.duration_ms,
                }
            )
        encoded = [(json.dumps(line) + "\n").encode() for line in lines]
        # Split every line in two so clients must reassemble lines across chunks.
        chunks = [part for line in encoded for part in (line[:5], line[5:])]
        return httpx.Response(
            200, headers={"content-type": "application/x-ndjson"}, stream=Chunks(chunks)
        )
