"""The Dockerfile parser, lexer and planner (pure): every form hutch builds, line
continuations, comments and directives, escapes, and ARG/ENV expansion as Docker
(BuildKit) does it; and everything refused, with its line."""

from __future__ import annotations

import pytest

from hutch.errors import InvalidArgument, InvalidDockerfile
from hutch.images.dockerfile import (
    DEFAULT_PATH,
    BaseConfig,
    Expander,
    ExpansionError,
    Plan,
    evaluate,
    parse,
    split_words,
    typed_all,
)


def plan_of(text: str, args: dict[str, str] | None = None, base: BaseConfig | None = None) -> Plan:
    df = parse(text)
    return evaluate(typed_all(df), args or {}, base or BaseConfig(), df.escape)


def step(plan: Plan, keyword: str, nth: int = 0) -> object:
    found = [s for s in plan.steps if s.text.split()[0] == keyword]
    return found[nth]


# -- the lexer ---------------------------------------------------------------------------

ENV = {"A": "apple", "SP": "two words", "E": ""}


@pytest.mark.parametrize(
    ("word", "want"),
    [
        ("$A", "apple"),
        ("${A}", "apple"),
        ("x${A}y", "xappley"),
        ("$A.txt", "apple.txt"),
        ("$A_x", ""),  # the name is A_x, unset
        ("${B}", ""),
        ("${B:-def}", "def"),
        ("${E:-def}", "def"),  # :- also when empty
        ("${E-def}", ""),  # - only when unset
        ("${B-def}", "def"),
        ("${A:+alt}", "alt"),
        ("${E:+alt}", ""),
        ("${E+alt}", "alt"),  # + when set, even empty
        ("${B+alt}", ""),
        ("${B:-${A}}", "apple"),  # nested
        ("${B:-'$A'}", "$A"),  # quotes inside the word
        ("'$A'", "$A"),  # single quotes keep everything
        ('"$A"', "apple"),
        ('"${A} and $A"', "apple and apple"),
        ("\\$A", "$A"),  # an escaped dollar
        ('"\\$A"', "$A"),
        ('"a\\zb"', "a\\zb"),  # inside double quotes \ escapes only " $ \
        ('"say \\"hi\\""', 'say "hi"'),
        ("a\\ b", "a b"),  # outside quotes \ escapes anything
        ("it''s", "its"),
        ("$", "$"),
        ("a$", "a$"),
        ("$1", ""),  # positional parameters are names too (unset)
        ("$$", ""),
        ("trailing\\", "trailing"),
    ],
)
def test_expansion_as_docker(word: str, want: str) -> None:
    assert Expander(ENV).word(word) == want


def test_the_backtick_escape() -> None:
    assert Expander(ENV, escape="`").word("`$A") == "$A"
    assert Expander(ENV, escape="`").word("C:\\dir\\$A") == "C:\\dir\\apple"


@pytest.mark.parametrize(
    ("word", "error"),
    [
        ("'open", "matching '"),
        ('"open', 'matching "'),
        ("${A", "missing"),
        ("${}", "bad substitution"),
        ("${:x}", "bad substitution"),
        ("${A#x}", "unsupported substitution"),
        ("${B:?must be set}", "B: must be set"),
        ("${E:?}", "E: is not allowed to be empty"),
        ("${B?}", "B: is not allowed to be unset"),
    ],
)
def test_expansion_errors(word: str, error: str) -> None:
    with pytest.raises(ExpansionError, match=error):
        Expander(ENV).word(word)


def test_words_split_unquoted_expansions_only() -> None:
    assert Expander(ENV).words("$SP x") == ["two", "words", "x"]
    assert Expander(ENV).words('"$SP" x') == ["two words", "x"]
    assert Expander(ENV).words("a\\ b") == ["a b"]


def test_split_words_keeps_quotes_for_later() -> None:
    assert split_words('a="b c" d=e\\ f  g=\'h i\' ""') == [
        'a="b c"',
        "d=e\\ f",
        "g='h i'",
        '""',
    ]


# -- the parser ----------------------------------------------------------------------------


def test_lines_continuations_comments_and_directives() -> None:
    df = parse(
        "# syntax=docker/dockerfile:1.7\n"
        "# escape=\\\n"
        "\n"
        "# a comment\n"
        "FROM base\n"
        "RUN echo one && \\\n"
        "    # a comment inside\n"
        "\n"
        "    echo two\n"
        "  run   lower-case keyword\r\n"
        "ENV A=1 \\  \n"
        "    B=2\n"
    )
    assert df.syntax == "docker/dockerfile:1.7" and df.escape == "\\"
    got = [(r.keyword, r.line, r.end_line, r.args) for r in df.instructions]
    assert got == [
        ("FROM", 5, 5, "base"),
        ("RUN", 6, 9, "echo one &&     echo two"),
        ("RUN", 10, 10, "lower-case keyword"),
        ("ENV", 11, 12, "A=1     B=2"),
    ]


