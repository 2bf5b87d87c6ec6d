"""`hutch secret set|ls|inspect|rm` and `create --env-secret`, through click's CliRunner
against the fake REST contract: values come from stdin, a file or an environment
variable (never argv), and no command prints one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hutch.cli._env import CliEnv
from hutch.cli.main import cli
from hutch.testing import FakeHutch
from tests.unit.conftest import inspect_rows, last

VALUE = "tok-0b5e1c7d9a3f"


def _run(fake: FakeHutch, *args: str, stdin: str | bytes | None = None, **env: str) -> Result:
    argv = ["--api-key", fake.api_key, *args]
    return CliRunner().invoke(cli, argv, obj=CliEnv(transport=fake.transport), input=stdin, env=env)


def test_set_reads_stdin_and_drops_one_trailing_newline(fake: FakeHutch) -> None:
    result = _run(fake, "secret", "set", "openai", stdin=VALUE + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "openai version 1\n"
    assert fake.secrets.values["openai"] == VALUE
    assert last(fake)[:2] == ("PUT", "/v1/secrets/openai")
    _run(fake, "secret", "set", "openai", stdin="two\n\n")
    assert fake.secrets.values["openai"] == "two\n"  # only one
    result = _run(fake, "secret", "set", "openai", "--keep-newline", stdin="three\r\n")
    assert result.stdout == "openai version 3\n"
    assert fake.secrets.values["openai"] == "three\r\n"


def test_set_from_a_file_or_an_environment_variable(fake: FakeHutch, tmp_path: Path) -> None:
    pem = tmp_path / "key.pem"
    pem.write_text("-----BEGIN KEY-----\nabc\n-----END KEY-----\n")
    assert _run(fake, "secret", "set", "pem", "--from-file", str(pem)).exit_code == 0
    assert fake.secrets.values["pem"] == "-----BEGIN KEY-----\nabc\n-----END KEY-----"
    result = _run(fake, "secret", "set", "tok", "--from-env", "MY_TOKEN", MY_TOKEN=VALUE)
    assert result.exit_code == 0, result.output
    assert fake.secrets.values["tok"] == VALUE
    result = _run(fake, "secret", "set", "tok", "--from-env", "UNSET_VAR_X")
    assert result.exit_code == 2 and "UNSET_VAR_X is not set" in result.output


def test_the_value_is_never_taken_from_argv(fake: FakeHutch) -> None:
    result = _run(fake, "secret", "set", "openai", VALUE)
    assert result.exit_code == 2
    assert "Got unexpected extra argument" in result.output
    assert fake.secrets.values == {}
    help_text = _run(fake, "secret", "set", "--help").output
    assert "never from the command line" in help_text


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (("bad name",), "v", "secret name 'bad name' is not valid; use 1-128 letters"),
        (("ok",), "", "1-65536 bytes of UTF-8 text; this one is 0 bytes"),
        (("ok",), b"\xff\xfe", "the value is not UTF-8 text (byte 0)"),
    ],
)
def test_bad_input_is_refused_with_what_is_accepted(
    fake: FakeHutch, args: tuple[str, ...], stdin: str | bytes, message: str
) -> None:
    result = _run(fake, "secret", "set", *args, stdin=stdin)
    assert result.exit_code != 0
    assert message in result.output
    assert fake.secrets.values == {}


def test_ls_inspect_rm_never_print_a_value(fake: FakeHutch) -> None:
    _run(fake, "secret", "set", "a", stdin=VALUE)
    _run(fake, "secret", "set", "a", stdin=VALUE + "2")
    ls = _run(fake, "secret", "ls")
    assert ls.exit_code == 0 and "a" in ls.stdout and VALUE not in ls.stdout
    listed: list[dict[str, Any]] = json.loads(_run(fake, "secret", "ls", "--json").stdout)
    assert [(s["name"], s["version"]) for s in listed] == [("a", 2)]
    assert "value" not in listed[0]
    shown = inspect_rows(_run(fake, "secret", "inspect", "a").stdout)
    assert (shown["name"], shown["version"]) == ("a", "2")
    assert VALUE not in json.dumps(shown)
    result = _run(fake, "secret", "rm", "a", "nope")
    assert result.exit_code == 1
    assert result.stdout == "a\n"
    assert "error: nope: no secret named 'nope'" in result.stderr


def test_create_env_secret_and_inspect_show_the_mapping(fake: FakeHutch) -> None:
    _run(fake, "secret", "set", "openai", stdin=VALUE)
    result = _run(fake, "create", "--env-secret", "OPENAI_API_KEY=openai")
    assert result.exit_code == 0, result.output
    assert last(fake)[2]["env_secrets"] == {"OPENAI_API_KEY": "openai"}
    shown = inspect_rows(_run(fake, "inspect", result.stdout.strip()).stdout)
    assert shown["env_secret.OPENAI_API_KEY"] == "openai"
    bad = _run(fake, "create", "--env-secret", "X=missing")
    assert bad.exit_code == 1
    assert "env_secrets['X'] names secret 'missing', which does not exist" in bad.stderr
    rm = _run(fake, "secret", "rm", "openai")
    assert rm.exit_code == 1 and "used by the env_secrets of sandbox" in rm.stderr
