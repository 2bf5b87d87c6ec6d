"""What every command shares: the connection settings and one SDK client per run.

Tests drive the CLI without a daemon by passing ``obj=CliEnv(transport=...)`` to click's
``CliRunner.invoke``; nothing is patched.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field

import click
import httpx
from rich.console import Console
from rich.table import Table

from hutch.sdk import Client

__all__ = ["CliEnv", "get_env", "print_table", "spinner", "stderr_console"]


@dataclass
class CliEnv:
    url: str | None = None
    api_key: str | None = None
    #: The project requests act in (``--project``; else HUTCH_PROJECT, read by the SDK).
    project: str | None = None
    #: Replaces the network (tests). ``None``: talk to the daemon over HTTP.
    transport: httpx.BaseTransport | None = None
    _client: Client | None = field(default=None, repr=False)

    def client(self) -> Client:
        """The run's client, created on first use and closed when the command ends."""
        if self._client is None:
            self._client = Client(
                base_url=self.url,
                api_key=self.api_key,
                transport=self.transport,
                project=self.project,
            )
            click.get_current_context().call_on_close(self.close)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def get_env() -> CliEnv:
    return click.get_current_context().find_object(CliEnv) or CliEnv()


def print_table(table: Table) -> None:
    """A table for humans. Off a terminal: no colour, no width limit and no trailing
    blanks, so piped output stays one line per row for grep and awk."""
    console = Console(highlight=False)
    if console.is_terminal:
        console.print(table)
        return
    plain = Console(highlight=False, width=10_000, no_color=True, file=io.StringIO())
    with plain.capture() as captured:
        plain.print(table)
    for line in captured.get().splitlines():
        click.echo(line.rstrip())


def stderr_console() -> Console:
    """Spinners and progress bars go here, and only when it is a terminal."""
    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def spinner(text: str) -> Iterator[None]:
    """A spinner with ``text`` on stderr while a long call runs, only on a terminal:
    piped or logged output stays exactly what the command prints."""
    console = stderr_console()
    if not console.is_terminal:
        yield
        return
    with console.status(text):
        yield
