"""Raw instructions → typed ones: the instruction set hutch builds, each with its
arguments split as Docker splits them and its flags checked (pure).

Supported: ``FROM RUN COPY ADD ENV ARG WORKDIR USER EXPOSE LABEL CMD ENTRYPOINT``
(and ``MAINTAINER``, kept as the ``maintainer`` label). Refused, with the line:
``HEALTHCHECK ONBUILD STOPSIGNAL SHELL VOLUME`` and anything unknown; ``RUN --mount``
(and every other RUN flag), ``COPY --from`` (multi-stage builds), ``ADD --checksum``
and ``--keep-git-dir`` (remote sources), heredocs (``RUN <<EOF``). Arguments are not
expanded here: which instructions expand ``$VAR`` (and against what) is the planner's
business (:mod:`hutch.images.dockerfile.plan`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from hutch.errors import InvalidDockerfile
from hutch.images.dockerfile.lexer import split_words
from hutch.images.dockerfile.parser import Dockerfile, RawInstruction

__all__ = [
    "SUPPORTED",
    "UNSUPPORTED",
    "Add",
    "Arg",
    "Cmd",
    "Command",
    "Copy",
    "Entrypoint",
    "Env",
    "Expose",
    "From",
    "Instruction",
    "Label",
    "Run",
    "User",
    "Workdir",
    "typed",
    "typed_all",
]

SUPPORTED = (
    "FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "LABEL",
    "CMD", "ENTRYPOINT", "MAINTAINER",
)  # fmt: skip
#: Real Dockerfile instructions hutch's builder does not do (each refused by name).
UNSUPPORTED = {
    "HEALTHCHECK": "hutch does not run health checks",
    "ONBUILD": "triggers for later builds are not kept",
    "STOPSIGNAL": "a sandbox is stopped by hutch, not by a signal to a main process",
    "SHELL": "RUN and CMD in shell form always use /bin/sh -c",
    "VOLUME": "use hutch volumes when a sandbox is created instead",
}
_HEREDOC = re.compile(r"^\d*<<-?\s*['\"]?[A-Za-z_]\w*['\"]?$")


@dataclass(frozen=True)
class Command:
    """A command in exec form (``argv``) or shell form (``shell``, run as
    ``/bin/sh -c shell``)."""

    argv: tuple[str, ...] | None = None
    shell: str | None = None

    def as_argv(self) -> list[str]:
        if self.argv is not None:
            return list(self.argv)
        return ["/bin/sh", "-c", self.shell or ""]


@dataclass(frozen=True)
class Instruction:
    raw: RawInstruction

    @property
    def line(self) -> int:
        return self.raw.line

    @property
    def keyword(self) -> str:
        return self.raw.keyword


@dataclass(frozen=True)
class From(Instruction):
    image: str  # not expanded
    alias: str | None = None
    platform: str | None = None


@dataclass(frozen=True)
class Run(Instruction):
    command: Command


@dataclass(frozen=True)
class Cmd(Instruction):
    command: Command


@dataclass(frozen=True)
class Entrypoint(Instruction):
    command: Command


@dataclass(frozen=True)
class Copy(Instruction):
    """COPY (and ADD: :class:`Add`): sources and destination, not expanded."""

    sources: tuple[str, ...]
    dest: str
    chown: str | None = None
    chmod: str | None = None


@dataclass(frozen=True)
class Add(Copy):
    pass


@dataclass(frozen=True)
class Env(Instruction):
    pairs: tuple[tuple[str, str], ...]  # (name, value), both not expanded


@dataclass(frozen=True)
class Label(Instruction):
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Arg(Instruction):
    args: tuple[tuple[str, str | None], ...]  # (name, default or None)


@dataclass(frozen=True)
class Workdir(Instruction):
    path: str


@dataclass(frozen=True)
class User(Instruction):
    user: str


@dataclass(frozen=True)
class Expose(Instruction):
    ports: tuple[str, ...]


@dataclass(frozen=True)
class Maintainer(Instruction):
    name: str


@dataclass(frozen=True)
class _Flags:
    """The flags an instruction takes: name → whether it needs a value."""

    allowed: dict[str, bool] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


_FLAGS: dict[str, _Flags] = {
    "FROM": _Flags({"platform": True}),
    "RUN": _Flags(
        refused={
            "mount": "RUN --mount (cache, secret, bind and ssh mounts) is not supported",
            "network": "RUN --network is not supported; the build's egress rules apply "
            "to every step",
            "security": "RUN --security is not supported",
        }
    ),
    "COPY": _Flags(
        {"chown": True, "chmod": True, "link": False},
        {
            "from": "COPY --from (multi-stage builds) is not supported; copy from the "
            "build context",
            "parents": "COPY --parents is not supported",
            "exclude": "COPY --exclude is not supported; use .dockerignore",
        },
    ),
    "ADD": _Flags(
        {"chown": True, "chmod": True, "link": False},
        {
            "checksum": "ADD --checksum is for remote sources, which hutch does not fetch",
            "keep-git-dir": "ADD --keep-git-dir is for git sources, which hutch does not fetch",
            "unpack": "ADD --unpack is not supported",
            "exclude": "ADD --exclude is not supported; use .dockerignore",
        },
    ),
}


def _fail(raw: RawInstruction, message: str) -> InvalidDockerfile:
    return InvalidDockerfile(f"Dockerfile {raw.where()}: {raw.keyword}: {message}")


def _flags(raw: RawInstruction) -> dict[str, str | None]:
    spec = _FLAGS.get(raw.keyword, _Flags())
    out: dict[str, str | None] = {}
    for flag in raw.flags:
        if flag.name in spec.refused:
            raise _fail(raw, spec.refused[flag.name])
        if flag.name not in spec.allowed:
            takes = ", ".join(f"--{n}" for n in spec.allowed) or "no flags"
            raise _fail(raw, f"--{flag.name} is not a flag of {raw.keyword}; it takes {takes}")
        if flag.name in out:
            raise _fail(raw, f"--{flag.name} is given twice")
        if spec.allowed[flag.name] and not flag.value:
            raise _fail(raw, f"--{flag.name} needs a value (--{flag.name}=...)")
        if not spec.allowed[flag.name] and flag.value not in (None, "true", "false"):
            raise _fail(raw, f"--{flag.name} takes no value")
        out[flag.name] = flag.value
    return out


def _json_list(args: str) -> list[str] | None:
    """The exec form: a JSON array of strings, or None (then it is the shell form, as in
    Docker, where text that does not parse as such an array is a shell command)."""
    text = args.strip()
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return value


def _command(raw: RawInstruction, *, allow_empty: bool) -> Command:
    argv = _json_list(raw.args)
    if argv is not None:
        if not argv and not allow_empty:
            raise _fail(raw, "the exec form needs at least the program to run")
        return Command(argv=tuple(argv))
    shell = raw.args.strip()
    if not shell:
        raise _fail(raw, "needs a command")
    return Command(shell=shell)


def _check_heredoc(raw: RawInstruction, words: list[str]) -> None:
    for word in words:
        if _HEREDOC.match(word):
            raise _fail(
                raw,
                f"heredocs ({word}) are not supported; put the text in a file in the "
                "build context and COPY it, or write it with printf in the RUN",
            )


def _name_values(raw: RawInstruction, escape: str) -> tuple[tuple[str, str], ...]:
    """``NAME=value ...`` or the legacy ``NAME value`` (one pair; the value is the rest
    of the line), as BuildKit's parseNameVal."""
    words = split_words(raw.args, escape)
    if not words:
        raise _fail(raw, "needs NAME=value")
    if "=" not in words[0]:
        parts = raw.args.strip().split(None, 1)
        if len(parts) < 2:
            raise _fail(raw, f"{parts[0]!r} has no value; write NAME=value")
        return ((parts[0], parts[1]),)
    pairs = []
    for word in words:
        name, sep, value = word.partition("=")
        if not sep:
            raise _fail(raw, f"can't find = in {word!r}; it must be of the form NAME=value")
        if not name:
            raise _fail(raw, f"{word!r} has an empty name")
        pairs.append((name, value))
    return tuple(pairs)


