"""What each agent tool does: a thin adapter from tool calls to the async SDK.

``HutchTools(client).call(name, arguments)`` validates the arguments against the tool's
schema (:mod:`hutch.agent_tools.specs`), runs the SDK call and returns a :class:`ToolResult`
(structured data plus a short text for the model). Anything that goes wrong comes back
as :class:`ToolError`, whose message says what was wrong and what is accepted — never a
traceback. The MCP server and the LangChain/OpenAI integrations all go through here.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hutch.agent_tools._output import OutputCapture, truncation_marker
from hutch.agent_tools._validate import check_arguments
from hutch.agent_tools.specs import TOOLS, TOOLS_BY_NAME
from hutch.errors import HutchError, InvalidArgument, NotFound, StateError, Timeout
from hutch.sdk import (
    AsyncClient,
    AsyncSandbox,
    DaemonUnreachable,
    ExecExit,
    ExecOutput,
    SandboxInfo,
)

__all__ = ["HutchTools", "ToolError", "ToolResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer: ``data`` for programs (MCP structured content), ``text`` for the
    model (a summary; the full data is in ``data``)."""

    data: dict[str, Any]
    text: str


class ToolError(Exception):
    """A tool call failed; ``str(error)`` is written for the model to act on."""

    def __init__(self, tool: str, message: str, code: str = "error") -> None:
        super().__init__(f"{tool}: {message}")
        self.tool = tool
        self.code = code
        self.message = message


Handler = Callable[["HutchTools", dict[str, Any]], Awaitable[ToolResult]]


