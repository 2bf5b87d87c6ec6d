"""Projects, keys and roles against a real hutchd with real VMs (issue 10).

Two projects, ``alpha`` and ``beta``, one running sandbox each (the only two VM boots of
the table test), keys of every role in alpha. The table test walks the route table
(``hutch.api.permissions``), so a new route is covered the day it is added: for each role
and route it asks with beta's ids and expects 403 where the role lacks the permission
and 404 ``not_found`` (as for a missing id) where it has it; nothing is done to beta.
Routes with no id of a project are asked with a body the API refuses (400), so a role
that may use them is let through authorization without creating anything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.sync.client as ws_client

from hutch.api.permissions import ROUTE_PERMISSIONS
from hutch.contract.auth import ROLE_PERMISSIONS, Role
from hutch.e2b.keys import e2b_form
from hutch.errors import InvalidArgument, QuotaExceeded, Unauthorized
from hutch.sdk import Client
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon, free_port

pytestmark = pytest.mark.timeout(900)

ROLES = [Role.OWNER, Role.DEVELOPER, Role.OPERATOR, Role.VIEWER]


class RolesDaemon(Daemon):
    """A hutchd with its E2B face on a port of its own (the E2B key lookup is tested)."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self.e2b_port = free_port()
        self.daemon_env["HUTCH_E2B_LISTEN"] = f"127.0.0.1:{self.e2b_port}"


class World:
    def __init__(self, d: RolesDaemon) -> None:
        self.d = d
        self.secrets: list[str] = []
        self.keys: dict[Role, str] = {}
        self.ids: dict[str, str] = {}
        self.own: dict[str, str] = {}
        self.beta_owner = ""


@pytest.fixture(scope="module")
def world(base_image: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    d = RolesDaemon(tmp_path_factory.mktemp("hutchd-roles") / "state")
    _LIVE.append(d)
    d.start()
    w = World(d)
    try:
        with d.client(timeout=300.0) as admin:
            admin.projects.create("alpha")
            admin.projects.create("beta")
            for role in ROLES:
                created = admin.keys.create(f"k-{role}", str(role), project="alpha")
                w.keys[role] = created.secret
                w.secrets.append(created.secret)
            beta_owner = admin.keys.create("beta-owner", "owner", project="beta")
            w.secrets.append(beta_owner.secret)
            w.beta_owner = beta_owner.secret
        with d.client(timeout=300.0, project="beta") as beta:
            sb = beta.create_sandbox("base", vcpus=1, memory_mib=256)
            w.ids["sandbox_id"] = sb.id
            w.ids["snapshot_id"] = beta.create_snapshot(sb.id, "s").id
            w.ids["network_id"] = beta.networks.create("team").id
        with d.client(timeout=300.0, project="alpha") as alpha:
            w.own["sandbox_id"] = alpha.create_sandbox("base", vcpus=1, memory_mib=256).id
        yield w
    finally:
        problems = finalize_daemon(d)
        assert not problems, "\n".join(problems)


def call(
    d: Daemon, secret: str, method: str, path: str, body: Any = None, **headers: str
) -> httpx.Response:
    return httpx.request(
        method,
        d.url + path,
        json=body,
        headers={"Authorization": f"Bearer {secret}", **headers},
        timeout=120,
    )


def as_key(d: Daemon, secret: str, timeout: float = 300.0) -> Client:
    """An SDK client of ``d`` holding a project key."""
    return Client(base_url=d.url, api_key=secret, timeout=timeout)


#: Path parameters filled with a real id of project beta: an allowed role gets 404.
OTHER_PROJECT_PARAMS = ("sandbox_id", "snapshot_id", "network_id", "project")


def fill(path: str, ids: dict[str, str]) -> str:
    """The route's path with beta's ids, and a dummy for any other parameter (a sub-id
    of a sandbox, or a resource this module made none of in beta)."""
    values = {**ids, "project": "beta", "pid": "1", "port": "8080"}
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "no-such-thing"), path)


def code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"<{r.status_code} {r.text[:200]}>"