def typed(raw: RawInstruction, escape: str = "\\") -> Instruction:
    """One instruction; ``InvalidDockerfile`` naming the line for anything refused."""
    kw = raw.keyword
    if kw in UNSUPPORTED:
        raise InvalidDockerfile(
            f"Dockerfile {raw.where()}: {kw} is not supported ({UNSUPPORTED[kw]}); "
            f"hutch builds {', '.join(SUPPORTED)}"
        )
    if kw not in SUPPORTED:
        raise InvalidDockerfile(
            f"Dockerfile {raw.where()}: unknown instruction {kw}; hutch builds "
            f"{', '.join(SUPPORTED)}"
        )
    flags = _flags(raw)
    if kw == "FROM":
        words = raw.args.split()
        if len(words) == 3 and words[1].lower() == "as":
            return From(raw, words[0], words[2], flags.get("platform"))
        if len(words) != 1:
            raise _fail(raw, "takes an image, optionally followed by AS <name>")
        return From(raw, words[0], None, flags.get("platform"))
    if kw == "RUN":
        cmd = _command(raw, allow_empty=False)
        _check_heredoc(raw, list(cmd.argv) if cmd.argv is not None else raw.args.split())
        return Run(raw, cmd)
    if kw == "CMD":
        return Cmd(raw, _command(raw, allow_empty=True))
    if kw == "ENTRYPOINT":
        return Entrypoint(raw, _command(raw, allow_empty=True))
    if kw in ("COPY", "ADD"):
        items = _json_list(raw.args)
        if items is None:
            items = raw.args.split()
            _check_heredoc(raw, items)
        if len(items) < 2:
            raise _fail(
                raw,
                "needs at least a source and a destination"
                + (f" (only {items[0]!r} was given)" if items else ""),
            )
        cls = Add if kw == "ADD" else Copy
        return cls(raw, tuple(items[:-1]), items[-1], flags.get("chown"), flags.get("chmod"))
    if kw == "ENV":
        return Env(raw, _name_values(raw, escape))
    if kw == "LABEL":
        return Label(raw, _name_values(raw, escape))
    if kw == "ARG":
        words = split_words(raw.args, escape)
        if not words:
            raise _fail(raw, "needs a name (ARG NAME or ARG NAME=default)")
        args: list[tuple[str, str | None]] = []
        for word in words:
            name, sep, default = word.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise _fail(raw, f"{name!r} is not a valid argument name")
            args.append((name, default if sep else None))
        return Arg(raw, tuple(args))
    if kw == "WORKDIR":
        if not raw.args.strip():
            raise _fail(raw, "needs a path")
        return Workdir(raw, raw.args.strip())
    if kw == "USER":
        if not raw.args.strip():
            raise _fail(raw, "needs a user (name, uid, name:group or uid:gid)")
        return User(raw, raw.args.strip())
    if kw == "EXPOSE":
        ports = raw.args.split()
        if not ports:
            raise _fail(raw, "needs at least one port (80, 80/tcp, 53/udp, 8000-8010)")
        return Expose(raw, tuple(ports))
    return Maintainer(raw, raw.args.strip())


def typed_all(dockerfile: Dockerfile) -> list[Instruction]:
    """Every instruction typed, and the file's shape checked: one FROM, with only ARG
    before it."""
    out = [typed(raw, dockerfile.escape) for raw in dockerfile.instructions]
    for ins in out:
        if isinstance(ins, From):
            break
        if not isinstance(ins, Arg):
            raise InvalidDockerfile(
                f"Dockerfile {ins.raw.where()}: {ins.keyword} before FROM; a Dockerfile "
                "starts with FROM (only ARG may come before it)"
            )
    froms = [i for i in out if isinstance(i, From)]
    if not froms:
        raise InvalidDockerfile("the Dockerfile has no FROM instruction")
    if len(froms) > 1:
        raise InvalidDockerfile(
            f"Dockerfile {froms[1].raw.where()}: a second FROM (a multi-stage build) is not "
            "supported; hutch builds one stage (one FROM)"
        )
    return out