def test_the_escape_directive_changes_continuations_and_escapes() -> None:
    df = parse("# escape=`\nFROM base\nRUN dir C:\\ `\n  /s\nENV P=C:\\path\n")
    assert df.escape == "`"
    assert [r.args for r in df.instructions][1] == "dir C:\\   /s"
    plan = evaluate(typed_all(df), {}, BaseConfig(), df.escape)
    assert ("P", "C:\\path") in plan.config.env


def test_directives_only_at_the_top() -> None:
    df = parse("FROM base\n# escape=`\nRUN a \\\n b\n")
    assert df.escape == "\\" and df.instructions[1].args == "a  b"
    with pytest.raises(InvalidDockerfile, match="line 1: invalid escape token"):
        parse("# escape=x\nFROM base\n")
    with pytest.raises(InvalidDockerfile, match="line 2: only one escape"):
        parse("# escape=`\n# escape=\\\nFROM base\n")
    with pytest.raises(
        InvalidDockerfile, match=r"line 1: # syntax=example\.com/other:1 names a BuildKit frontend"
    ):
        parse("# syntax=example.com/other:1\nFROM base\n")


def test_flags_are_taken_off_the_arguments() -> None:
    df = parse('FROM base\nCOPY --chown="app:app" --chmod=0755 --link a b/\n')
    copy = df.instructions[1]
    assert [(f.name, f.value) for f in copy.flags] == [
        ("chown", "app:app"),
        ("chmod", "0755"),
        ("link", None),
    ]
    assert copy.args == "a b/"


def test_exec_and_shell_forms() -> None:
    plan = plan_of(
        'FROM base\nRUN ["echo", "exec form"]\nRUN echo "shell $HOME"\n'
        'RUN [not json\nCMD ["python3", "-m", "app"]\nENTRYPOINT run me\n'
    )
    runs = [s.run for s in plan.steps if s.run is not None]
    assert [r.argv for r in runs] == [
        ("echo", "exec form"),
        ("/bin/sh", "-c", 'echo "shell $HOME"'),  # RUN is not expanded by the builder
        ("/bin/sh", "-c", "[not json"),  # not a JSON array: the shell form, as in Docker
    ]
    assert plan.config.entrypoint == ("/bin/sh", "-c", "run me")
    assert plan.config.cmd == ("python3", "-m", "app")


def test_copy_and_add_forms() -> None:
    plan = plan_of(
        "FROM base\nWORKDIR /srv\n"
        'COPY a.txt .\nCOPY ["with space.txt", "/opt/x y/"]\nCOPY a b c/\n'
        "ADD --chown=1000:1000 --chmod=640 arch.tar.gz ./unpacked/\nCOPY one /file\n"
    )
    copies = [s.copy for s in plan.steps if s.copy is not None]
    assert [(c.sources, c.dest, c.dest_is_dir) for c in copies] == [
        (("a.txt",), "/srv", True),
        (("with space.txt",), "/opt/x y", True),
        (("a", "b"), "/srv/c", True),
        (("arch.tar.gz",), "/srv/unpacked", True),
        (("one",), "/file", False),
    ]
    add = copies[3]
    assert add.add and add.chown == "1000:1000" and add.chmod == 0o640


# -- ARG and ENV, as Docker scopes them ---------------------------------------------------


def test_env_forms_and_the_value_from_before_the_line() -> None:
    plan = plan_of(
        "FROM base\nENV A=hello\nENV A=bye B=$A\nENV LEGACY value with spaces $A\n"
        "ENV Q=\"quoted $A\" R='single $A' S=a\\ b\n"
    )
    env = dict(plan.config.env)
    assert env["A"] == "bye"
    assert env["B"] == "hello"  # expanded with the value before this line
    assert env["LEGACY"] == "value with spaces bye"
    assert (env["Q"], env["R"], env["S"]) == ("quoted bye", "single $A", "a b")


def test_base_env_and_default_path() -> None:
    plan = plan_of("FROM base\nENV PATH=/opt/bin:$PATH\n")
    assert dict(plan.config.env)["PATH"] == f"/opt/bin:{DEFAULT_PATH}"
    base = BaseConfig(env=(("PATH", "/bin"), ("LANG", "C.UTF-8")))
    plan = plan_of("FROM base\nENV PATH=/x:$PATH\n", base=base)
    assert dict(plan.config.env) == {"PATH": "/x:/bin", "LANG": "C.UTF-8"}


