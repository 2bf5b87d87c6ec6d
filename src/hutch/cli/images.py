"""``hutch images`` (via the daemon) and ``hutch image build`` (local, by design: it is
the host side that produces what the daemon boots)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hutch.cli._env import get_env, print_table, stderr_console
from hutch.cli._output import human_bytes, print_json

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
    for column in ("NAME", "BUILT", "SIZE", "DIGEST", "KERNEL", "DESCRIPTION"):
        table.add_column(column, no_wrap=True)
    for i in found:
        table.add_row(
            i.name,
            "yes" if i.built else "no",
            human_bytes(i.size_bytes),
            (i.digest or "-")[:12],
            i.kernel_release or "-",
            i.description,
        )
    print_table(table)


@click.group()
def image() -> None:
    """Build images on this host."""


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
