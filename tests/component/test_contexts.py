"""Code-interpreter contexts through the REST API, against the real guest agent (the
kernel runs on the host here; tests/vm/test_interpreter_vm.py runs it in a VM)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from typing import Any

import httpx
import pytest

from tests.component.fake_backend import AGENT_PYTHON

pytestmark = pytest.mark.timeout(120)

# The fake backend runs the kernel with the host's system Python (`make test` installs
# python3-matplotlib for it).
HAS_MATPLOTLIB = (
    subprocess.run([AGENT_PYTHON, "-c", "import matplotlib"], capture_output=True).returncode == 0
)


@pytest.fixture
async def sid(api: httpx.AsyncClient) -> str:
    r = await api.post("/v1/sandboxes", json={"env": {"FROM_SANDBOX": "yes"}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def make_ctx(api: httpx.AsyncClient, sid: str, **body: object) -> str:
    r = await api.post(f"/v1/sandboxes/{sid}/contexts", json=body)
    assert r.status_code == 201, r.text
    ctx = r.json()
    assert ctx["language"] == "python" and ctx["state"] == "idle"
    return str(ctx["id"])


async def run(
    api: httpx.AsyncClient, sid: str, cid: str, code: str, **kw: object
) -> dict[str, Any]:
    r = await api.post(f"/v1/sandboxes/{sid}/contexts/{cid}/run", json={"code": code, **kw})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_state_persists_and_outputs_are_structured(api: httpx.AsyncClient, sid: str) -> None:
    cid = await make_ctx(api, sid)
    body = await run(api, sid, cid, "import os, sys\nx = 41\nprint('hi')\nx + 1")
    assert body["status"] == "ok" and body["error"] is None
    assert body["stdout"] == "hi\n"
    assert body["result"] == {"text/plain": "42"}
    assert [o["type"] for o in body["outputs"]] == ["stdout", "result"]

    body = await run(api, sid, cid, "print('e', file=sys.stderr); os.environ['FROM_SANDBOX'], x")
    assert body["stderr"] == "e\n"
    assert body["result"]["text/plain"] == "('yes', 41)"

    body = await run(api, sid, cid, "def f():\n    return 1 / 0\nf()")
    assert body["status"] == "error" and body["result"] is None
    err = body["error"]
    assert err["ename"] == "ZeroDivisionError" and err["evalue"] == "division by zero"
    assert any("<cell-" in line for line in err["traceback"])
    assert not any("kernel.py" in line for line in err["traceback"])

    body = await run(api, sid, cid, "def broken(:")
    assert body["error"]["ename"] == "SyntaxError"

    # Output of child processes and C code (fd 1) is caught too.
    body = await run(api, sid, cid, "import subprocess; subprocess.run(['echo', 'child'])")
    assert "child\n" in body["stdout"]


async def test_rich_outputs(api: httpx.AsyncClient, sid: str) -> None:
    cid = await make_ctx(api, sid)
    code = (
        "class T:\n"
        "    def _repr_html_(self): return '<table><tr><td>1</td></tr></table>'\n"
        "    def _repr_markdown_(self): return '**md**'\n"
        "    def _repr_png_(self): return b'\\x89PNG-fake'\n"
        "display(T(), 'plain')\n"
        "T()"
    )
    body = await run(api, sid, cid, code)
    displays = [o for o in body["outputs"] if o["type"] == "display"]
    assert displays[0]["data"]["text/html"].startswith("<table>")
    assert displays[0]["data"]["text/markdown"] == "**md**"
    assert base64.b64decode(displays[0]["data"]["image/png"]) == b"\x89PNG-fake"
    assert displays[1]["data"] == {"text/plain": "'plain'"}
    assert body["result"]["text/html"].startswith("<table>")


@pytest.mark.skipif(
    not HAS_MATPLOTLIB,
    reason=f"matplotlib is not installed for {AGENT_PYTHON}, which runs the kernel in the "
    "component tier: `make test` installs python3-matplotlib (tests/vm/test_interpreter_vm.py "
    "checks PNG charts in the devbox image)",
)
async def test_matplotlib_png(api: httpx.AsyncClient, sid: str) -> None:
    cid = await make_ctx(api, sid)
    body = await run(api, sid, cid, "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    png = base64.b64decode(body["outputs"][-1]["data"]["image/png"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


STREAMED = "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.05)\n'done'"


async def test_stream_interrupt_timeout_restart(api: httpx.AsyncClient, sid: str) -> None:
    cid = await make_ctx(api, sid)
    await run(api, sid, cid, "keep = 'kept'")

    # Streamed: outputs arrive as lines while the code runs.
    lines: list[dict[str, Any]] = []
    async with api.stream(
        "POST",
        f"/v1/sandboxes/{sid}/contexts/{cid}/run",
        params={"stream": "1"},
        json={"code": STREAMED},
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                lines.append(json.loads(line))
    assert [x["type"] for x in lines][-2:] == ["result", "end"]
    assert "".join(x["text"] for x in lines if x["type"] == "stdout") == "0\n1\n2\n"

    async def interrupt_soon() -> httpx.Response:
        for _ in range(100):
            r = await api.get(f"/v1/sandboxes/{sid}/contexts/{cid}")
            if r.json()["state"] == "busy":
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return await api.post(f"/v1/sandboxes/{sid}/contexts/{cid}/interrupt")

    long_run = asyncio.create_task(run(api, sid, cid, "import time\ntime.sleep(60)"))
    r = await interrupt_soon()
    assert r.status_code == 200, r.text
    body = await long_run
    assert body["status"] == "interrupted"
    assert body["error"]["ename"] == "KeyboardInterrupt"
    assert (await run(api, sid, cid, "keep"))["result"]["text/plain"] == "'kept'"

    body = await run(api, sid, cid, "import time\ntime.sleep(60)", timeout_s=0.5)
    assert body["status"] == "timeout" and body["error"]["ename"] == "TimeoutError"
    assert (await run(api, sid, cid, "keep"))["result"]["text/plain"] == "'kept'"

    r = await api.post(f"/v1/sandboxes/{sid}/contexts/{cid}/restart")
    assert r.status_code == 200 and r.json()["runs"] == 0
    body = await run(api, sid, cid, "keep")
    assert body["error"]["ename"] == "NameError"


async def test_several_contexts_and_errors(api: httpx.AsyncClient, sid: str) -> None:
    a = await make_ctx(api, sid)
    b = await make_ctx(api, sid, cwd="/tmp", env={"ONLY_B": "1"})
    await run(api, sid, a, "v = 'a'")
    await run(api, sid, b, "v = 'b'")
    assert (await run(api, sid, a, "v"))["result"]["text/plain"] == "'a'"
    body = await run(api, sid, b, "import os; v, os.getcwd(), os.environ.get('ONLY_B')")
    assert body["result"]["text/plain"] == "('b', '/tmp', '1')"

    r = await api.get(f"/v1/sandboxes/{sid}/contexts")
    assert {c["id"] for c in r.json()["contexts"]} == {a, b}

    r = await api.delete(f"/v1/sandboxes/{sid}/contexts/{a}")
    assert r.status_code == 204
    for method, suffix, body_json in (
        ("POST", "/run", {"code": "1"}),
        ("POST", "/interrupt", None),
        ("POST", "/restart", None),
        ("DELETE", "", None),
        ("GET", "", None),
    ):
        r = await api.request(method, f"/v1/sandboxes/{sid}/contexts/{a}{suffix}", json=body_json)
        assert r.status_code == 404, (method, suffix, r.text)
        err = r.json()["error"]
        assert err["code"] == "not_found" and a in err["message"]
        assert f"/v1/sandboxes/{sid}/contexts" in err["message"]

    r = await api.post(f"/v1/sandboxes/{sid}/contexts/ctx-nope/run", json={"code": "1"})
    assert r.status_code == 404
    r = await api.post(f"/v1/sandboxes/{sid}/contexts", json={"language": "ruby"})
    assert r.status_code == 400
    r = await api.post(f"/v1/sandboxes/{sid}/contexts", json={"cwd": "/nope"})
    assert r.status_code == 404 and "/nope" in r.json()["error"]["message"]

    # The kernel exiting is reported, and restart brings the context back.
    body = await run(api, sid, b, "import os; os._exit(3)")
    assert body["error"]["ename"] == "KernelDied"
    r = await api.post(f"/v1/sandboxes/{sid}/contexts/{b}/run", json={"code": "1"})
    assert r.status_code == 409 and "restart" in r.json()["error"]["message"]
    await api.post(f"/v1/sandboxes/{sid}/contexts/{b}/restart")
    assert (await run(api, sid, b, "1 + 1"))["result"]["text/plain"] == "2"


async def test_contexts_survive_a_reconnect(
    service: object, api: httpx.AsyncClient, sid: str
) -> None:
    """Contexts belong to the agent, not to the host's connection."""
    from hutch.guest.client import AgentClient
    from hutch.services.composed import Services

    assert isinstance(service, Services)
    cid = await make_ctx(api, sid)
    await run(api, sid, cid, "survivor = 7")
    runtime = service.guest.runtime(sid)
    old = runtime.agent
    await old.close()
    runtime.agent = await AgentClient.connect(old.socket_path, timeout_s=10)
    assert (await run(api, sid, cid, "survivor"))["result"]["text/plain"] == "7"


