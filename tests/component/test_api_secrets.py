"""/v1/secrets and a sandbox's env_secrets through the REST API, on the real service and
store, with the real guest agent (in bubblewrap): values are write-only, every command
gets the current version, bad input names what is accepted, and the value is nowhere in
the state directory or any answer. tests/vm/test_secrets_vm.py repeats the end to end on
a VM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from hutch.services.composed import Services
from tests import pgserver

pytestmark = pytest.mark.timeout(120)

VALUE = "sk-comp-1b7e0c93d4a2-never-shown"
ROTATED = "sk-comp-rotated-55aa01f2"


def _no_value(answer: httpx.Response, *values: str) -> None:
    for value in (VALUE, ROTATED, *values):
        assert value not in answer.text, answer.text
    if answer.headers.get("content-type", "").startswith("application/json"):
        assert '"value"' not in answer.text


async def _put(api: httpx.AsyncClient, name: str, value: str) -> httpx.Response:
    r = await api.put(f"/v1/secrets/{name}", json={"value": value})
    _no_value(r, value)
    return r


async def _exec(api: httpx.AsyncClient, sid: str, cmd: str | list[str]) -> dict[str, Any]:
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_put_list_inspect_delete_never_answer_a_value(api: httpx.AsyncClient) -> None:
    r = await _put(api, "openai", VALUE)
    assert r.status_code == 201, r.text
    first = r.json()
    assert set(first) == {"name", "project", "version", "created_at", "updated_at"}
    assert (first["name"], first["project"], first["version"]) == ("openai", "default", 1)

    r = await _put(api, "openai", ROTATED)
    assert r.status_code == 200
    assert r.json()["version"] == 2 and r.json()["created_at"] == first["created_at"]

    r = await api.get("/v1/secrets")
    _no_value(r)
    assert [(s["name"], s["version"]) for s in r.json()["secrets"]] == [("openai", 2)]
    r = await api.get("/v1/secrets/openai")
    _no_value(r)
    assert r.json()["version"] == 2

    r = await api.delete("/v1/secrets/openai")
    assert r.status_code == 204
    for r in (await api.get("/v1/secrets/openai"), await api.delete("/v1/secrets/openai")):
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "no secret named 'openai' in project 'default'"


@pytest.mark.parametrize(
    ("name", "body", "message"),
    [
        ("bad name", {"value": "v"}, "use 1-128 letters, digits, '_', '.' and '-'"),
        ("_x", {"value": "v"}, "starting with a letter or digit"),
        ("ok", {"value": ""}, "1-65536 bytes of UTF-8 text; this one is 0 bytes"),
        ("ok", {"value": "x" * 65537}, "1-65536 bytes of UTF-8 text; this one is 65537 bytes"),
        ("ok", {"value": "a\u0000b"}, "must not contain a NUL byte"),
        ("ok", {"value": 12345}, "value: Input should be a valid string"),
        ("ok", {}, "value: Field required"),
        ("ok", {"value": "v", "version": 3}, "version: Extra inputs are not permitted"),
    ],
)
async def test_bad_secret_input_names_what_is_accepted(
    api: httpx.AsyncClient, name: str, body: dict[str, Any], message: str
) -> None:
    r = await api.put(f"/v1/secrets/{name}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_argument"
    assert message in r.json()["error"]["message"]
    assert "x" * 100 not in r.text  # the value is not echoed
    assert (await api.get("/v1/secrets")).json()["secrets"] == []


@pytest.mark.parametrize(
    ("create", "message"),
    [
        ({"env_secrets": {"TOKEN": "nope"}}, "env_secrets['TOKEN'] names secret 'nope', which "
         "does not exist in project 'default'; create it first (hutch secret set nope)"),
        ({"env_secrets": {"1X": "tok"}}, "env_secrets name '1X' is not a valid environment "
         "variable name; use letters, digits and '_', not starting with a digit"),
        ({"env_secrets": {"X": "bad name"}}, "env_secrets['X']: secret name 'bad name' is not "
         "valid; use 1-128 letters"),
        ({"env": {"X": "1"}, "env_secrets": {"X": "tok"}}, "'X' is in both env and "
         "env_secrets; give each variable once"),
        ({"env_secrets": {f"V{i}": "tok" for i in range(65)}}, "env_secrets: Dictionary "
         "should have at most 64 items"),
    ],
)  # fmt: skip
async def test_bad_env_secrets_are_refused_at_create(
    api: httpx.AsyncClient, create: dict[str, Any], message: str
) -> None:
    await _put(api, "tok", VALUE)
    r = await api.post("/v1/sandboxes", json=create)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    listed = (await api.get("/v1/sandboxes")).json()["sandboxes"]
    assert [s for s in listed if s["state"] != "failed"] == []


async def test_a_sandbox_gets_the_current_value_in_every_kind_of_command(
    api: httpx.AsyncClient, service: Services
) -> None:
    await _put(api, "openai", VALUE)
    r = await api.post(
        "/v1/sandboxes",
        json={"env": {"PLAIN": "p"}, "env_secrets": {"OPENAI_API_KEY": "openai"}},
    )
    assert r.status_code == 201, r.text
    _no_value(r)
    sb = r.json()
    sid = sb["id"]
    assert sb["env_secrets"] == {"OPENAI_API_KEY": "openai"}
    _no_value(await api.get(f"/v1/sandboxes/{sid}"))
    _no_value(await api.get("/v1/sandboxes"))

    out = await _exec(api, sid, "echo $PLAIN:$OPENAI_API_KEY")
    assert out["stdout"] == f"p:{VALUE}\n"
    # A request's env wins over the secret (it is the caller's own choice).
    r = await api.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": "echo $OPENAI_API_KEY", "env": {"OPENAI_API_KEY": "mine"}},
    )
    assert r.json()["stdout"] == "mine\n"

    # A background process started before the rotation keeps what it started with.
    base = f"/v1/sandboxes/{sid}/processes"
    r = await api.post(
        base, json={"cmd": "cat >/dev/null; echo $OPENAI_API_KEY", "keep_stdin": True}
    )
    assert r.status_code == 201, r.text
    _no_value(r)
    old_pid = r.json()["pid"]

    # A code context started now has the value in its kernel's environment.
    r = await api.post(f"/v1/sandboxes/{sid}/contexts", json={})
    assert r.status_code == 201, r.text
    _no_value(r)
    cid = r.json()["id"]
    code = {"code": "import os; os.environ['OPENAI_API_KEY']"}
    r = await api.post(f"/v1/sandboxes/{sid}/contexts/{cid}/run", json=code)
    assert r.json()["result"] == {"text/plain": repr(VALUE)}, r.text

    # Rotation: the next command of the same sandbox gets version 2.
    assert (await _put(api, "openai", ROTATED)).json()["version"] == 2
    assert (await _exec(api, sid, ["printenv", "OPENAI_API_KEY"]))["stdout"] == f"{ROTATED}\n"
    r = await api.post(base, json={"cmd": "echo $OPENAI_API_KEY"})
    new_pid = r.json()["pid"]
    await api.post(f"{base}/{old_pid}/stdin", content=b"", params={"eof": "1"})
    for pid, want in ((old_pid, VALUE), (new_pid, ROTATED)):
        r = await api.post(f"{base}/{pid}/wait", params={"timeout_s": 30})
        assert r.json()["state"] == "exited", r.text
        _no_value(r)
        r = await api.get(f"{base}/{pid}/output")
        assert r.json()["stdout"] == f"{want}\n", r.text

    # The context's kernel started before the rotation: it keeps version 1.
    r = await api.post(f"/v1/sandboxes/{sid}/contexts/{cid}/run", json=code)
    assert r.json()["result"] == {"text/plain": repr(VALUE)}, r.text

    # A fork child names the same secret and gets the current value.
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    _no_value(r)
    child = r.json()["sandboxes"][0]
    assert child["env_secrets"] == {"OPENAI_API_KEY": "openai"}
    assert (await _exec(api, child["id"], "echo $OPENAI_API_KEY"))["stdout"] == f"{ROTATED}\n"

    # In use: not deletable; the message names the sandboxes.
    r = await api.delete("/v1/secrets/openai")
    assert r.status_code == 409
    assert sid in r.json()["error"]["message"] and child["id"] in r.json()["error"]["message"]

    _assert_nowhere(service.settings.state_dir)
    for s in (sid, child["id"]):
        assert (await api.delete(f"/v1/sandboxes/{s}")).status_code == 204
    assert (await api.delete("/v1/secrets/openai")).status_code == 204


async def test_a_missing_key_file_fails_the_command_naming_it(
    api: httpx.AsyncClient, service: Services
) -> None:
    await _put(api, "openai", VALUE)
    sid = (await api.post("/v1/sandboxes", json={"env_secrets": {"K": "openai"}})).json()["id"]
    key = service.settings.secrets_key_path
    saved = key.read_bytes()
    key.unlink()
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo [$K]"})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "secret_error"
    assert f"the secrets key file {key} is missing" in r.json()["error"]["message"]
    r = await api.post("/v1/sandboxes", json={"env_secrets": {"K": "openai"}})
    assert r.status_code == 500 and "is missing" in r.text  # refused at create too
    # Commands that do not need a secret still run; restoring the file restores all.
    r = await api.post("/v1/sandboxes", json={})
    assert r.status_code == 201
    key.write_bytes(saved)
    key.chmod(0o600)
    assert (await _exec(api, sid, "echo [$K]"))["stdout"] == f"[{VALUE}]\n"


def _assert_nowhere(state_dir: Path) -> None:
    """The value in no file under the state directory (database, WAL, sandbox dirs)."""
    seen = 0
    for path in state_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            seen += 1
            data = path.read_bytes()
            for value in (VALUE, ROTATED):
                assert value.encode() not in data, path
    assert seen >= 1  # at least the key file was read
    url = pgserver.database_url_for(state_dir)
    if url is None:  # SQLite: the database was among the files read
        db = json.dumps(sorted(p.name for p in state_dir.iterdir()))
        assert "hutch.db" in db
        return
    with psycopg.connect(url) as conn:  # PostgreSQL: nor in any row of the secrets
        rows = conn.execute("SELECT * FROM secrets").fetchall()
    assert rows
    for row in rows:
        text = repr(row).encode() + b"".join(v for v in row if isinstance(v, bytes))
        for value in (VALUE, ROTATED):
            assert value.encode() not in text


async def test_secrets_are_per_project(api: httpx.AsyncClient) -> None:
    other = {"Hutch-Project": "other"}
    # A project must exist before the admin key can act in it (platform-auth phase 2).
    assert (await api.post("/v1/projects", json={"name": "other"})).status_code == 201
    await _put(api, "tok", VALUE)
    assert (await api.get("/v1/secrets", headers=other)).json()["secrets"] == []
    r = await api.get("/v1/secrets/tok", headers=other)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "no secret named 'tok' in project 'other'"
    # A sandbox of another project cannot name this project's secret ...
    r = await api.post("/v1/sandboxes", json={"env_secrets": {"T": "tok"}}, headers=other)
    assert r.status_code == 400
    assert "names secret 'tok', which does not exist in project 'other'" in r.text
    # ... and the same name there is another secret, with its own value and versions.
    r = await api.put("/v1/secrets/tok", json={"value": ROTATED}, headers=other)
    assert r.status_code == 201 and r.json()["project"] == "other"
    sid = (
        await api.post("/v1/sandboxes", json={"env_secrets": {"T": "tok"}}, headers=other)
    ).json()["id"]
    r = await api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo $T"}, headers=other)
    assert r.json()["stdout"] == f"{ROTATED}\n"
    # The default project's secret is not held by the other project's sandbox.
    assert (await api.delete("/v1/secrets/tok")).status_code == 204
    assert (await api.delete("/v1/secrets/tok", headers=other)).status_code == 409