def test_every_route_answers_every_role_as_the_table_says(world: World) -> None:
    d = world.d
    wrong: list[str] = []
    checked = 0
    for (method, template), permission in sorted(ROUTE_PERMISSIONS.items()):
        if method == "WS":
            continue  # test_the_terminal_websocket_checks_role_and_project
        path = fill(template, world.ids)
        names_beta = any("{" + p + "}" in template for p in OTHER_PROJECT_PARAMS)
        for role in ROLES:
            allowed = permission in ROLE_PERMISSIONS[role]
            body = None if method in ("GET", "DELETE") else {"not-a-field": True}
            r = call(d, world.keys[role], method, path, body)
            checked += 1
            if not allowed:
                expect = (403, "forbidden")
                ok = (r.status_code, code(r)) == expect and str(role) in r.text
            elif names_beta:
                # Beta's id (or beta itself): not found, exactly as a missing one.
                expect = (404, "not_found")
                ok = (r.status_code, code(r)) == expect
            elif method == "GET" and "{" not in template:
                expect = (200, "")
                ok = r.status_code == 200
            else:
                # Let through authorization; refused by validation or as a missing
                # (dummy) id: nothing is created or changed.
                expect = (400, "invalid_argument|not_found")
                ok = r.status_code in (400, 404) and code(r) != "forbidden"
            if not ok:
                wrong.append(
                    f"{role} {method} {path}: got {r.status_code} {code(r)}, want {expect}"
                )
    assert not wrong, "\n".join(wrong)
    assert checked == 4 * sum(1 for m, _ in ROUTE_PERMISSIONS if m != "WS")
    # Beta's sandbox is untouched and still running.
    with d.client(project="beta") as beta:
        assert beta.get_sandbox(world.ids["sandbox_id"]).state == "running"


def test_roles_do_what_they_may_in_their_own_project(world: World) -> None:
    d, own = world.d, world.own["sandbox_id"]
    exec_body = {"cmd": ["cat", "/etc/hostname"]}
    for role in ROLES:
        key = world.keys[role]
        listed = call(d, key, "GET", "/v1/sandboxes").json()["sandboxes"]
        assert [s["id"] for s in listed] == [own], role
        r = call(d, key, "POST", f"/v1/sandboxes/{own}/exec", exec_body)
        if role is Role.VIEWER:
            assert (r.status_code, code(r)) == (403, "forbidden")
            assert "viewer" in r.text and "sandbox.use" in r.text
        else:
            assert r.status_code == 200, (role, r.text)
    # A project key naming another project is refused, even an existing one.
    r = call(d, world.keys[Role.OWNER], "GET", "/v1/sandboxes", **{"Hutch-Project": "beta"})
    assert (r.status_code, code(r)) == (403, "forbidden")


def test_the_terminal_websocket_checks_role_and_project(world: World) -> None:
    d = world.d
    base = d.url.replace("http://", "ws://")

    def first_frame(sandbox_id: str, secret: str) -> dict[str, Any]:
        with ws_client.connect(f"{base}/v1/sandboxes/{sandbox_id}/pty", open_timeout=30) as ws:
            ws.send(json.dumps({"type": "auth", "token": secret}))
            frame = ws.recv(timeout=60)
            assert isinstance(frame, str), frame
            found: dict[str, Any] = json.loads(frame)
            return found

    beta_sb, own = world.ids["sandbox_id"], world.own["sandbox_id"]
    assert first_frame(own, world.keys[Role.VIEWER])["code"] == "forbidden"
    assert first_frame(beta_sb, world.keys[Role.OPERATOR])["code"] == "not_found"
    assert first_frame(own, world.keys[Role.OPERATOR])["type"] == "ready"


