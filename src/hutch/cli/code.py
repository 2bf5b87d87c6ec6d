"""``hutch run-code ID CODE``: run Python in a code-interpreter context and print what
it produced (stdout, stderr, the last expression; images saved with --save-images)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import click

from hutch.cli._env import get_env
from hutch.cli._output import print_json
from hutch.sdk import Context, Contexts, Result

__all__ = ["run_code"]

_IMAGE_SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg", "image/svg+xml": ".svg"}


class _Images:
    """Saves every image a run produces as DIR/output-N.ext."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.saved: list[Path] = []

    def save(self, result: Result) -> list[Path]:
        if self.directory is None:
            return []
        paths = []
        for mime, suffix in _IMAGE_SUFFIXES.items():
            value = result.data.get(mime)
            if not isinstance(value, str):
                continue
            data = value.encode() if mime == "image/svg+xml" else base64.b64decode(value)
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"output-{len(self.saved) + 1}{suffix}"
            path.write_bytes(data)
            self.saved.append(path)
            paths.append(path)
        return paths


@click.command("run-code")
@click.argument("sandbox_id", metavar="ID")
@click.argument("code")
@click.option(
    "--context",
    "context_id",
    metavar="CID",
    help="Run in this context (its variables persist); default: a new one, deleted after.",
)
@click.option("--timeout", "timeout_s", type=float, help="Interrupt the code after this long.")
@click.option(
    "--save-images",
    type=click.Path(file_okay=False, path_type=Path),
    help="Save PNG/JPEG/SVG outputs (plots) into this directory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def run_code(
    sandbox_id: str,
    code: str,
    context_id: str | None,
    timeout_s: float | None,
    save_images: Path | None,
    as_json: bool,
) -> None:
    """Run Python CODE (`-` reads it from stdin) in a sandbox's code interpreter.

    Output streams as it is produced; the value of the last expression is printed at
    the end. Exit status 1 if the code raised (the traceback goes to stderr).
    """
    if code == "-":
        code = sys.stdin.read()
    client = get_env().client()
    contexts = Contexts(client, sandbox_id)
    temporary = context_id is None
    ctx: Context = contexts.create() if context_id is None else contexts.get(context_id)
    images = _Images(save_images)
    try:
        if as_json:
            execution = ctx.run(code, timeout_s=timeout_s)
            for result in execution.results:
                images.save(result)
            out = execution.to_dict()
            out["context"] = ctx.id
            out["saved_images"] = [str(p) for p in images.saved]
            print_json(out)
        else:

            def on_result(result: Result) -> None:
                for path in images.save(result):
                    click.echo(f"[image saved: {path}]", err=True)
                # A plot's text/plain is a repr like <Figure ...>: show only the saved path.
                is_image = bool(set(result.data) & set(_IMAGE_SUFFIXES))
                if result.text is not None and (result.is_main_result or not is_image):
                    click.echo(result.text)

            execution = ctx.run(
                code,
                timeout_s=timeout_s,
                on_stdout=lambda text: click.echo(text, nl=False),
                on_stderr=lambda text: click.echo(text, nl=False, err=True),
                on_result=on_result,
            )
            if execution.error is not None:
                click.echo(execution.error.traceback_text, err=True)
    finally:
        if temporary:
            ctx.delete()
    if execution.error is not None:
        raise click.exceptions.Exit(1)
