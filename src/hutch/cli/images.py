"""``hutch images``, ``hutch image import|pull|rm`` (via the daemon) and
``hutch image build`` (local, by design: it is the host side that produces what the
daemon boots)."""

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
from hutch.sdk import ImageInfo, ImageProgress

__all__ = ["image", "images"]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def images(as_json: bool) -> None:
    """List the image catalog and what is built."""
    found = get_env().client().list_images()
    if as_json:
        print_json([i.to_dict() for i in found])
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for column in ("NAME", "BUILT", "SIZE", "DIGEST", "KERNEL", "SOURCE", "DESCRIPTION"):
        table.add_column(column, no_wrap=True)
    for i in found:
        table.add_row(
            i.name,
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
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
    )
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
@click.option("--force", is_flag=True, help="Rebuild every layer even when cached.")
def build(name: str | None, force: bool) -> None:
    """Build image NAME (default: the configured default image) into the state dir."""
    # Imported here: only this command needs the builder, and it runs host tools.
    from hutch.config import load_settings
    from hutch.images.build import build_image

    settings = load_settings()
    target = name or settings.default_image
    with _build_progress(target) as progress:
        artifacts = build_image(target, settings.images_dir, progress=progress, force=force)
    click.echo(f"{artifacts.name} {artifacts.digest} {artifacts.rootfs.parent}")


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
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
    )
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
