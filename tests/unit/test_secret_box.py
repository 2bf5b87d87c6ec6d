"""The secrets' crypto envelope (services/secret_box.py) and the service on a real SQLite
store: values sealed with AES-256-GCM bound to project, name and version; tampered,
swapped and wrong-key rows fail loudly; nothing in the database is the value."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hutch.errors import Conflict, InvalidArgument, NotFound, SecretError
from hutch.models import SandboxRecord, SandboxState, Shape
from hutch.services.secret_box import SecretKey, associated_data, open_value, seal
from hutch.services.secrets import SecretService, references
from hutch.store import Store
from hutch.store.secrets import SealedValue, SecretStore

VALUE = "sk-test-7f3a9c1e5b2d4f60-do-not-leak"


@pytest.fixture
def key(tmp_path: Path) -> SecretKey:
    k = SecretKey(tmp_path / "secrets.key")
    k.create()
    return k


@pytest.fixture
def store(db_target: Path | str) -> Store:
    return Store(db_target)


@pytest.fixture
def service(store: Store, tmp_path: Path) -> SecretService:
    svc = SecretService(SecretStore(store), SecretKey(tmp_path / "secrets.key"))
    svc.prepare()
    return svc


# -- the envelope ----------------------------------------------------------------------


def test_a_sealed_value_opens_with_its_own_project_name_and_version(key: SecretKey) -> None:
    sealed = seal(key, "default", "openai", 3, VALUE.encode())
    assert VALUE.encode() not in sealed.ciphertext
    assert open_value(key, "default", "openai", 3, sealed) == VALUE.encode()


def test_every_seal_takes_a_fresh_nonce(key: SecretKey) -> None:
    one = seal(key, "default", "a", 1, b"same")
    two = seal(key, "default", "a", 1, b"same")
    assert len(one.nonce) == 12
    assert one.nonce != two.nonce
    assert one.ciphertext != two.ciphertext


def test_a_tampered_ciphertext_fails_authentication(key: SecretKey) -> None:
    sealed = seal(key, "default", "a", 1, VALUE.encode())
    flipped = bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
    with pytest.raises(SecretError, match="fails authentication"):
        open_value(key, "default", "a", 1, SealedValue(sealed.key_id, sealed.nonce, flipped))
    other_nonce = bytes([sealed.nonce[0] ^ 1]) + sealed.nonce[1:]
    with pytest.raises(SecretError, match="fails authentication"):
        open_value(
            key, "default", "a", 1, SealedValue(sealed.key_id, other_nonce, sealed.ciphertext)
        )


@pytest.mark.parametrize(
    ("project", "name", "version"),
    [("other", "a", 1), ("default", "b", 1), ("default", "a", 2)],
    ids=["another-project", "another-name", "another-version"],
)
def test_a_ciphertext_swapped_to_another_row_fails(
    key: SecretKey, project: str, name: str, version: int
) -> None:
    sealed = seal(key, "default", "a", 1, VALUE.encode())
    with pytest.raises(SecretError, match="fails authentication"):
        open_value(key, project, name, version, sealed)


def test_the_associated_data_cannot_be_confused_across_fields() -> None:
    assert associated_data("ab", "c", 1) != associated_data("a", "bc", 1)
    assert associated_data("a", "b", 12) != associated_data("a", "b1", 2)


def test_a_wrong_key_is_named_not_an_empty_value(key: SecretKey) -> None:
    sealed = seal(key, "default", "a", 1, VALUE.encode())
    key.path.unlink()
    key.create()  # another key under the same path
    with pytest.raises(SecretError, match=r"was sealed with key .* the key file was replaced"):
        open_value(key, "default", "a", 1, sealed)


def test_a_missing_key_file_is_named(key: SecretKey) -> None:
    sealed = seal(key, "default", "a", 1, VALUE.encode())
    key.path.unlink()
    with pytest.raises(SecretError, match=r"secrets.key is missing.*restore it"):
        open_value(key, "default", "a", 1, sealed)


def test_the_key_file_is_0600_and_never_overwritten(key: SecretKey) -> None:
    assert stat.S_IMODE(key.path.stat().st_mode) == 0o600
    before = key.path.read_bytes()
    with pytest.raises(SecretError, match="exists already"):
        key.create()
    assert key.path.read_bytes() == before
    assert [p.name for p in key.path.parent.iterdir()] == ["secrets.key"]  # no temp left


def test_a_key_file_open_to_others_is_refused(key: SecretKey) -> None:
    os.chmod(key.path, 0o644)
    with pytest.raises(SecretError, match=r"open to group or others \(mode 0644\).*chmod 600"):
        key.load()


def test_a_malformed_key_file_is_refused(key: SecretKey) -> None:
    key.path.write_text("not a key\n")
    with pytest.raises(SecretError, match="expected 64 hex characters"):
        key.load()


# -- the service on a real store -------------------------------------------------------


def test_put_creates_then_replaces_with_the_next_version(service: SecretService) -> None:
    service.clock = lambda: 100.0
    info, created = service.put("openai", VALUE)
    assert (info.name, info.version, info.created_at, created) == ("openai", 1, 100.0, True)
    service.clock = lambda: 200.0
    info, created = service.put("openai", VALUE + "-2")
    assert (info.version, info.created_at, info.updated_at, created) == (2, 100.0, 200.0, False)
    assert service.reveal("openai") == VALUE + "-2"
    assert [i.name for i in service.list()] == ["openai"]
    assert not hasattr(info, "value")


def test_secrets_are_per_project(service: SecretService) -> None:
    service.put("token", "for-a", project="a")
    service.put("token", "for-b", project="b")
    assert service.reveal("token", project="a") == "for-a"
    assert service.list(project="c") == []
    with pytest.raises(NotFound, match="no secret named 'token' in project 'c'"):
        service.get("token", project="c")


def test_the_database_never_holds_the_value(service: SecretService, store: Store) -> None:
    service.put("openai", VALUE)
    service.put("openai", VALUE + "-rotated")
    with store.transaction() as db:
        rows = db.execute("SELECT nonce, ciphertext, key_id, name FROM secrets").fetchall()
    assert rows and all(VALUE.encode() not in b"".join(_bytes(v) for v in r) for r in rows)
    if store.path is not None:  # SQLite: nor any page of the file or its WAL
        for path in (store.path, store.path.with_name(store.path.name + "-wal")):
            if path.exists():
                assert VALUE.encode() not in path.read_bytes(), path


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def test_rows_swapped_in_the_database_fail_authentication(
    service: SecretService, store: Store
) -> None:
    service.put("a", "value-of-a")
    service.put("b", "value-of-b")
    with store.transaction() as db:
        nonce, ct = db.execute("SELECT nonce, ciphertext FROM secrets WHERE name = 'a'").fetchone()
        db.execute("UPDATE secrets SET nonce = ?, ciphertext = ? WHERE name = 'b'", (nonce, ct))
    with pytest.raises(SecretError, match=r"secret 'b' \(version 1\).*fails authentication"):
        service.reveal("b")


def test_a_key_file_removed_later_is_never_recreated_over_sealed_secrets(
    service: SecretService,
) -> None:
    service.put("a", VALUE)
    service.key.path.unlink()
    service.prepare()  # a restart: logs the problem, creates nothing
    assert not service.key.path.exists()
    with pytest.raises(SecretError, match="is missing"):
        service.reveal("a")
    with pytest.raises(SecretError, match="is missing"):
        service.put("b", VALUE)


def test_the_first_start_creates_the_key(service: SecretService) -> None:
    assert stat.S_IMODE(service.key.path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("bad name", "v", r"secret name 'bad name' is not valid; use 1-128 letters, digits"),
        ("-x", "v", r"starting with a letter or digit"),
        ("x" * 129, "v", r"is not valid; use 1-128"),
        ("ok", "", r"1-65536 bytes of UTF-8 text; this one is 0 bytes"),
        ("ok", "é" * 40000, r"1-65536 bytes of UTF-8 text; this one is 80000 bytes"),
        ("ok", "a\0b", r"must not contain a NUL byte"),
        ("ok", "\ud800", r"lone surrogate"),
    ],
)
def test_bad_input_names_what_is_accepted_and_never_the_value(
    service: SecretService, name: str, value: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        service.put(name, value)
    if len(value) > 2:
        assert value not in info.value.message


def _sandbox(sid: str, state: SandboxState, env_secrets: dict[str, str]) -> SandboxRecord:
    return SandboxRecord(
        id=sid, image="base", state=state, shape=Shape(), created_at=1.0, env_secrets=env_secrets
    )


def test_delete_is_refused_while_a_live_sandbox_names_it(
    service: SecretService, store: Store
) -> None:
    service.put("a", VALUE)
    store.insert_sandbox(_sandbox("sb-000000000001", SandboxState.PAUSED, {"A": "a"}))
    store.insert_sandbox(_sandbox("sb-000000000002", SandboxState.DESTROYED, {"A": "a"}))
    with pytest.raises(Conflict, match=r"used by the env_secrets of sandbox.* sb-000000000001;"):
        service.delete("a")
    assert service.get("a").version == 1
    store.update_sandbox("sb-000000000001", state=SandboxState.DESTROYED)
    service.delete("a")
    with pytest.raises(NotFound):
        service.delete("a")


def test_env_for_reads_the_current_version_and_names_a_deleted_secret(
    service: SecretService,
) -> None:
    service.put("a", "one")
    assert service.env_for({"A": "a"}, sandbox_id="sb-x") == {"A": "one"}
    service.put("a", "two")
    assert service.env_for({"A": "a"}, sandbox_id="sb-x") == {"A": "two"}
    service.delete("a")
    with pytest.raises(Conflict, match=r"sb-x: env_secrets\['A'\] names secret 'a', which no"):
        service.env_for({"A": "a"}, sandbox_id="sb-x")


def test_render_fills_secret_references_for_the_egress_proxy(service: SecretService) -> None:
    service.put("openai", VALUE)
    assert service.render("Bearer {secret:openai}") == f"Bearer {VALUE}"
    assert references("{secret:a}-{secret:b.c}") == ["a", "b.c"]
    with pytest.raises(InvalidArgument, match="names no secret"):
        references("Bearer {secret:}")
    with pytest.raises(InvalidArgument, match="is not valid"):
        service.render("{secret:bad name}")
    with pytest.raises(NotFound, match="no secret named 'nope'"):
        service.render("{secret:nope}")
