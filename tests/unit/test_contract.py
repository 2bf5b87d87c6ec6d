"""The contract layer (``hutch.contract``): each fact has one home, and it matches the
parts it describes (the guest agent, the REST schemas, the SDK's error map)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hutch import errors
from hutch.api import errors as api_errors
from hutch.api.routes.processes import StartProcess
from hutch.api.schemas import CreateSandbox, ExecRequest
from hutch.contract import limits
from hutch.contract.agent_codes import AGENT_ERRORS, GUEST_FAILURES, agent_error
from hutch.contract.egress import canonical_rules, mode_of, parse_rules
from hutch.contract.http_errors import CLASS_BY_CODE, STATUS_BY_ERROR, error_for, status_for
from hutch.contract.requests import COMMAND_FIELDS, CREATE_FIELDS, CommandRequest, CreateRequest
from hutch.sdk import _errors as sdk_errors
from hutch.sdk._exec import CommandArgs
from hutch.sdk._sandboxes import CreateArgs

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "hutch"
AGENT = REPO / "guest_agent" / "hutch_agent"


# -- the agent's wire error codes ---------------------------------------------------------


def _const(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def agent_codes() -> tuple[set[str], list[str]]:
    """Every error code the agent's source can put in an ERROR frame, and the places
    whose code could not be read statically (there must be none)."""
    codes: set[str] = set()
    unreadable: list[str] = []
    for path in sorted(AGENT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name == "AgentError" and node.args:
                    arg = node.args[0]
                    code = _const(arg)
                    if code is not None:
                        codes.add(code)
                    # os_error: ERRNO_CODES.get(errno, "io_error"), read below.
                    elif not (
                        isinstance(arg, ast.Call)
                        and isinstance(arg.func, ast.Attribute)
                        and isinstance(arg.func.value, ast.Name)
                        and arg.func.value.id == "ERRNO_CODES"
                    ):
                        unreadable.append(where)
                elif name == "send_error" and len(node.args) >= 2:
                    code = _const(node.args[1])
                    if code is None:
                        unreadable.append(where)
                    else:
                        codes.add(code)
                elif (
                    name == "get"
                    and isinstance(func, ast.Attribute)
                    and isinstance(func.value, ast.Name)
                    and func.value.id == "ERRNO_CODES"
                ):
                    codes.update(c for a in node.args if (c := _const(a)) is not None)
            elif isinstance(node, ast.Dict):
                keys = [_const(k) for k in node.keys]
                if "code" in keys and "message" in keys:
                    value = node.values[keys.index("code")]
                    if _const(value) is not None:
                        codes.add(str(_const(value)))
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "ERRNO_CODES" for t in node.targets
            ):
                assert isinstance(node.value, ast.Dict)
                codes.update(c for v in node.value.values if (c := _const(v)) is not None)
    return codes, unreadable


def test_every_code_the_agent_sends_is_listed_once_and_none_is_dead() -> None:
    sent, unreadable = agent_codes()
    assert not unreadable, f"agent error codes that are not literals: {unreadable}"
    # Sanity: the scan sees the codes of files, processes and the dispatcher.
    assert {"not_found", "exited", "unknown_operation", "internal"} <= sent
    listed = set(AGENT_ERRORS) | GUEST_FAILURES
    assert sent <= listed, f"the agent sends codes the contract does not map: {sent - listed}"
    assert listed <= sent, f"the contract maps codes the agent never sends: {listed - sent}"


@pytest.mark.parametrize(
    ("code", "message", "feature", "cls", "text"),
    [
        ("not_found", "no such file", None, errors.NotFound, "no such file"),
        ("exited", "process 7 already exited", None, errors.Conflict, "process 7 already"),
        ("conflict", "context died", None, errors.Conflict, "context died"),
        ("command_not_found", "nope", None, errors.InvalidArgument, "nope"),
        ("io_error", "disk on fire", None, errors.GuestError, "the guest agent failed"),
        ("from_the_future", "x", None, errors.GuestError, "(from_the_future): x"),
        ("unknown_operation", "unknown operation 'proc_start'", "background processes",
         errors.Conflict, "predates background processes"),
        # An agent built before unknown_operation existed.
        ("invalid_argument", "unknown operation 'pty_open'", "terminals",
         errors.Conflict, "predates terminals; create the sandbox from an image"),
        ("invalid_argument", "unknown operation 'watch'", None,
         errors.InvalidArgument, "unknown operation 'watch'"),
    ],
)  # fmt: skip
def test_agent_error(
    code: str, message: str, feature: str | None, cls: type[errors.HutchError], text: str
) -> None:
    exc = agent_error(code, message, feature)
    assert type(exc) is cls
    assert text in str(exc)


# -- the error <-> (status, code) table ---------------------------------------------------


@pytest.mark.parametrize("cls", errors.ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_round_trips_through_the_table(cls: type[errors.HutchError]) -> None:
    exc = cls.__new__(cls)
    errors.HutchError.__init__(exc, "boom")
    status = status_for(exc)
    assert 400 <= status < 600
    back = error_for(exc.code, status, "boom")
    assert type(back) is cls and str(back) == "boom"


def test_codes_are_unique_and_the_api_and_sdk_read_the_one_table() -> None:
    assert len(CLASS_BY_CODE) == len(errors.ALL_ERRORS)
    assert {cls for cls, _ in STATUS_BY_ERROR} == set(errors.ALL_ERRORS)
    assert api_errors.STATUS_BY_ERROR is STATUS_BY_ERROR
    assert api_errors.status_for is status_for
    assert sdk_errors.error_for is error_for


# -- one copy of each limit -----------------------------------------------------------------


def test_no_module_outside_the_contract_writes_its_own_copy_of_a_limit() -> None:
    """A name of ``hutch.contract.limits`` assigned a literal anywhere else is a second
    copy that can drift (``MAX_EGRESS_RULES`` was written five times)."""
    names = set(limits.__all__)
    copies = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "contract"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                literal = node.value is not None and all(
                    isinstance(n, ast.Constant | ast.Tuple | ast.BinOp | ast.operator)
                    for n in ast.walk(node.value)
                    if not isinstance(n, ast.expr_context)
                )
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in names and literal:
                        copies.append(f"{path.relative_to(SRC)}:{node.lineno} {target.id}")
    assert not copies, f"limits written outside hutch.contract.limits: {copies}"


def test_schemas_take_the_contract_limits_and_defaults() -> None:
    fields = CreateSandbox.model_fields
    assert fields["image"].default == limits.DEFAULT_IMAGE
    assert fields["vcpus"].default == limits.DEFAULT_VCPUS
    assert fields["memory_mib"].default == limits.DEFAULT_MEMORY_MIB
    assert fields["disk_gib"].default == limits.DEFAULT_DISK_GIB
    schema = CreateSandbox.model_json_schema()["properties"]
    assert (schema["vcpus"]["minimum"], schema["vcpus"]["maximum"]) == limits.VCPUS_RANGE
    assert schema["egress"]["anyOf"][0]["maxItems"] == limits.MAX_EGRESS_RULES
    exec_schema = ExecRequest.model_json_schema()["properties"]
    assert exec_schema["stdin"]["anyOf"][0]["maxLength"] == limits.STDIN_MAX_CHARS


# -- the egress grammar -------------------------------------------------------------------


def test_the_grammar_gives_one_canonical_form() -> None:
    assert canonical_rules(["Good.TEST.", "good.test", "198.18.0.0/24:443"]) == [
        "good.test",
        "198.18.0.0/24:443",
    ]
    assert parse_rules([]).mode == "open"
    assert mode_of(canonical_rules(["deny-all"])) == "deny-all"
    assert mode_of(["good.test"]) == "rules"
    with pytest.raises(errors.InvalidArgument, match="at most 256"):
        parse_rules([f"h{i}.test" for i in range(limits.MAX_EGRESS_RULES + 1)])


# -- the create and command fields, declared once --------------------------------------------


def _default(request: type[CreateRequest] | type[CommandRequest], name: str) -> Any:
    f = next(f for f in dataclasses.fields(request) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_the_create_fields_are_the_contracts_everywhere() -> None:
    assert len(CREATE_FIELDS) == 19
    # The REST schema: the same fields, the same defaults.
    assert tuple(CreateSandbox.model_fields) == CREATE_FIELDS
    for name, info in CreateSandbox.model_fields.items():
        schema_default = info.get_default(call_default_factory=True)
        contract_default = _default(CreateRequest, name)
        assert schema_default == contract_default or not (schema_default or contract_default)
    # The SDK's keyword arguments: every field but the positional image.
    assert tuple(CreateArgs.__annotations__) == CREATE_FIELDS[1:]


def test_the_command_fields_are_the_contracts_everywhere() -> None:
    assert len(COMMAND_FIELDS) == 6
    for schema, extra in ((ExecRequest, {"stream", "background"}), (StartProcess, {"keep_stdin"})):
        assert set(schema.model_fields) == set(COMMAND_FIELDS) | extra, schema.__name__
    assert tuple(CommandArgs.__annotations__) == COMMAND_FIELDS[1:]
    assert CommandRequest(cmd=["true"], env={}, timeout_s=None).non_defaults() == {"cmd": ["true"]}
