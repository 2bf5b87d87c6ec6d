"""``hutch images``, ``hutch image import|pull|rm`` and ``hutch image build NAME -f
Dockerfile [CONTEXT]`` (via the daemon), and ``hutch image build [base|devbox]`` (a
built-in image, local by design: it is the host side that produces what the daemon
boots). The two builds are told apart by ``-f``/CONTEXT: without either, NAME must be a
built-in image."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hutch.cli._env import get_env, print_table, stderr_console
from hutch.cli._output import human_bytes, print_json
from hutch.sdk import BuildEvent, ImageInfo, ImageProgress

__all__ = ["image", "images"]


def _bar_columns() -> tuple[TextColumn | BarColumn | TimeElapsedColumn, ...]:
    """The progress bar of an image build, import or pull."""
    return (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def images(as_json: bool) -> None:
    """List the built-in images and the project's own (the admin key: every project's)."""
    found = get_env().client().list_images()
    if as_json:
        print_json([i.to_dict() for i in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "PROJECT", "BUILT", "SIZE", "DIGEST", "KERNEL", "SOURCE", "DESCRIPTION"):
        table.add_column(column, no_wrap=True)
    for i in found:
        table.add_row(
            i.name,
            i.project or "(built-in)",
            "yes" if i.built else "no",
            human_bytes(i.size_bytes),
            (i.digest or "-").removeprefix("sha256:")[:12],
            i.kernel_release or "-",
            _source(i.source),
            i.description,
        )
    print_table(table)


def _source(source: dict[str, object]) -> str:
    kind = str(source.get("type", "builtin"))
    if kind == "registry":
        return str(source.get("ref"))
    if kind == "archive":
        return f"{source.get('format')}:{source.get('filename') or '-'}"
    return kind


@click.group()
def image() -> None:
    """Build, import, pull and delete images."""


@contextlib.contextmanager
def _build_progress(name: str) -> Iterator[Callable[[str, float | None], None]]:
    """A progress callback ``(stage, fraction)``: a bar on a terminal, else one line per
    stage on stderr (so logs of unattended builds still show where it is)."""
    console = stderr_console()
    if not console.is_terminal:
        last: list[str] = []

        def plain(stage: str, fraction: float | None) -> None:
            if not last or last[-1] != stage:
                last.append(stage)
                click.echo(f"building {name}: {stage}", err=True)

        yield plain
        return
    columns = _bar_columns()
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"{name}: starting", total=1.0)

        def bar(stage: str, fraction: float | None) -> None:
            progress.update(
                task,
                description=f"{name}: {stage}",
                completed=fraction if fraction is not None else None,
            )

        yield bar


@image.command("build")
@click.argument("name", required=False)
@click.argument(
    "context", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path)
)
@click.option(
    "-f",
    "--file",
    "dockerfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Build NAME from this Dockerfile (default CONTEXT/Dockerfile), on the daemon.",
)
@click.option(
    "--build-arg",
    "build_args",
    multiple=True,
    metavar="NAME=VALUE",
    help="A value for an ARG of the Dockerfile (repeat it).",
)
@click.option(
    "--egress",
    multiple=True,
    metavar="RULE",
    help="Egress rule of the build sandbox that runs RUN (repeat it; none: open).",
)
@click.option(
    "--network",
    type=click.Choice(["default", "none"]),
    default=None,
    help="The build sandbox's network.",
)
@click.option("--vcpus", type=int, default=None, help="The build sandbox's vCPUs.")
@click.option(
    "--memory", "memory_mib", type=int, default=None, help="The build sandbox's memory, MiB."
)
@click.option(
    "--disk",
    "disk_gib",
    type=int,
    default=None,
    help="The build sandbox's disk, GiB (sandboxes of the image need at least it).",
)
@click.option(
    "--timeout", "timeout_s", type=int, default=None, help="Seconds the whole build may take."
)
@click.option("--no-cache", is_flag=True, help="Run every Dockerfile step again.")
@click.option("--start", is_flag=True, help="Run the image's Entrypoint + Cmd at boot.")
@click.option("--quiet", "-q", is_flag=True, help="Do not print RUN output.")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
@click.option("--force", is_flag=True, help="Built-in images: rebuild every layer.")
def build(
    name: str | None,
    context: Path | None,
    dockerfile: Path | None,
    build_args: tuple[str, ...],
    egress: tuple[str, ...],
    network: str | None,
    vcpus: int | None,
    memory_mib: int | None,
    disk_gib: int | None,
    timeout_s: int | None,
    no_cache: bool,
    start: bool,
    quiet: bool,
    as_json: bool,
    force: bool,
) -> None:
    """Build an image.

    \b
    hutch image build [base|devbox] [--force]
        a built-in image, locally into the state dir (default: the configured one);
    hutch image build NAME -f Dockerfile [CONTEXT]
    hutch image build NAME CONTEXT
        image NAME from a Dockerfile, on the daemon: RUN steps run in a sandbox VM, each
        step is cached by its inputs (CONTEXT defaults to ".", the Dockerfile to
        CONTEXT/Dockerfile; .dockerignore leaves files out).
    """
    if dockerfile is None and context is None:
        extra = {"--build-arg": build_args, "--egress": egress, "--network": network,
                 "--vcpus": vcpus, "--memory": memory_mib, "--disk": disk_gib,
                 "--timeout": timeout_s, "--no-cache": no_cache, "--start": start,
                 "--quiet": quiet, "--json": as_json}  # fmt: skip
        given = [flag for flag, value in extra.items() if value]
        if given:
            raise click.UsageError(
                f"{', '.join(given)} apply to Dockerfile builds: give -f Dockerfile and/or "
                "a CONTEXT directory"
            )
        _build_builtin(name, force)
        return
    if name is None:
        raise click.UsageError("a Dockerfile build needs the new image's NAME")
    if force:
        raise click.UsageError(
            "--force is for built-in images; a Dockerfile build takes --no-cache"
        )
    args: dict[str, str] = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--build-arg {item!r} is not NAME=VALUE")
        args[key] = value
    with _dockerfile_progress(name, quiet) as progress:
        info = (
            get_env()
            .client()
            .build_image(
                name,
                context or Path("."),
                dockerfile=dockerfile,
                build_args=args,
                egress=list(egress) or None,
                network=network,
                vcpus=vcpus,
                memory_mib=memory_mib,
                disk_gib=disk_gib,
                timeout_s=timeout_s,
                no_cache=no_cache,
                start=start,
                on_progress=progress,
            )
        )
    _print_image(info, as_json)


def _build_builtin(name: str | None, force: bool) -> None:
    # Imported here: only this command needs the builder, and it runs host tools.
    from hutch.config import load_settings
    from hutch.images.build import build_image
    from hutch.images.catalog import IMAGES

    settings = load_settings()
    target = name or settings.default_image
    if target not in IMAGES:
        raise click.UsageError(
            f"{target!r} is not a built-in image ({', '.join(sorted(IMAGES))}); to build it "
            f"from a Dockerfile: hutch image build {target} -f Dockerfile [CONTEXT]"
        )
    with _build_progress(target) as progress:
        artifacts = build_image(target, settings.images_dir, progress=progress, force=force)
    click.echo(f"{artifacts.name} {artifacts.digest} {artifacts.rootfs.parent}")


@contextlib.contextmanager
def _dockerfile_progress(name: str, quiet: bool) -> Iterator[Callable[[BuildEvent], None]]:
    """A build's log on stderr, ``docker build`` style: each step as it starts or is
    reused, RUN output as it comes (unless ``quiet``), the time each step took."""

    def show(e: BuildEvent) -> None:
        if e.type == "status":
            click.echo(f"{name}: {e.message}", err=True)
        elif e.type == "output":
            if not quiet and e.data:
                click.echo(e.data, err=True, nl=False)
        elif e.state in ("running", "config") or (e.state == "done" and e.step == 1):
            click.echo(e.message, err=True)  # FROM (step 1) is done as it starts
        elif e.state == "cached":
            click.echo(f"{e.message}\n ---> cached", err=True)
        elif e.state == "done":
            click.echo(f" ---> done in {e.seconds or 0:.1f}s", err=True)

    yield show


@contextlib.contextmanager
def _import_progress(name: str) -> Iterator[Callable[[ImageProgress], None]]:
    """Layer by layer: a bar on a terminal, else one line per stage/layer on stderr."""
    console = stderr_console()
    if not console.is_terminal:
        seen: set[tuple[str, int | None]] = set()

        def plain(p: ImageProgress) -> None:
            key = (p.stage, p.layer)
            if key not in seen:
                seen.add(key)
                click.echo(f"{name}: {p.message}", err=True)

        yield plain
        return
    columns = _bar_columns()
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"{name}: starting", total=None)

        def update(p: ImageProgress) -> None:
            label = p.stage if p.layer is None else f"layer {p.layer}/{p.layers}"
            bar.update(task, description=f"{name}: {label}", total=p.total, completed=p.done)

        yield update


def _print_image(info: ImageInfo, as_json: bool) -> None:
    if as_json:
        print_json(info.to_dict())
    else:
        click.echo(f"{info.name} {info.digest} {human_bytes(info.size_bytes)}")


@image.command("import")
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--start", is_flag=True, help="Run the image's Entrypoint + Cmd at boot.")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
def import_cmd(name: str, path: Path, start: bool, as_json: bool) -> None:
    """Import PATH as image NAME: an oci-archive or docker-archive tar (`docker save`;
    gzip is fine) or an OCI image layout directory."""
    with _import_progress(name) as progress:
        info = get_env().client().import_image(name, path, start=start, on_progress=progress)
    _print_image(info, as_json)


@image.command("pull")
@click.argument("name")
@click.argument("ref")
@click.option("--username", "-u", help="Registry user (the password is read from stdin).")
@click.option("--password-stdin", is_flag=True, help="Read the registry password from stdin.")
@click.option("--token-stdin", is_flag=True, help="Read a registry bearer token from stdin.")
@click.option("--start", is_flag=True, help="Run the image's Entrypoint + Cmd at boot.")
@click.option("--json", "as_json", is_flag=True, help="Print the image as JSON.")
def pull_cmd(
    name: str,
    ref: str,
    username: str | None,
    password_stdin: bool,
    token_stdin: bool,
    start: bool,
    as_json: bool,
) -> None:
    """Pull REF ([registry[:port]/]repo[:tag][@sha256:...]) as image NAME. Registries on
    loopback are spoken to over HTTP, others over HTTPS; linux/amd64 is picked."""
    if password_stdin and token_stdin:
        raise click.UsageError("--password-stdin and --token-stdin exclude each other")
    if password_stdin and username is None:
        raise click.UsageError("--password-stdin needs --username")
    secret = sys.stdin.read().strip() if password_stdin or token_stdin else None
    if username is not None and not password_stdin:
        raise click.UsageError("--username needs --password-stdin (no passwords in argv)")
    with _import_progress(name) as progress:
        info = (
            get_env()
            .client()
            .pull_image(
                name,
                ref,
                username=username,
                password=secret if password_stdin else None,
                token=secret if token_stdin else None,
                start=start,
                on_progress=progress,
            )
        )
    _print_image(info, as_json)


@image.command("rm")
@click.argument("names", nargs=-1, required=True)
def rm_cmd(names: tuple[str, ...]) -> None:
    """Delete imported images (refused while a sandbox or snapshot uses one)."""
    client = get_env().client()
    for name in names:
        client.delete_image(name)
        click.echo(name)
