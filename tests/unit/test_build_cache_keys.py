"""Step cache keys of Dockerfile builds (``image_builder.step_keys``): a rebuild re-runs
only from the first changed step, because each key covers the key before it and what
the step does (expanded), plus, for COPY/ADD, the digest of the files it copies."""

from __future__ import annotations

from hutch.images.dockerfile import BaseConfig, evaluate, parse, typed_all
from hutch.services.image_builder import root_key, step_keys

BASE = BaseConfig(env=(("PATH", "/usr/bin:/bin"),))
DOCKERFILE = """\
FROM base
ARG VERSION=1
ENV APP=/app
WORKDIR $APP
COPY src/ ./src/
RUN echo build $VERSION > out.txt
USER app
RUN echo as app
CMD ["python3", "main.py"]
"""


def keys(text: str, files: dict[int, str] | None = None, args: dict[str, str] | None = None,
         base: str = "sha256:aa", salt: str | None = None) -> list[str]:  # fmt: skip
    plan = evaluate(typed_all(parse(text)), args or {}, BASE)
    digests = files if files is not None else {5: "files-v1"}
    found = step_keys(root_key(base), plan, digests, salt)
    return [found[s.number] for s in plan.steps]


def first_change(a: list[str], b: list[str]) -> int:
    assert len(a) == len(b)
    changed = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert changed, "nothing changed"
    # From the first changed step on, every key is new (none is reused by accident).
    assert changed == list(range(changed[0], len(a))), changed
    return changed[0] + 1  # the step number (FROM is 1)


def test_the_same_inputs_give_the_same_keys() -> None:
    one = keys(DOCKERFILE)
    assert one == keys(DOCKERFILE) and len(set(one)) == len(one)


def test_changing_one_run_changes_it_and_what_follows() -> None:
    changed = DOCKERFILE.replace("RUN echo as app", "RUN echo as app again")
    assert first_change(keys(DOCKERFILE), keys(changed)) == 8


def test_a_changed_file_changes_its_copy_step_only_from_there() -> None:
    assert first_change(keys(DOCKERFILE), keys(DOCKERFILE, {5: "files-v2"})) == 5


def test_a_build_arg_changes_the_steps_from_its_declaration() -> None:
    # ARG VERSION is step 2: its value is part of that step, so everything after it moves.
    assert first_change(keys(DOCKERFILE), keys(DOCKERFILE, args={"VERSION": "2"})) == 2


def test_config_steps_are_in_the_chain() -> None:
    # ENV is not a layer, but it reaches the RUN steps after it: their keys change.
    changed = DOCKERFILE.replace("ENV APP=/app", "ENV APP=/srv")
    assert first_change(keys(DOCKERFILE), keys(changed)) == 3
    # A CMD change (the last step) changes only the last key.
    cmd = DOCKERFILE.replace('"main.py"', '"other.py"')
    assert first_change(keys(DOCKERFILE), keys(cmd)) == 9


def test_another_base_changes_every_key() -> None:
    assert first_change(keys(DOCKERFILE), keys(DOCKERFILE, base="sha256:bb")) == 1


def test_no_cache_salts_every_step_after_from() -> None:
    plain, salted = keys(DOCKERFILE), keys(DOCKERFILE, salt="build-1")
    assert salted[0] == plain[0]
    assert first_change(plain, salted) == 2
    assert keys(DOCKERFILE, salt="build-2")[1:] != salted[1:]


def test_comments_and_continuation_lines_do_not_change_a_key() -> None:
    # The key covers what the step does once parsed, not where it is written.
    spaced = DOCKERFILE.replace("RUN echo as app", "# a comment\nRUN \\\n  echo as app")
    assert keys(spaced) == keys(DOCKERFILE)