class HutchTools:
    """Runs tool calls against one daemon through ``client`` (not closed here)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def call(self, name: str, arguments: Mapping[str, Any] | None) -> ToolResult:
        """Run tool ``name``; raises :class:`ToolError` (and only that) on failure."""
        spec = TOOLS_BY_NAME.get(name)
        if spec is None:
            raise ToolError(
                name, f"no such tool; available: {', '.join(t.name for t in TOOLS)}", "unknown_tool"
            )
        try:
            args = check_arguments(spec.parameters, arguments)
            return await _HANDLERS[name](self, args)
        except ToolError:
            raise
        except DaemonUnreachable as exc:
            raise ToolError(
                name,
                f"{exc} — the hutch daemon is not running or HUTCH_URL is wrong; this is "
                "not something a different argument fixes",
                exc.code,
            ) from exc
        except HutchError as exc:
            raise ToolError(name, _explain(exc, args_or_empty(arguments)), exc.code) from exc
        except Exception as exc:
            # A bug of ours, not the caller's: log the traceback here, give the model
            # one line that does not pretend it can fix it.
            log.exception("tool %s failed", name)
            raise ToolError(
                name, f"internal error in the hutch tool ({type(exc).__name__}: {exc})", "internal"
            ) from exc

    # -- sandboxes ------------------------------------------------------------------------

    async def _create_sandbox(self, a: dict[str, Any]) -> ToolResult:
        info = await self.client.create_sandbox(
            a["image"],
            vcpus=a["vcpus"],
            memory_mib=a["memory_mib"],
            disk_gib=a["disk_gib"],
            env=a.get("env"),
            env_secrets=a.get("env_secrets"),
            metadata=a.get("metadata"),
            name=a.get("name"),
            timeout_s=a.get("timeout_s"),
            snapshot=a.get("snapshot"),
            volumes=a.get("volumes") or None,
        )
        return ToolResult(info.to_dict(), f"Created {_describe(info)}.")

    async def _list_volumes(self, a: dict[str, Any]) -> ToolResult:
        found = await self.client.volumes.list()
        data = {"volumes": [v.to_dict() for v in found]}
        if not found:
            return ToolResult(data, "No volumes.")
        lines = [f"{len(found)} volume(s):"]
        for v in found:
            users = ", ".join(f"{u.sandbox_id} at {u.path}" for u in v.mounted_by) or "not mounted"
            lines.append(f"- {v.name} ({v.id}, {v.kind}, {v.size} bytes): {users}")
        return ToolResult(data, "\n".join(lines))

    async def _list_secrets(self, a: dict[str, Any]) -> ToolResult:
        found = await self.client.secrets.list()
        data = {"secrets": [s.to_dict() for s in found]}
        if not found:
            return ToolResult(data, "No secrets.")
        names = ", ".join(f"{s.name} (version {s.version})" for s in found)
        return ToolResult(data, f"{len(found)} secret(s): {names}.")

    async def _list_sandboxes(self, a: dict[str, Any]) -> ToolResult:
        found = await self.client.list_sandboxes(a.get("state"), a.get("metadata"))
        data = {"sandboxes": [info.to_dict() for info in found]}
        if not found:
            return ToolResult(data, "No sandboxes.")
        lines = [f"{len(found)} sandbox(es):", *(f"- {_describe(info)}" for info in found)]
        return ToolResult(data, "\n".join(lines))

    async def _delete_sandbox(self, a: dict[str, Any]) -> ToolResult:
        sandbox_id = a["sandbox_id"]
        try:
            await self.client.delete_sandbox(sandbox_id)
        except NotFound:
            # Deleting is idempotent: gone is what the caller wanted.
            return ToolResult(
                {"sandbox_id": sandbox_id, "deleted": True},
                f"Sandbox {sandbox_id} does not exist (already deleted).",
            )
        return ToolResult({"sandbox_id": sandbox_id, "deleted": True}, f"Deleted {sandbox_id}.")

    async def _pause_sandbox(self, a: dict[str, Any]) -> ToolResult:
        info = await self.client.pause_sandbox(a["sandbox_id"], a["mode"])
        return ToolResult(info.to_dict(), f"Paused ({a['mode']} mode): {_describe(info)}.")

    async def _resume_sandbox(self, a: dict[str, Any]) -> ToolResult:
        info = await self.client.resume_sandbox(a["sandbox_id"])
        return ToolResult(info.to_dict(), f"Resumed: {_describe(info)}.")

    async def _fork_sandbox(self, a: dict[str, Any]) -> ToolResult:
        children = await self.client.fork_sandbox(a["sandbox_id"], a["count"])
        data = {"sandboxes": [info.to_dict() for info in children]}
        ids = ", ".join(info.id for info in children)
        return ToolResult(data, f"Forked {a['sandbox_id']} into {len(children)}: {ids}.")

    # -- commands -------------------------------------------------------------------------

    async def _run_command(self, a: dict[str, Any]) -> ToolResult:
        limit: int = a["max_output_chars"]
        out, err = OutputCapture(limit), OutputCapture(limit)
        exit_event: ExecExit | None = None
        timed_out = False
        try:
            async with self.client.exec_stream(
                a["sandbox_id"],
                a["command"],
                env=a.get("env"),
                cwd=a.get("cwd"),
                stdin=a.get("stdin"),
                timeout_s=a["timeout_s"],
            ) as events:
                async for event in events:
                    if isinstance(event, ExecOutput):
                        (out if event.stream == "stdout" else err).add(event.data)
                    elif isinstance(event, ExecExit):
                        exit_event = event
        except Timeout:
            # The daemon killed it; what it printed so far is still worth returning.
            timed_out = True
        data: dict[str, Any] = {
            "exit_code": exit_event.exit_code if exit_event else None,
            "signal": exit_event.signal if exit_event else None,
            "timed_out": timed_out,
            "stdout": out.text(),
            "stderr": err.text(),
            "stdout_truncated": out.truncated,
            "stderr_truncated": err.truncated,
            "duration_ms": exit_event.duration_ms if exit_event else None,
        }
        if timed_out:
            head = (
                f"Timed out: the command was still running after {a['timeout_s']} s and was "
                "killed (raise timeout_s, or run it in the background)."
            )
        elif exit_event is not None and exit_event.signal is not None:
            head = f"Killed by signal {exit_event.signal}."
        else:
            head = f"Exit code {data['exit_code']}."
        parts = [head]
        if data["stdout"]:
            parts.append("stdout:\n" + data["stdout"])
        if data["stderr"]:
            parts.append("stderr:\n" + data["stderr"])
        if not data["stdout"] and not data["stderr"]:
            parts.append("(no output)")
        return ToolResult(data, "\n".join(parts))

    # -- files ----------------------------------------------------------------------------

    async def _read_file(self, a: dict[str, Any]) -> ToolResult:
        sandbox_id, path, limit = a["sandbox_id"], a["path"], a["max_bytes"]
        entry = await self.client.stat_file(sandbox_id, path)
        if entry.is_dir:
            raise InvalidArgument(f"{path} is a directory; use list_files to see what is in it")
        chunks = bytearray()
        async with self.client.read_file_stream(sandbox_id, path) as stream:
            async for chunk in stream:
                chunks += chunk
                if len(chunks) > limit:
                    break  # stop downloading: the rest would be thrown away
        total = max(entry.size, len(chunks))
        truncated = len(chunks) > limit or total > limit
        raw = bytes(chunks[:limit])
        if a["encoding"] == "base64":
            content = base64.b64encode(raw).decode("ascii")
            shown = len(raw)
        else:
            content, shown = _decode_text(raw, path, truncated)
        data = {
            "path": entry.path,
            "size": total,
            "encoding": a["encoding"],
            "content": content,
            "truncated": truncated,
        }
        text = content
        if truncated:
            text += "\n" + truncation_marker(shown, total)
        return ToolResult(data, text)

    async def _write_file(self, a: dict[str, Any]) -> ToolResult:
        content: str = a["content"]
        if a["encoding"] == "base64":
            try:
                payload = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidArgument(
                    f"content is not valid base64 ({exc}); send the bytes base64-encoded, "
                    "or use encoding=utf-8 for text"
                ) from exc
        else:
            payload = content.encode()
        written = await self.client.write_file(
            a["sandbox_id"], a["path"], payload, int(a["mode"], 8)
        )
        return ToolResult(
            {"path": written.path, "size": written.size},
            f"Wrote {written.size} bytes to {written.path}.",
        )

    async def _list_files(self, a: dict[str, Any]) -> ToolResult:
        entries = await self.client.list_files(a["sandbox_id"], a["path"])
        data = {"path": a["path"], "entries": [entry.to_dict() for entry in entries]}
        if not entries:
            return ToolResult(data, f"{a['path']} is empty.")
        lines = [
            f"{e.type:<7} {format(e.mode, '04o')} {e.size:>10} {e.name}{'/' if e.is_dir else ''}"
            for e in entries
        ]
        return ToolResult(data, "\n".join(lines))

    # -- egress ---------------------------------------------------------------------------

    async def _set_egress(self, a: dict[str, Any]) -> ToolResult:
        sandbox = await AsyncSandbox.connect(a["sandbox_id"], client=self.client)
        rules, policy = a.get("rules"), a.get("policy") or a.get("policy_name")
        if sum(a.get(k) is not None for k in ("rules", "policy", "policy_name")) != 1:
            raise InvalidArgument(
                "give one of rules (a list), policy (an object) or policy_name (a saved policy)"
            )
        data = (await sandbox.egress.set(rules, policy=policy)).to_dict()
        return ToolResult(data, _describe_egress(a["sandbox_id"], data, "now"))

    async def _get_egress(self, a: dict[str, Any]) -> ToolResult:
        sandbox = await AsyncSandbox.connect(a["sandbox_id"], client=self.client)
        data = (await sandbox.egress.get()).to_dict()
        return ToolResult(data, _describe_egress(a["sandbox_id"], data, ""))

    async def _suggest_egress(self, a: dict[str, Any]) -> ToolResult:
        sandbox = await AsyncSandbox.connect(a["sandbox_id"], client=self.client)
        policy = await sandbox.egress.suggest()
        rules = policy.get("rules", [])
        text = (
            f"Suggested egress policy for {a['sandbox_id']} ({len(rules)} rules, inspection "
            f"{policy.get('inspection')}, default deny): {json.dumps(policy)}"
        )
        return ToolResult(policy, text)


def args_or_empty(arguments: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return arguments if isinstance(arguments, Mapping) else {}


def _explain(exc: HutchError, arguments: Mapping[str, Any]) -> str:
    """The daemon's message plus what to do next, when that is not already in it."""
    message = exc.message
    if isinstance(exc, NotFound) and "sandbox" in message and "sandbox_id" in arguments:
        return f"{message}; call list_sandboxes to see the sandboxes that exist"
    if isinstance(exc, StateError) or exc.code == "invalid_state":
        return f"{message}; check the state with list_sandboxes (resume_sandbox wakes a paused one)"
    return message