def test_args_defaults_build_args_and_env_winning() -> None:
    text = (
        "ARG TAG=v1\nFROM app:$TAG\n"
        "ARG WHO=world\nARG TAG\n"  # TAG again: the global value comes into the stage
        "ENV GREETING=hello-$WHO\nARG GREETING=from-arg\n"
        "RUN echo $GREETING\nLABEL tag=$TAG who=${WHO:-nobody}\n"
    )
    plan = plan_of(text)
    assert plan.base == "app:v1"
    env = dict(plan.config.env)
    assert env["GREETING"] == "hello-world"
    assert "WHO" not in env and "TAG" not in env  # ARGs are not kept in the image
    run = step(plan, "RUN").run  # type: ignore[attr-defined]
    assert dict(run.env)["WHO"] == "world"
    assert dict(run.env)["GREETING"] == "hello-world"  # ENV wins over the ARG
    assert dict(plan.config.labels) == {"tag": "v1", "who": "world"}

    plan = plan_of(text, {"TAG": "v2", "WHO": "you"})
    assert plan.base == "app:v2"
    assert dict(plan.config.env)["GREETING"] == "hello-you"


def test_global_args_reach_only_the_from_line_unless_declared_again() -> None:
    plan = plan_of("ARG V=1\nFROM base\nLABEL v=${V:-unset}\n")
    assert dict(plan.config.labels) == {"v": "unset"}


def test_an_arg_changes_the_keys_of_the_steps_after_it() -> None:
    text = "FROM base\nARG V=1\nRUN true\n"
    a, b = plan_of(text), plan_of(text, {"V": "2"})
    assert step(a, "RUN").material != step(b, "RUN").material  # type: ignore[attr-defined]


def test_proxy_args_need_no_declaration_and_stay_out_of_keys() -> None:
    a = plan_of("FROM base\nRUN true\n", {"HTTP_PROXY": "http://p:3128"})
    b = plan_of("FROM base\nRUN true\n")
    run = step(a, "RUN")
    assert dict(run.run.env)["HTTP_PROXY"] == "http://p:3128"  # type: ignore[attr-defined]
    assert run.material == step(b, "RUN").material  # type: ignore[attr-defined]
    assert "HTTP_PROXY" not in dict(a.config.env)


def test_platform_args_have_amd64_values() -> None:
    plan = plan_of("FROM base\nARG TARGETARCH\nLABEL arch=$TARGETARCH\n")
    assert dict(plan.config.labels) == {"arch": "amd64"}


def test_unknown_build_args_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"build arg NOPE is not declared .*declared: V"):
        plan_of("FROM base\nARG V\n", {"NOPE": "1"})


# -- config instructions ------------------------------------------------------------------


def test_workdir_user_expose_label_cmd_entrypoint() -> None:
    plan = plan_of(
        "FROM base\nENV D=/srv\nWORKDIR $D\nWORKDIR app\nWORKDIR ../other/./x\n"
        "USER app:staff\nEXPOSE 80 53/UDP 8000-8002/tcp\nLABEL a=1 'b c'=\"d e\"\n"
        "MAINTAINER someone\nCMD python3 app.py\n"
    )
    cfg = plan.config
    assert cfg.working_dir == "/srv/other/x"
    assert cfg.user == "app:staff"
    assert cfg.exposed_ports == ("53/udp", "80/tcp", "8000/tcp", "8001/tcp", "8002/tcp")
    assert dict(cfg.labels) == {"a": "1", "b c": "d e", "maintainer": "someone"}
    assert cfg.cmd == ("/bin/sh", "-c", "python3 app.py")
    # WORKDIR after the last filesystem step: a step creates it.
    assert plan.steps[-1].kind == "mkdir" and plan.steps[-1].path == "/srv/other/x"


def test_entrypoint_resets_an_inherited_cmd() -> None:
    base = BaseConfig(cmd=("bash",))
    assert plan_of('FROM base\nENTRYPOINT ["x"]\n', base=base).config.cmd == ()
    plan = plan_of('FROM base\nCMD ["y"]\nENTRYPOINT ["x"]\n', base=base)
    assert plan.config.cmd == ("y",)
    assert plan_of("FROM base\n", base=base).config.cmd == ("bash",)


