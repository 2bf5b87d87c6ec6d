"""Starting guest commands: the checks and defaults every way of running one shares
(exec, background processes, terminals): argv or shell, env, cwd, user."""

from __future__ import annotations

import grp
import os
import pwd
import select
import subprocess
from typing import Any

from hutch_agent import HOME
from hutch_agent.errors import AgentError
from hutch_agent.framing import STDERR, STDOUT


def _passwd(name: str, uid: int, gid: int, home: str) -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, gid, "", home, "/bin/sh"))


def _lookup_user(user: str) -> pwd.struct_passwd | None:
    """A passwd entry by name or uid. An image without /etc/passwd (distroless, a
    bare busybox) still has root and numeric uids, as container runtimes allow."""
    try:
        if user.isdigit():
            return pwd.getpwuid(int(user))
        return pwd.getpwnam(user)
    except (KeyError, ValueError, OverflowError):  # unknown, NUL byte, uid too big
        pass
    if user in ("0", "root"):
        return _passwd("root", 0, 0, HOME)
    if user.isdigit() and int(user) < 2**32 - 1:
        return _passwd(user, int(user), int(user), "/")
    return None


def _lookup_group(group: str) -> int | None:
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except (KeyError, ValueError, OverflowError):
        return None


def resolve_user(user: Any) -> pwd.struct_passwd:
    """``user``: None (root), a uid, a name, or ``user:group`` with either half a name
    or a number (the OCI ``User`` syntax)."""
    if user is None:
        user = "0"
    if isinstance(user, int) and not isinstance(user, bool):
        user = str(user)
    if isinstance(user, str) and user:
        name, _, group = user.partition(":")
        entry = _lookup_user(name) if name else None
        if entry is not None and group:
            gid = _lookup_group(group)
            if gid is None or gid >= 2**32 - 1:
                raise AgentError(
                    "invalid_argument", f"group {group!r} does not exist in the sandbox"
                )
            entry = pwd.struct_passwd((*entry[:3], gid, *entry[4:]))
        if entry is not None:
            return entry
    raise AgentError("invalid_argument", f"user {user!r} does not exist in the sandbox")


def spawn_args(h: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """argv and the Popen keywords (env, cwd, user ids) for a request like exec's."""
    argv = h.get("argv")
    if h.get("shell") is not None:
        if not isinstance(h["shell"], str):
            raise AgentError("invalid_argument", "shell must be a string")
        argv = ["/bin/sh", "-c", h["shell"]]
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) and "\0" not in a for a in argv)
    ):
        raise AgentError("invalid_argument", "argv must be a non-empty list of strings")
    user = resolve_user(h.get("user"))
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": user.pw_dir,
        "USER": user.pw_name,
        "LOGNAME": user.pw_name,
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
    }
    extra = h.get("env") or {}
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "\0" not in k + v and "=" not in k
        for k, v in extra.items()
    ):
        raise AgentError("invalid_argument", "env must map names to strings")
    env.update(extra)
    cwd = h.get("cwd")
    if not cwd:
        # An image may lack the home directory (a bare busybox has no /root).
        cwd = HOME if user.pw_uid == 0 else user.pw_dir
        cwd = cwd if os.path.isdir(cwd) else "/"
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise AgentError("not_found", f"working directory {cwd!r} does not exist in the sandbox")
    kw: dict[str, Any] = {"env": env, "cwd": cwd}
    if (user.pw_uid, user.pw_gid) != (os.geteuid(), os.getegid()):
        if os.geteuid() != 0:
            raise AgentError("permission_denied", "the agent cannot switch users")
        kw.update(user=user.pw_uid, group=user.pw_gid, extra_groups=_groups(user))
    return argv, kw


def _groups(user: pwd.struct_passwd) -> list[int]:
    try:
        return os.getgrouplist(user.pw_name, user.pw_gid)
    except OSError:
        return [user.pw_gid]


def popen(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(argv, close_fds=True, **kw)
    except FileNotFoundError as exc:
        raise AgentError(
            "command_not_found", f"command not found in the sandbox: {argv[0]!r}"
        ) from exc
    except PermissionError as exc:
        raise AgentError(
            "permission_denied", f"permission denied running {argv[0]!r}: {exc.strerror}"
        ) from exc


def watch_output(proc: subprocess.Popen[bytes]) -> tuple[select.poll, dict[int, int], int | None]:
    """A poller on ``proc``'s stdout and stderr (fd -> STDOUT/STDERR channel) and on its
    pidfd, so that its exit wakes the poll too (None where pidfd_open is missing: the
    caller then polls ``proc.poll()`` on a short timeout)."""
    assert proc.stdout is not None and proc.stderr is not None
    channels = {proc.stdout.fileno(): STDOUT, proc.stderr.fileno(): STDERR}
    poller = select.poll()
    for fd in channels:
        poller.register(fd, select.POLLIN)
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(proc.pid)
        poller.register(pidfd, select.POLLIN)
    except OSError:
        pidfd = None
    return poller, channels, pidfd
