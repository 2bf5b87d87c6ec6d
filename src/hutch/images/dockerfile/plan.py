"""Typed instructions + build args + the base image's config → the build plan (pure).

Scoping and expansion follow Docker:

- ARGs before the FROM are *global*: they can be used in the FROM line only, unless a
  stage declares them again (``ARG NAME`` without a value takes the global value).
- In the stage, an instruction's variables are the declared ARGs (``--build-arg`` value,
  else the default) overlaid by the environment (the base image's ``Env`` and every
  ``ENV`` so far): ENV wins over an ARG of the same name.
- Expanded: FROM, COPY/ADD (sources, destination, --chown, --chmod), ENV, ARG defaults,
  LABEL, WORKDIR, USER, EXPOSE. Not expanded: RUN, CMD, ENTRYPOINT (their shell does it
  when they run; RUN sees the ARGs as environment variables, which are not kept in the
  image).
- ``ENV a=1 b=$a`` expands ``$a`` with the value from *before* the line.
- An ENTRYPOINT resets a CMD inherited from the base image.
- Without a PATH in the base image, Docker's default PATH is used (and kept).
- The predefined proxy ARGs (HTTP_PROXY, ... and lower case) may be passed without being
  declared; they reach RUN but not the cache key or the image. TARGETPLATFORM,
  TARGETOS, TARGETARCH, BUILDPLATFORM, ... have their linux/amd64 values.

A ``--build-arg`` that no ARG declares is refused (Docker warns; a typo silently
ignored is worse).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hutch.contract.limits import BUILD_ARG_MAX_CHARS, BUILD_ARGS_MAX, EXPOSE_RANGE_MAX
from hutch.errors import InvalidArgument, InvalidDockerfile
from hutch.images.dockerfile.instructions import (
    Add,
    Arg,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Expose,
    From,
    Instruction,
    Label,
    Maintainer,
    Run,
    User,
    Workdir,
)
from hutch.images.dockerfile.lexer import Expander, ExpansionError

__all__ = [
    "DEFAULT_PATH",
    "PROXY_ARGS",
    "BaseConfig",
    "CopyPlan",
    "ImageConfigPlan",
    "Plan",
    "RunPlan",
    "Step",
    "base_reference",
    "check_build_args",
    "evaluate",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROXY_ARGS = frozenset(
    name
    for base in ("HTTP_PROXY", "HTTPS_PROXY", "FTP_PROXY", "NO_PROXY", "ALL_PROXY")
    for name in (base, base.lower())
)
#: Values of BuildKit's automatic platform ARGs: hutch builds linux/amd64 only.
PLATFORM_ARGS = {
    "TARGETPLATFORM": "linux/amd64",
    "TARGETOS": "linux",
    "TARGETARCH": "amd64",
    "TARGETVARIANT": "",
    "BUILDPLATFORM": "linux/amd64",
    "BUILDOS": "linux",
    "BUILDARCH": "amd64",
    "BUILDVARIANT": "",
}
_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|git@)")
_PORT = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?(?:/([A-Za-z]+))?$")
_USER = re.compile(r"^[^\s:]+(?::[^\s:]+)?$")
_OCTAL = re.compile(r"^[0-7]{3,4}$")
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class BaseConfig:
    """What the FROM image brings (its config's defaults)."""

    env: tuple[tuple[str, str], ...] = ()
    working_dir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RunPlan:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # ARGs and ENV, ENV winning
    user: str | None  # None: root
    cwd: str


@dataclass(frozen=True)
class CopyPlan:
    add: bool
    sources: tuple[str, ...]  # expanded, relative to the context, normalized
    dest: str  # absolute, normalized
    dest_is_dir: bool  # the destination was written as a directory ("/app/", ".")
    chown: str | None
    chmod: int | None
    cwd: str


@dataclass(frozen=True)
class Step:
    """One instruction as the builder runs it. ``kind``: ``from`` (the base), ``run``,
    ``copy`` (COPY and ADD) and ``mkdir`` (a WORKDIR no later step created) change the
    filesystem; ``config`` ones only the image config. ``material`` is what the step's
    cache key covers besides the key of the step before (the service adds the digests
    of copied files and of the base image)."""

    number: int  # 1-based, in the order of the Dockerfile (FROM is 1)
    line: int
    text: str
    kind: Literal["from", "run", "copy", "mkdir", "config"]
    material: dict[str, Any]
    run: RunPlan | None = None
    copy: CopyPlan | None = None
    path: str | None = None  # mkdir


@dataclass(frozen=True)
class ImageConfigPlan:
    """The built image's config."""

    env: tuple[tuple[str, str], ...]
    working_dir: str | None
    user: str | None
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    exposed_ports: tuple[str, ...]
    labels: tuple[tuple[str, str], ...]

    def oci(self) -> dict[str, Any]:
        """The ``config`` object of an OCI image config."""
        out: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in self.env]}
        if self.working_dir:
            out["WorkingDir"] = self.working_dir
        if self.user:
            out["User"] = self.user
        if self.entrypoint:
            out["Entrypoint"] = list(self.entrypoint)
        if self.cmd:
            out["Cmd"] = list(self.cmd)
        if self.exposed_ports:
            out["ExposedPorts"] = {p: {} for p in self.exposed_ports}
        if self.labels:
            out["Labels"] = dict(self.labels)
        return out