def test_steps_and_the_files_they_change() -> None:
    plan = plan_of("FROM base\nENV A=1\nWORKDIR /app\nCOPY . .\nRUN make\nUSER app\n")
    assert [s.kind for s in plan.steps] == ["from", "config", "config", "copy", "run", "config"]
    assert [s.number for s in plan.steps] == [1, 2, 3, 4, 5, 6]
    assert [s.line for s in plan.steps] == [1, 2, 3, 4, 5, 6]
    run = plan.steps[4].run
    assert run is not None and run.cwd == "/app" and run.user is None


# -- refused, with the line ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("FROM base\nHEALTHCHECK CMD true\n", r"line 2: HEALTHCHECK is not supported"),
        ("FROM base\nONBUILD RUN x\n", r"line 2: ONBUILD is not supported"),
        ("FROM base\nSTOPSIGNAL 9\n", r"line 2: STOPSIGNAL is not supported"),
        ('FROM base\nSHELL ["bash", "-c"]\n', r"line 2: SHELL is not supported"),
        ("FROM base\nVOLUME /data\n", r"line 2: VOLUME is not supported"),
        ("FROM base\n\nFROB x\n", r"line 3: unknown instruction FROB; hutch builds FROM, RUN"),
        ("FROM base\nRUN --mount=type=cache,target=/c make\n", r"line 2: RUN: RUN --mount"),
        ("FROM base\nCOPY --from=build /a /b\n", r"line 2: COPY: COPY --from"),
        ("FROM base\nADD --checksum=sha256:00 x y\n", r"line 2: ADD: ADD --checksum"),
        ("FROM base\nCOPY --nope a b\n", r"--nope is not a flag of COPY; it takes --chown"),
        ("FROM base\nRUN <<EOF\necho\nEOF\n", r"line 2: RUN: heredocs"),
        ("FROM a\nFROM b\n", r"line 2: a second FROM"),
        ("RUN x\nFROM base\n", r"line 1: RUN before FROM"),
        ("ARG X\n", r"no FROM"),
        ("FROM base\nCOPY onlyone\n", r"line 2: COPY: needs at least a source"),
        ("FROM base\nCOPY a b c\n", r"destination must be a directory ending in /"),
        ("FROM base\nCOPY ../secret /x\n", r"line 2: COPY: source '../secret' is outside"),
        ("FROM base\nADD https://example.com/x.tgz /x\n", r"line 2: ADD: .*not supported"),
        ("FROM base\nCOPY http://example.com/x /x\n", r"COPY reads the build context"),
        ("FROM base\nCOPY --chmod=u+x a /a\n", r"only octal modes"),
        ("FROM base\nEXPOSE 99999\n", r"line 2: EXPOSE: '99999'"),
        ("FROM base\nEXPOSE 80/icmp\n", r"is not a port"),
        ("FROM base\nUSER\n", r"line 2: USER: needs a user"),
        ("FROM base\nENV ONLYNAME\n", r"'ONLYNAME' has no value"),
        ("FROM base\nENV a=1 b\n", r"can't find = in 'b'"),
        ("FROM base\nLABEL x=${Y:?needed}\n", r"line 2: LABEL: Y: needed"),
        ("FROM --platform=linux/arm64 base\n", r"linux/amd64 images only"),
        ("FROM base AS x y\n", r"takes an image, optionally followed by AS"),
        ("FROM base\nRUN a \\\n  b\nUSER ${\n", r"line 4: USER: syntax error"),
    ],
)
def test_refused_with_the_line(text: str, error: str) -> None:
    with pytest.raises(InvalidDockerfile, match=error):
        plan_of(text)


def test_the_refusal_lists_what_is_supported() -> None:
    with pytest.raises(InvalidDockerfile) as info:
        plan_of("FROM base\nHEALTHCHECK NONE\n")
    for kw in ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE",
               "LABEL", "CMD", "ENTRYPOINT"):  # fmt: skip
        assert kw in info.value.message


def test_a_continued_instruction_names_all_its_lines() -> None:
    with pytest.raises(InvalidDockerfile, match=r"lines 2-4: VOLUME"):
        plan_of("FROM base\nVOLUME \\\n  /a \\\n  /b\n")


def test_sizes_are_bounded() -> None:
    with pytest.raises(InvalidDockerfile, match="larger than"):
        parse("FROM base\n" + "# x\n" * 300_000)
    with pytest.raises(InvalidDockerfile, match="more than 1000 instructions"):
        parse("FROM base\n" + "ENV A=1\n" * 1001)
    with pytest.raises(InvalidDockerfile, match="NUL"):
        parse("FROM base\0\n")