def test_revoked_and_expired_keys_are_refused_on_the_next_request(world: World) -> None:
    d = world.d
    with d.client(project="alpha") as admin:
        doomed = admin.keys.create("doomed", "developer")
        brief = admin.keys.create("brief", "viewer", ttl_s=2)
    world.secrets += [doomed.secret, brief.secret]
    assert call(d, doomed.secret, "GET", "/v1/sandboxes").status_code == 200
    assert call(d, brief.secret, "GET", "/v1/sandboxes").status_code == 200
    with d.client(project="alpha") as admin:
        assert admin.keys.revoke(doomed.id).revoked_at is not None
        listed = {k.id: k for k in admin.keys.list()}
    assert listed[doomed.id].last_used_at is not None
    r = call(d, doomed.secret, "GET", "/v1/sandboxes")
    assert (r.status_code, code(r)) == (401, "unauthorized") and "revoked" in r.text
    time.sleep(2.5)
    r = call(d, brief.secret, "GET", "/v1/sandboxes")
    assert (r.status_code, code(r)) == (401, "unauthorized") and "expired" in r.text
    with as_key(d, doomed.secret) as c, pytest.raises(Unauthorized, match="revoked"):
        c.list_sandboxes()
    # A guessed secret with a real id is told nothing about the key.
    forged = doomed.secret[:-3] + ("AAA" if not doomed.secret.endswith("AAA") else "BBB")
    r = call(d, forged, "GET", "/v1/sandboxes")
    assert r.json()["error"]["message"] == "wrong API key"