async def test_sdk_sync_and_async(api: httpx.AsyncClient, sid: str) -> None:
    from hutch.errors import NotFound
    from hutch.sdk import AsyncSandbox, Sandbox
    from tests.component.conftest import API_KEY

    sb = await AsyncSandbox.connect(sid, base_url=str(api.base_url), api_key=API_KEY)
    try:
        ex = await sb.run_code("a = 20\na * 2")
        assert ex.text == "40" and ex.error is None and ex.status == "ok"
        ex = await sb.run_code("print('p')\na")  # the default context keeps state
        assert (ex.stdout, ex.text) == ("p\n", "20")
        ctx = await sb.contexts.create()
        seen: list[str] = []
        ex = await ctx.run("print('x'); 1/0", on_stdout=seen.append)
        assert seen == ["x\n"] and ex.error is not None and ex.error.name == "ZeroDivisionError"
        assert "ZeroDivisionError" in ex.error.traceback_text
        assert {c.id for c in await sb.contexts.list()} >= {ctx.id}
        await ctx.delete()
        with pytest.raises(NotFound, match=ctx.id):
            await ctx.run("1")
    finally:
        await sb.close()

    def blocking() -> None:
        with Sandbox.connect(sid, base_url=str(api.base_url), api_key=API_KEY) as sbs:
            ctx = sbs.contexts.create()
            ex = ctx.run(
                "class H:\n    def _repr_html_(self): return '<i>h</i>'\n"
                "    def _repr_png_(self): return b'\\x89PNG'\nH()"
            )
            assert ex.result is not None and ex.result.html == "<i>h</i>"
            assert ex.images == [b"\x89PNG"]
            results: list[object] = []
            ex = sbs.run_code("display('d'); 5", context=ctx, on_result=results.append)
            assert ex.text == "5" and len(results) == 2
            ctx.restart()
            assert sbs.run_code("H", context=ctx.id).error is not None

    await asyncio.to_thread(blocking)