@dataclass(frozen=True)
class Plan:
    base: str  # the FROM image, expanded
    base_line: int
    steps: tuple[Step, ...]
    config: ImageConfigPlan
    #: Build args that reached the build (declared ones, and proxy ones).
    build_args: dict[str, str] = field(default_factory=dict)

    @property
    def fs_steps(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.kind in ("run", "copy", "mkdir"))


def _fail(ins: Instruction, message: str) -> InvalidDockerfile:
    return InvalidDockerfile(f"Dockerfile {ins.raw.where()}: {ins.keyword}: {message}")


def _expand(ins: Instruction, expander: Expander, text: str) -> str:
    try:
        return expander.word(text)
    except ExpansionError as exc:
        raise _fail(ins, f"{exc} (in {text!r})") from None


def check_build_args(instructions: Iterable[Instruction], build_args: Mapping[str, str]) -> None:
    """Refuse build args no ARG declares (``InvalidArgument`` listing the declared ones)
    and malformed ones."""
    if len(build_args) > BUILD_ARGS_MAX:
        raise InvalidArgument(f"{len(build_args)} build args; at most {BUILD_ARGS_MAX}")
    declared = {name for ins in instructions if isinstance(ins, Arg) for name, _ in ins.args}
    for name, value in build_args.items():
        if not isinstance(name, str) or not _ARG_NAME.match(name):
            raise InvalidArgument(f"build arg name {name!r} is not valid (letters, digits, _)")
        if not isinstance(value, str) or "\0" in value or len(value) > BUILD_ARG_MAX_CHARS:
            raise InvalidArgument(
                f"build arg {name}: the value must be text without NUL, at most "
                f"{BUILD_ARG_MAX_CHARS} characters"
            )
        if name not in declared and name not in PROXY_ARGS:
            known = ", ".join(sorted(declared)) or "none"
            raise InvalidArgument(
                f"build arg {name} is not declared by an ARG instruction in the Dockerfile "
                f"(declared: {known}); add `ARG {name}` or drop the build arg"
            )


def _global_args(
    instructions: list[Instruction], build_args: Mapping[str, str]
) -> tuple[dict[str, str], From]:
    values: dict[str, str] = dict(PLATFORM_ARGS)
    for ins in instructions:
        if isinstance(ins, From):
            return values, ins
        assert isinstance(ins, Arg)
        expander = Expander(values)
        for name, default in ins.args:
            if name in build_args:
                values[name] = build_args[name]
            elif default is not None:
                values[name] = _expand(ins, expander, default)
    raise InvalidDockerfile("the Dockerfile has no FROM instruction")


def base_reference(
    instructions: list[Instruction], build_args: Mapping[str, str], escape: str = "\\"
) -> tuple[str, From]:
    """The FROM image (expanded with the global ARGs) and its instruction."""
    values, ins = _global_args(instructions, build_args)
    image = _expand(ins, Expander(values, escape), ins.image)
    if not image:
        raise _fail(ins, f"{ins.image!r} expands to an empty image name")
    if ins.platform is not None:
        platform = _expand(ins, Expander(values, escape), ins.platform)
        if platform not in ("linux/amd64", "linux/x86_64"):
            raise _fail(ins, f"--platform={platform}: hutch builds linux/amd64 images only")
    return image, ins


def _ports(ins: Expose, expander: Expander) -> list[str]:
    out: list[str] = []
    for written in ins.ports:
        try:
            words = expander.words(written)
        except ExpansionError as exc:
            raise _fail(ins, f"{exc} (in {written!r})") from None
        for word in words:
            m = _PORT.match(word)
            proto = (m.group(3) or "tcp").lower() if m else ""
            if m is None or proto not in ("tcp", "udp", "sctp"):
                raise _fail(ins, f"{word!r} is not a port (80, 80/tcp, 53/udp, 8000-8010)")
            low = int(m.group(1))
            high = int(m.group(2) or low)
            if not 1 <= low <= high <= 65535 or high - low >= EXPOSE_RANGE_MAX:
                raise _fail(
                    ins, f"{word!r}: ports are 1-65535, a range at most {EXPOSE_RANGE_MAX} long"
                )
            out.extend(f"{p}/{proto}" for p in range(low, high + 1))
    return out