def _describe(info: SandboxInfo) -> str:
    name = f" ({info.name})" if info.name else ""
    return (
        f"sandbox {info.id}{name}: {info.state}, image {info.image}, {info.vcpus} vCPU, "
        f"{info.memory_mib} MiB, {info.disk_gib} GiB disk"
        + (f", error: {info.error}" if info.error else "")
    )


def _decode_text(raw: bytes, path: str, truncated: bool) -> tuple[str, int]:
    """UTF-8 text of ``raw`` and how many bytes it covers; a cut multi-byte character at
    the end of a truncated read is dropped, not an error."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        text = decoder.decode(raw, final=not truncated)
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"{path} is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
            "read it again with encoding=base64"
        ) from exc
    pending = len(decoder.getstate()[0])
    return text, len(raw) - pending


def _describe_egress(sandbox_id: str, data: Mapping[str, Any], when: str) -> str:
    rules = data.get("rules") or []
    mode = data.get("mode") or ("rules" if rules else "open")
    head = f"Egress of {sandbox_id} is {when + ' ' if when else ''}{mode}"
    if rules:
        head += ": " + ", ".join(str(r) for r in rules)
    counts = [f"{key} {data[key]}" for key in ("allowed", "denied") if key in data]
    return head + (f" ({', '.join(counts)})" if counts else "") + "."


_HANDLERS: dict[str, Handler] = {
    "create_sandbox": HutchTools._create_sandbox,
    "list_sandboxes": HutchTools._list_sandboxes,
    "list_volumes": HutchTools._list_volumes,
    "delete_sandbox": HutchTools._delete_sandbox,
    "run_command": HutchTools._run_command,
    "read_file": HutchTools._read_file,
    "write_file": HutchTools._write_file,
    "list_files": HutchTools._list_files,
    "pause_sandbox": HutchTools._pause_sandbox,
    "resume_sandbox": HutchTools._resume_sandbox,
    "fork_sandbox": HutchTools._fork_sandbox,
    "set_egress": HutchTools._set_egress,
    "get_egress": HutchTools._get_egress,
    "suggest_egress": HutchTools._suggest_egress,
    "list_secrets": HutchTools._list_secrets,
}
assert set(_HANDLERS) == set(TOOLS_BY_NAME), "every tool spec needs a handler"
