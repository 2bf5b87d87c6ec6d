"""Key and URL discovery, timeouts, the error-code map, and the public surface."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hutch
import hutch.sdk
from hutch import errors
from hutch.sdk import ApiKeyMissing, Client, Timeouts
from hutch.sdk._config import resolve_config
from hutch.sdk._errors import error_for, error_from_body
from hutch.testing import FakeHutch


def test_url_precedence() -> None:
    assert resolve_config(env={}).base_url == "http://127.0.0.1:7070"
    assert resolve_config(env={"HUTCH_URL": "http://h:1/"}).base_url == "http://h:1"
    assert resolve_config(base_url="http://a:2", env={"HUTCH_URL": "http://h:1"}).base_url == (
        "http://a:2"
    )
    with pytest.raises(errors.InvalidArgument, match="http://"):
        resolve_config(base_url="127.0.0.1:7070", env={})


def test_key_precedence(tmp_path: Path) -> None:
    (tmp_path / "api-key").write_text("from-file\n")
    env = {"HUTCH_STATE_DIR": str(tmp_path)}
    assert resolve_config(env=env).api_key == "from-file"
    assert resolve_config(env={**env, "HUTCH_API_KEY": "from-env"}).api_key == "from-env"
    assert resolve_config(api_key="arg", env={**env, "HUTCH_API_KEY": "e"}).api_key == "arg"


@pytest.mark.parametrize("key", ["k1 ", "k1\t", " k1", "k1\n"])
def test_a_key_with_surrounding_whitespace_is_refused(key: str) -> None:
    """The daemon compares keys exactly, and HTTP would drop whitespace around the
    header value: such a key is refused before anything is sent."""
    with pytest.raises(errors.InvalidArgument, match="HUTCH_API_KEY starts or ends"):
        resolve_config(env={"HUTCH_API_KEY": key})
    with pytest.raises(errors.InvalidArgument, match="api_key starts or ends"):
        resolve_config(api_key=key, env={})


def test_default_key_file_is_var_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "api-key").write_text("k1")
    assert resolve_config(env={}).api_key == "k1"


def test_missing_key_names_both_places(tmp_path: Path) -> None:
    config = resolve_config(env={"HUTCH_STATE_DIR": str(tmp_path)})
    assert config.api_key is None
    with pytest.raises(ApiKeyMissing) as info:
        config.require_key()
    assert "HUTCH_API_KEY" in str(info.value)
    assert str(tmp_path / "api-key") in str(info.value)
    assert isinstance(info.value, errors.Unauthorized)


def test_missing_key_fails_before_any_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HUTCH_API_KEY", raising=False)
    monkeypatch.setenv("HUTCH_STATE_DIR", str(tmp_path))
    fake = FakeHutch()
    with pytest.raises(ApiKeyMissing), hutch.Sandbox.create(transport=fake.transport):
        pass
    assert fake.requests == []


def test_unreadable_key_file(tmp_path: Path) -> None:
    (tmp_path / "api-key").mkdir()  # reading a directory fails with an OSError
    with pytest.raises(ApiKeyMissing, match="cannot read"):
        resolve_config(env={"HUTCH_STATE_DIR": str(tmp_path)})


def test_timeouts() -> None:
    assert Timeouts.coerce(None) == Timeouts()
    t = Timeouts.coerce(3)
    assert (t.connect, t.read, t.write, t.pool, t.create) == (3.0,) * 5
    assert Timeouts.coerce(t) is t
    with pytest.raises(errors.InvalidArgument):
        Timeouts.coerce(-1)
    fake = FakeHutch()
    with Client(
        api_key="test-key", timeout=Timeouts(connect=1, read=2), transport=fake.transport
    ) as c:
        c.list_sandboxes()
    assert fake.requests[-1].extensions["timeout"] == {
        "connect": 1,
        "read": 2,
        "write": 60.0,
        "pool": 10.0,
    }


@pytest.mark.parametrize("cls", errors.ALL_ERRORS, ids=lambda c: c.code)
def test_every_code_maps_back_to_its_class(cls: type[errors.HutchError]) -> None:
    body = json.dumps({"error": {"code": cls.code, "message": "the message"}}).encode()
    exc = error_from_body(500, body)
    assert type(exc) is cls
    assert str(exc) == "the message" and exc.message == "the message"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, errors.InvalidArgument),
        (401, errors.Unauthorized),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (422, errors.InvalidArgument),
        (429, errors.Capacity),
        (507, errors.Capacity),
        (503, errors.Unavailable),
        (504, errors.Timeout),
        (500, errors.HutchError),
        (502, errors.HutchError),
    ],
)
def test_unknown_codes_fall_back_on_status(status: int, cls: type[errors.HutchError]) -> None:
    exc = error_from_body(status, b'{"error": {"code": "brand_new", "message": "m"}}')
    assert type(exc) is cls and str(exc) == "m"
    bare = error_from_body(status, b"Bad Gateway")
    assert type(bare) is cls and str(bare) == f"HTTP {status}: Bad Gateway"


def test_state_error_keeps_the_server_message() -> None:
    exc = error_for("invalid_state", 409, "sandbox sb-1 is stopping; this needs running")
    assert isinstance(exc, errors.StateError)
    assert str(exc) == "sandbox sb-1 is stopping; this needs running"


def test_framework_detail_is_used_as_message() -> None:
    assert str(error_from_body(405, b'{"detail": "Method Not Allowed"}')) == "Method Not Allowed"


def test_public_surface() -> None:
    for name in hutch.__all__:
        assert getattr(hutch, name) is not None, name
    for name in hutch.sdk.__all__:
        assert getattr(hutch.sdk, name) is not None, name
    assert hutch.Sandbox is hutch.sdk.Sandbox
    assert hutch.__version__ == "0.1.0"
    assert set(hutch.__all__) <= set(dir(hutch))
    with pytest.raises(AttributeError):
        _ = hutch.NoSuchThing
    # Every error class of hutch.errors is exported from the package root.
    assert {c.__name__ for c in errors.ALL_ERRORS} <= set(hutch.__all__)