def test_twenty_concurrent_creates_never_pass_the_quota(world: World) -> None:
    d = world.d
    with d.client() as admin:
        admin.projects.create("gamma", {"max_sandboxes": 2, "max_vcpus": 2})
        dev = admin.keys.create("dev", "developer", project="gamma").secret
    world.secrets.append(dev)
    made: list[str] = []
    refused: list[str] = []
    others: list[BaseException] = []
    lock = threading.Lock()

    def create() -> None:
        try:
            with as_key(d, dev, timeout=600.0) as c:
                sb = c.create_sandbox("base", vcpus=1, memory_mib=256)
            with lock:
                made.append(sb.id)
        except QuotaExceeded as exc:
            with lock:
                refused.append(str(exc))
        except BaseException as exc:
            with lock:
                others.append(exc)

    threads = [threading.Thread(target=create) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not others, others
    assert len(made) == 2 and len(refused) == 18, (made, refused)
    assert all("max_sandboxes" in m and "limit 2" in m for m in refused), refused
    with as_key(d, dev) as c:
        info = c.projects.get("gamma")
        assert info.usage["sandboxes"] == 2 and info.usage["vcpus"] == 2
        for sid in made:
            c.delete_sandbox(sid)
        assert c.projects.get("gamma").usage["sandboxes"] == 0


def test_project_deletion_is_refused_while_it_holds_anything(world: World) -> None:
    with world.d.client() as admin:
        with pytest.raises(Exception, match="still holds 1 sandboxes, 1 snapshots, 1 networks"):
            admin.projects.delete("beta")
        with pytest.raises(Exception, match="cannot be deleted"):
            admin.projects.delete("default")


def test_an_e2b_client_with_a_project_key_sees_its_project_only(world: World) -> None:
    d = world.d
    url = f"http://127.0.0.1:{d.e2b_port}/v2/sandboxes"
    for secret, project_ids in (
        (world.keys[Role.VIEWER], [world.own["sandbox_id"]]),
        (world.beta_owner, [world.ids["sandbox_id"]]),
    ):
        r = httpx.get(url, headers={"X-API-KEY": e2b_form(secret)}, timeout=30)
        assert r.status_code == 200, r.text
        assert [s["sandboxID"] for s in r.json()] == project_ids
    # Another project's sandbox is not found; a viewer may not create.
    beta_sb = world.ids["sandbox_id"]
    r = httpx.get(
        f"{url.removesuffix('/v2/sandboxes')}/sandboxes/{beta_sb}",
        headers={"X-API-KEY": e2b_form(world.keys[Role.OWNER])},
        timeout=30,
    )
    assert r.status_code == 404, r.text
    r = httpx.post(
        url, json={"templateID": "base"}, headers={"X-API-KEY": world.keys[Role.VIEWER]}, timeout=30
    )
    assert r.status_code == 403, r.text


def test_cli_projects_and_keys(world: World) -> None:
    d = world.d

    def hutch(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**d.env, **({"HUTCH_API_KEY": key} if key else {})}
        return subprocess.run(
            [sys.executable, "-m", "hutch", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    made = hutch("project", "create", "delta", "--max-sandboxes", "3")
    assert made.returncode == 0 and made.stdout.strip() == "delta", made.stderr
    listed = hutch("project", "ls")
    assert {"alpha", "beta", "delta", "default"} <= {
        line.split()[0] for line in listed.stdout.splitlines()[1:]
    }
    secret = hutch("key", "create", "ci", "--role", "owner", "--project", "delta").stdout.strip()
    assert secret.startswith("hk_")
    world.secrets.append(secret)
    keys = json.loads(hutch("key", "ls", "--json", key=secret).stdout)
    assert [k["name"] for k in keys] == ["ci"] and "secret" not in keys[0]
    shown = hutch("project", "inspect", "delta", key=secret)
    assert "max_sandboxes:" in shown.stdout and "0 used of 3" in shown.stdout, shown.stdout
    q = hutch("project", "quota", "delta", "--max-vcpus", "4", "--json")
    assert json.loads(q.stdout)["quotas"]["max_vcpus"] == 4
    refused = hutch("project", "create", "eps", key=secret)
    assert (refused.returncode == 1 and "forbidden" in refused.stderr) or "owner" in refused.stderr
    assert hutch("key", "revoke", keys[0]["id"], "--project", "delta").returncode == 0
    after = hutch("key", "ls", key=secret)
    assert after.returncode == 1 and "revoked" in after.stderr
    assert hutch("project", "rm", "delta").returncode == 0


def test_key_secrets_never_appear_in_logs_events_or_the_state_dir(world: World) -> None:
    """Runs last in the module: every secret the module made, looked for everywhere the
    daemon writes (its log, stderr, every file of the state dir, the database included)."""
    d = world.d
    assert world.secrets
    hits: list[str] = []
    for path in sorted(p for p in d.state_dir.rglob("*") if p.is_file()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for secret in world.secrets:
            if secret.encode() in data:
                hits.append(f"{path}: {secret[:8]}...")
    assert not hits, hits


def test_images_are_per_project_through_the_cli_and_the_sdk(world: World, tmp_path: Path) -> None:
    """An image imported with alpha's key is alpha's: beta's key neither lists, boots nor
    deletes it, and beta may import its own image of the same name; the admin lists both.
    A sandbox boots from alpha's image with alpha's key (a real VM)."""
    from tests.e2e.test_cli_images import small_image
    from tests.ocikit import write_docker_archive

    d = world.d
    alpha_key, beta_key = world.keys[Role.DEVELOPER], world.beta_owner

    def hutch(*args: str, key: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hutch", *args],
            env={**d.env, "HUTCH_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    def listed(key: str) -> dict[str, str | None]:
        out = hutch("images", "--json", key=key)
        assert out.returncode == 0, out.stderr
        return {i["name"]: i["project"] for i in json.loads(out.stdout)}

    ours, theirs = tmp_path / "ours.tar", tmp_path / "theirs.tar"
    write_docker_archive(small_image("alpha"), ours, tag="e2e/app:1")
    write_docker_archive(small_image("beta"), theirs, tag="e2e/app:1")
    made = hutch("image", "import", "app", str(ours), "--json", key=alpha_key)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["project"] == "alpha"
    assert listed(alpha_key).get("app") == "alpha"
    assert "app" not in listed(beta_key)
    with as_key(d, beta_key) as beta, pytest.raises(InvalidArgument, match="unknown image 'app'"):
        beta.create_sandbox("app", vcpus=1, memory_mib=256)
    gone = hutch("image", "rm", "app", key=beta_key)
    assert gone.returncode == 1 and "no image called 'app'" in gone.stderr, gone.stderr
    other = hutch("image", "import", "app", str(theirs), "--json", key=beta_key)
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout)["digest"] != json.loads(made.stdout)["digest"]
    with d.client(timeout=300.0) as admin:
        every = sorted((i.name, i.project) for i in admin.list_images() if i.project)
    assert ("app", "alpha") in every and ("app", "beta") in every
    with as_key(d, alpha_key) as alpha:
        sb = alpha.create_sandbox("app", vcpus=1, memory_mib=256)
        try:
            # The image holds no programs: its own file, read by the agent, says whose it is.
            assert alpha.read_file(sb.id, "/etc/tag") == b"alpha"
        finally:
            alpha.delete_sandbox(sb.id)
    for key in (alpha_key, beta_key):
        removed = hutch("image", "rm", "app", key=key)
        assert removed.returncode == 0, removed.stderr
