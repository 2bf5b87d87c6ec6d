"""LangChain and OpenAI function-calling wrappers, against the SDK's FakeHutch."""

from __future__ import annotations

import builtins
import json
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import StructuredTool

from hutch.agent_tools.specs import TOOLS, TOOLS_BY_NAME
from hutch.integrations import openai_tools
from hutch.integrations.langchain import LangChainMissing, hutch_tools
from hutch.sdk import AsyncClient
from hutch.testing import FakeHutch, FakeRun

URL = "http://hutch.test"


@pytest.fixture
def fake() -> FakeHutch:
    fake = FakeHutch()
    fake.exec_handler = lambda _sb, body: FakeRun([("stdout", "ran: " + body["cmd"])])
    return fake


def conn(fake: FakeHutch) -> dict[str, Any]:
    return {"base_url": URL, "api_key": fake.api_key, "transport": fake.transport}


# -- OpenAI ------------------------------------------------------------------------------------


def test_openai_schemas_come_from_the_shared_specs() -> None:
    chat = openai_tools.tool_schemas()
    assert [t["function"]["name"] for t in chat] == [s.name for s in TOOLS]
    run = next(t for t in chat if t["function"]["name"] == "run_command")
    assert run["type"] == "function"
    assert run["function"]["parameters"] == TOOLS_BY_NAME["run_command"].parameters
    assert run["function"]["parameters"] is not TOOLS_BY_NAME["run_command"].parameters
    flat = openai_tools.tool_schemas(style="responses")
    assert flat[0] == {"type": "function", **chat[0]["function"]}
    json.dumps(chat)  # plain JSON data
    with pytest.raises(ValueError, match="accepted: 'chat', 'responses'"):
        openai_tools.tool_schemas(style="xml")  # type: ignore[arg-type]


def test_openai_dispatch_runs_tools_and_returns_plain_dicts(fake: FakeHutch) -> None:
    created = openai_tools.dispatch("create_sandbox", '{"memory_mib": 256}', **conn(fake))
    assert created["ok"] is True and created["result"]["memory_mib"] == 256
    sandbox_id = created["result"]["id"]
    args = json.dumps({"sandbox_id": sandbox_id, "command": "uname -a"})
    ran = openai_tools.dispatch("run_command", args, **conn(fake))
    assert ran["ok"] and ran["result"]["stdout"] == "ran: uname -a"
    assert ran["summary"].startswith("Exit code 0.")
    json.dumps(ran)


def test_openai_dispatch_reports_bad_calls_as_data(fake: FakeHutch) -> None:
    bad_json = openai_tools.dispatch("run_command", "{sandbox_id:", **conn(fake))
    assert bad_json["ok"] is False and bad_json["error"]["code"] == "invalid_argument"
    assert "arguments are not valid JSON" in bad_json["error"]["message"]
    not_object = openai_tools.dispatch("list_sandboxes", "[1]", **conn(fake))
    assert "must be a JSON object, got list" in not_object["error"]["message"]
    unknown = openai_tools.dispatch("format_disk", "{}", **conn(fake))
    assert unknown["error"]["code"] == "unknown_tool"
    missing = openai_tools.dispatch("run_command", '{"command": "ls"}', **conn(fake))
    assert missing["error"]["message"].startswith(
        "run_command: missing required argument 'sandbox_id'"
    )
    gone = openai_tools.dispatch(
        "run_command", {"sandbox_id": "sb-0000000000aa", "command": "ls"}, **conn(fake)
    )
    assert gone["error"]["code"] == "not_found"


async def test_openai_adispatch_shares_a_client_and_sync_dispatch_works_in_a_loop(
    fake: FakeHutch,
) -> None:
    async with AsyncClient(**conn(fake)) as client:
        created = await openai_tools.adispatch("create_sandbox", "{}", client=client)
        listed = await openai_tools.adispatch("list_sandboxes", None, client=client)
    assert [s["id"] for s in listed["result"]["sandboxes"]] == [created["result"]["id"]]
    # A sync call from inside a running loop (a notebook, an async agent) still works.
    again = openai_tools.dispatch("list_sandboxes", "", **conn(fake))
    assert again["ok"] and len(again["result"]["sandboxes"]) == 1


# -- LangChain ---------------------------------------------------------------------------------


def test_langchain_tools_have_the_shared_schemas(fake: FakeHutch) -> None:
    tools = hutch_tools(**conn(fake))
    assert all(isinstance(t, StructuredTool) for t in tools)
    assert [t.name for t in tools] == [s.name for s in TOOLS]
    run = next(t for t in tools if t.name == "run_command")
    assert run.description == TOOLS_BY_NAME["run_command"].description
    assert run.args_schema == TOOLS_BY_NAME["run_command"].parameters
    assert set(run.args) == set(TOOLS_BY_NAME["run_command"].parameters["properties"])
    only = hutch_tools(names=["run_command", "read_file"], **conn(fake))
    assert [t.name for t in only] == ["run_command", "read_file"]
    with pytest.raises(ValueError, match="no hutch tool 'nope'"):
        hutch_tools(names=["nope"], **conn(fake))


def test_langchain_tools_run_sync_with_artifact(fake: FakeHutch) -> None:
    tools = {t.name: t for t in hutch_tools(**conn(fake))}
    sandbox_id = fake.add_sandbox().id
    message = tools["run_command"].invoke(
        {
            "type": "tool_call",
            "id": "call-1",
            "name": "run_command",
            "args": {"sandbox_id": sandbox_id, "command": "ls /"},
        }
    )
    assert isinstance(message, ToolMessage)
    assert isinstance(message.content, str)
    assert message.content.startswith("Exit code 0.\nstdout:\nran: ls /")
    assert message.artifact["exit_code"] == 0 and message.artifact["stdout"] == "ran: ls /"
    # Plain invoke gives the content.
    text = tools["list_sandboxes"].invoke({})
    assert text.startswith("1 sandbox(es):")


async def test_langchain_tools_run_async_on_a_shared_client(fake: FakeHutch) -> None:
    async with AsyncClient(**conn(fake)) as client:
        tools = {t.name: t for t in hutch_tools(client)}
        text = await tools["create_sandbox"].ainvoke({"name": "lc"})
        assert "(lc): running" in text
        bad = await tools["fork_sandbox"].ainvoke({"sandbox_id": "sb-0123456789ab", "count": 0})
    # handle_tool_error: the error text is the tool's output, for the model to act on.
    assert bad == "fork_sandbox: count=0 is out of range; accepted: 1-100"


def test_langchain_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_langchain(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("langchain_core"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_langchain)
    with pytest.raises(LangChainMissing, match=r"pip install 'hutch\[langchain\]'") as info:
        hutch_tools()
    assert isinstance(info.value, ImportError)
