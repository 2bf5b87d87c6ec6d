"""A sandbox's defaults from its image config (imported OCI images): ``Env`` under the
sandbox's own env, ``WorkingDir`` and ``User`` for commands that name none, and the
start command (``Entrypoint`` + ``Cmd``), run as a background process when a sandbox
boots, for images imported with ``start=true``.

Precedence, lowest first: the agent's base environment (PATH, HOME, ...), the image's
``Env``, the sandbox's ``env``, its ``env_secrets`` (their current values, resolved by
the caller for this one command), the request's ``env``. A request's ``cwd``/``user`` win
over the image's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from hutch.errors import HutchError, InvalidArgument, NotFound
from hutch.guest.client import AgentClient
from hutch.guest.processes import GuestProcesses, ProcessInfo
from hutch.models import SandboxRecord, validate_env
from hutch.services.images import ImageDefaults

__all__ = ["merged", "run_start_command"]

log = logging.getLogger(__name__)


def merged(
    defaults: ImageDefaults,
    rec: SandboxRecord,
    env: dict[str, str] | None,
    cwd: str | None,
    user: str | None,
    secret_env: Mapping[str, str],
) -> tuple[dict[str, str], str | None, str | None]:
    """(env, cwd, user) for one command in ``rec``; ``secret_env``: its env_secrets'
    values (``SandboxRegistry.secret_env``)."""
    return (
        {**defaults.env, **rec.env, **secret_env, **validate_env(env or {})},
        cwd or defaults.cwd,
        user or defaults.user,
    )


async def run_start_command(
    agent: AgentClient,
    rec: SandboxRecord,
    defaults: ImageDefaults,
    secret_env: Callable[[], Mapping[str, str]],
) -> ProcessInfo | None:
    """Start the image's start command in ``rec`` (None if it has none). A command that
    cannot start raises ``InvalidArgument`` naming the image and the command."""
    if not defaults.start_command:
        return None
    env, cwd, user = merged(defaults, rec, None, None, None, secret_env())
    argv = list(defaults.start_command)
    try:
        info = await GuestProcesses(agent).start(argv, env=env, cwd=cwd, user=user)
    except (InvalidArgument, NotFound) as exc:
        raise InvalidArgument(
            f"image {rec.image!r}: its start command {argv} could not start in sandbox "
            f"{rec.id}: {exc.message}"
        ) from exc
    except HutchError:
        raise
    log.info("sandbox %s: started the image's start command %s as pid %d", rec.id, argv, info.pid)
    return info