def _context_path(ins: Instruction, source: str) -> str:
    """A COPY source as a normalized path relative to the context root ("." = all)."""
    if "\0" in source or not source:
        raise _fail(ins, f"source {source!r} is not a path")
    # normpath("/../x") is "/x": check that the written path never climbs above "."
    depth = 0
    for part in source.lstrip("/").split("/"):
        if part == "..":
            depth -= 1
        elif part not in ("", "."):
            depth += 1
        if depth < 0:
            raise _fail(
                ins,
                f"source {source!r} is outside the build context; COPY and ADD read only "
                "files inside the context",
            )
    return posixpath.normpath("/" + source.lstrip("/")).lstrip("/") or "."


class _Stage:
    """What the instructions of the stage have set so far."""

    def __init__(self, base: BaseConfig, global_args: Mapping[str, str]) -> None:
        self.env: dict[str, str] = dict(base.env)
        if "PATH" not in self.env:
            self.env = {"PATH": DEFAULT_PATH, **self.env}
        self.global_args = dict(global_args)
        self.args: dict[str, str] = {}  # declared in the stage, with a value
        self.workdir = base.working_dir
        self.user = base.user
        self.entrypoint = base.entrypoint
        self.cmd = base.cmd
        self.cmd_set = False
        self.ports = list(base.exposed_ports)
        self.labels = dict(base.labels)

    def variables(self) -> dict[str, str]:
        return {**self.args, **self.env}

    def cwd(self) -> str:
        return self.workdir or "/"


def evaluate(
    instructions: list[Instruction],
    build_args: Mapping[str, str],
    base: BaseConfig,
    escape: str = "\\",
) -> Plan:
    """The plan: every step expanded, and the image config at the end. Raises
    ``InvalidDockerfile`` (naming the line) or ``InvalidArgument`` (build args)."""
    check_build_args(instructions, build_args)
    image, from_ins = base_reference(instructions, build_args, escape)
    global_args, _ = _global_args(instructions, build_args)
    stage = _Stage(base, global_args)
    proxies = {k: v for k, v in build_args.items() if k in PROXY_ARGS}
    steps: list[Step] = []
    workdir_pending = False
    started = False
    for ins in instructions:
        if not started:
            started = ins is from_ins
            if started:
                steps.append(Step(1, ins.line, ins.raw.text, "from", {"op": "from"}))
            continue
        number = len(steps) + 1
        expander = Expander(stage.variables(), escape)

        def config(material: dict[str, Any], ins: Instruction = ins, n: int = number) -> None:
            steps.append(Step(n, ins.line, ins.raw.text, "config", material))

        material: dict[str, Any]
        if isinstance(ins, Run):
            env = {**proxies, **stage.variables()}
            run = RunPlan(tuple(ins.command.as_argv()), tuple(sorted(env.items())), stage.user,
                          stage.cwd())  # fmt: skip
            keyed_env = sorted((k, v) for k, v in env.items() if k not in proxies)
            material = {"op": "run", "argv": list(run.argv), "env": keyed_env,
                        "user": run.user, "cwd": run.cwd}  # fmt: skip
            steps.append(Step(number, ins.line, ins.raw.text, "run", material, run=run))
            workdir_pending = False
        elif isinstance(ins, Copy):
            plan = _copy_plan(ins, expander, stage.cwd())
            material = {
                "op": "add" if plan.add else "copy",
                "sources": list(plan.sources),
                "dest": plan.dest,
                "dest_is_dir": plan.dest_is_dir,
                "chown": plan.chown,
                "chmod": plan.chmod,
                "cwd": plan.cwd,
            }
            steps.append(Step(number, ins.line, ins.raw.text, "copy", material, copy=plan))
            workdir_pending = False
        elif isinstance(ins, Env):
            pairs = [(_expand(ins, expander, k), _expand(ins, expander, v)) for k, v in ins.pairs]
            for name, _ in pairs:
                if not name or "=" in name or "\0" in name:
                    raise _fail(ins, f"{name!r} is not a variable name")
            stage.env.update(pairs)
            config({"op": "env", "set": pairs})
        elif isinstance(ins, Arg):
            declared = []
            for name, default in ins.args:
                if name in build_args:
                    value: str | None = build_args[name]
                elif default is not None:
                    value = _expand(ins, expander, default)
                else:
                    value = stage.global_args.get(name)
                if value is not None:
                    stage.args[name] = value
                declared.append([name, value])
            config({"op": "arg", "args": declared})
        elif isinstance(ins, Label | Maintainer):
            if isinstance(ins, Maintainer):
                pairs = [("maintainer", ins.name)]
            else:
                pairs = [
                    (_expand(ins, expander, k), _expand(ins, expander, v)) for k, v in ins.pairs
                ]
            stage.labels.update(pairs)
            config({"op": "label", "set": pairs})
        elif isinstance(ins, Workdir):
            path = _expand(ins, expander, ins.path)
            if not path or "\0" in path:
                raise _fail(ins, f"{ins.path!r} expands to {path!r}, not a path")
            stage.workdir = posixpath.normpath(posixpath.join(stage.cwd(), path))
            if stage.workdir.startswith("//"):
                stage.workdir = "/" + stage.workdir.lstrip("/")
            workdir_pending = True
            config({"op": "workdir", "path": stage.workdir})
        elif isinstance(ins, User):
            user = _expand(ins, expander, ins.user)
            if not _USER.match(user):
                raise _fail(ins, f"{user!r} is not a user (name, uid, name:group or uid:gid)")
            stage.user = user
            config({"op": "user", "user": user})
        elif isinstance(ins, Expose):
            for port in _ports(ins, expander):
                if port not in stage.ports:
                    stage.ports.append(port)
            config({"op": "expose", "ports": sorted(stage.ports)})
        elif isinstance(ins, Cmd):
            stage.cmd = tuple(ins.command.as_argv())
            stage.cmd_set = True
            config({"op": "cmd", "argv": list(stage.cmd)})
        elif isinstance(ins, Entrypoint):
            stage.entrypoint = tuple(ins.command.as_argv())
            if not stage.cmd_set:
                stage.cmd = ()
            config({"op": "entrypoint", "argv": list(stage.entrypoint)})
        else:  # pragma: no cover - typed_all admits nothing else
            raise _fail(ins, "is not supported here")
    if workdir_pending and stage.workdir:
        last = steps[-1]
        steps.append(
            Step(len(steps) + 1, last.line, f"(create WORKDIR {stage.workdir})", "mkdir",
                 {"op": "mkdir", "path": stage.workdir}, path=stage.workdir)
        )  # fmt: skip
    cfg = ImageConfigPlan(
        env=tuple(stage.env.items()),
        working_dir=stage.workdir,
        user=stage.user,
        entrypoint=tuple(stage.entrypoint),
        cmd=tuple(stage.cmd),
        exposed_ports=tuple(sorted(stage.ports)),
        labels=tuple(sorted(stage.labels.items())),
    )
    return Plan(image, from_ins.line, tuple(steps), cfg, dict(build_args))