async def test_cli_run_code(api: httpx.AsyncClient, sid: str, tmp_path: object) -> None:
    from pathlib import Path

    from click.testing import CliRunner

    from hutch.cli._env import CliEnv
    from hutch.cli.main import cli
    from tests.component.conftest import API_KEY

    assert isinstance(tmp_path, Path)
    env = CliEnv(url=str(api.base_url), api_key=API_KEY)
    cid = await make_ctx(api, sid)
    png_code = (
        "class P:\n    def _repr_png_(self): return b'\\x89PNG\\r\\n\\x1a\\nfake'\n"
        "display(P())\nprint('out')\nn = 6\nn * 7"
    )

    def invoke(*argv: str, stdin: str | None = None) -> Any:
        return CliRunner().invoke(cli, list(argv), obj=env, input=stdin)

    result = await asyncio.to_thread(
        invoke, "run-code", sid, "--context", cid, "--save-images", str(tmp_path / "img"), png_code
    )
    assert result.exit_code == 0, result.output
    assert "out\n" in result.stdout and result.stdout.rstrip().endswith("42")
    assert (tmp_path / "img" / "output-1.png").read_bytes().startswith(b"\x89PNG")

    result = await asyncio.to_thread(invoke, "run-code", sid, "--context", cid, "-", stdin="n")
    assert result.exit_code == 0 and result.stdout.strip() == "6"

    result = await asyncio.to_thread(invoke, "run-code", sid, "raise ValueError('bad')")
    assert result.exit_code == 1 and "ValueError: bad" in result.stderr
    # Without --context the temporary context is gone afterwards.
    r = await api.get(f"/v1/sandboxes/{sid}/contexts")
    assert [c["id"] for c in r.json()["contexts"]] == [cid]

    result = await asyncio.to_thread(invoke, "run-code", sid, "--context", "ctx-000000000000", "1")
    assert result.exit_code == 1 and "ctx-000000000000" in result.stderr

    result = await asyncio.to_thread(invoke, "run-code", sid, "--json", "--context", cid, "n + 1")
    assert json.loads(result.stdout)["result"] == {"text/plain": "7"}