def _copy_plan(ins: Copy, expander: Expander, cwd: str) -> CopyPlan:
    sources = []
    for written in ins.sources:
        source = _expand(ins, expander, written)
        if _URL.match(source):
            if isinstance(ins, Add):
                raise _fail(
                    ins,
                    f"{source!r}: ADD from a URL is not supported: hutch builds without "
                    "fetching remote files (the host may be offline); download it into "
                    "the build context and ADD or COPY it from there",
                )
            raise _fail(ins, f"{source!r}: COPY reads the build context, not URLs")
        sources.append(_context_path(ins, source))
    dest = _expand(ins, expander, ins.dest)
    if not dest or "\0" in dest:
        raise _fail(ins, f"destination {ins.dest!r} expands to {dest!r}, not a path")
    dest_is_dir = dest.endswith("/") or dest in (".", "..") or dest.endswith(("/.", "/.."))
    if len(sources) > 1 and not dest_is_dir:
        raise _fail(
            ins,
            f"with more than one source the destination must be a directory ending in / "
            f"(write {dest}/)",
        )
    absolute = posixpath.normpath(posixpath.join(cwd, dest))
    if absolute.startswith("//"):
        absolute = "/" + absolute.lstrip("/")
    chown = _expand(ins, expander, ins.chown) if ins.chown is not None else None
    if chown is not None and not _USER.match(chown):
        raise _fail(ins, f"--chown={chown}: give user, uid, user:group or uid:gid")
    chmod: int | None = None
    if ins.chmod is not None:
        mode = _expand(ins, expander, ins.chmod)
        if not _OCTAL.match(mode):
            raise _fail(ins, f"--chmod={mode}: only octal modes (644, 0755) are supported")
        chmod = int(mode, 8)
    return CopyPlan(
        add=isinstance(ins, Add),
        sources=tuple(sources),
        dest=absolute,
        dest_is_dir=dest_is_dir,
        chown=chown,
        chmod=chmod,
        cwd=cwd,
    )
