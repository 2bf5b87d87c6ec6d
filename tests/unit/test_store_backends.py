"""The store's backend seam (``hutch.store.backend``) against a real PostgreSQL server
(``tests/pgserver.py``) and SQLite: the URL setting, placeholders, the migrations on both,
row locks and claims, connection loss and reconnect."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from hutch.config import Settings, load_settings, parse_database_url
from hutch.contract.volumes import VolumeKind
from hutch.errors import Conflict, InvalidArgument, StoreError
from hutch.models import SandboxRecord, SandboxState, Shape, SnapshotRecord
from hutch.store import Store
from hutch.store.backend import claim
from hutch.store.hosts import HostStore, place_in
from hutch.store.migrations import MIGRATIONS, POSTGRES_REWRITES, script_for
from hutch.store.pg_backend import redact, to_pyformat
from hutch.store.volumes import MountRow, VolumeRow, VolumeStore
from tests.pgserver import PgServer, shared_server


def record(sid: str, **kw: object) -> SandboxRecord:
    base: dict[str, object] = dict(
        id=sid, image="base", state=SandboxState.RUNNING, shape=Shape(1, 256, 4),
        created_at=time.time(),
    )  # fmt: skip
    base.update(kw)
    return SandboxRecord(**base)  # type: ignore[arg-type]


# -- the setting ------------------------------------------------------------------------


def test_unset_database_url_is_sqlite_in_the_state_dir(tmp_path: Path) -> None:
    settings = load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
    assert settings.database_url is None
    assert settings.database == tmp_path.resolve() / "hutch.db"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://hutch@db.example:5433/hutch",
        "postgres://hutch:pw@127.0.0.1/hutch",
        "postgresql://hutch@/hutch?host=/run/postgresql",
    ],
)
def test_postgresql_urls_are_accepted(url: str, tmp_path: Path) -> None:
    env = {"HUTCH_STATE_DIR": str(tmp_path), "HUTCH_DATABASE_URL": url}
    assert load_settings(env).database == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("mysql://u@h/db", "scheme must be postgresql"),
        ("sqlite:///var/hutch.db", "scheme must be postgresql"),
        ("postgresql:///hutch", "names no server"),
        ("postgresql://u@host", "names no database"),
        ("postgresql://u@host:99999/db", "not a URL"),
        ("postgresql://u@host:abc/db", "not a URL"),
    ],
)
def test_a_bad_database_url_names_what_is_accepted(url: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why) as info:
        parse_database_url(url)
    assert "postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME" in str(info.value)
    assert "HUTCH_DATABASE_URL" in str(info.value)


def test_a_password_never_appears_in_an_error() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_database_url("mysql://u:s3cret@h/db")
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    assert redact("postgresql://u:s3cret@h:1/db") == "postgresql://u:***@h:1/db"


def test_a_server_that_cannot_be_reached_is_a_store_error_naming_it() -> None:
    server = shared_server()
    with pytest.raises(StoreError, match="cannot connect to the PostgreSQL database") as info:
        Store(server.url("no_such_database"))
    assert "no_such_database" in str(info.value)


# -- the SQL seam ---------------------------------------------------------------------


def test_placeholders_outside_literals_only_and_percent_doubled() -> None:
    sql = "SELECT '?', \"a?\" FROM t WHERE x = ? AND y LIKE 'a%' AND z = ?"
    assert to_pyformat(sql) == (
        "SELECT '?', \"a?\" FROM t WHERE x = %s AND y LIKE 'a%%' AND z = %s"
    )


def test_the_postgresql_migrations_keep_no_sqlite_only_spelling() -> None:
    for number, script in enumerate(MIGRATIONS, start=1):
        pg = script_for(script, "postgresql")
        for word in ("AUTOINCREMENT", "julianday", "strftime", " REAL", "BLOB", "INTEGER"):
            assert word not in pg, (number, word)
    assert script_for(MIGRATIONS[0], "sqlite") == MIGRATIONS[0]
    assert len(POSTGRES_REWRITES) >= 4


def _columns(store: Store) -> dict[str, list[str]]:
    with store.transaction() as db:
        if store.dialect_name == "sqlite":
            tables = [
                t for (t,) in db.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' "
                    "AND name NOT LIKE 'sqlite_%' ORDER BY name"
                ).fetchall()
            ]  # fmt: skip
            return {
                t: [r[1] for r in db.execute(f"PRAGMA table_info({t})").fetchall()] for t in tables
            }
        rows = db.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() ORDER BY table_name, ordinal_position"
        ).fetchall()
    out: dict[str, list[str]] = {}
    for table, column in rows:
        out.setdefault(table, []).append(column)
    return out


def test_both_databases_get_the_same_tables_and_columns(tmp_path: Path) -> None:
    lite = Store(tmp_path / "h.db")
    pg = Store(shared_server().fresh_database())
    assert lite.schema_version() == pg.schema_version() == len(MIGRATIONS)
    assert _columns(lite) == _columns(pg)
    assert "hutch_schema" in _columns(pg)


def test_wide_numbers_and_exact_times_round_trip(db_target: Path | str) -> None:
    store = Store(db_target)
    created = 1_767_225_600.123456  # a double, not PostgreSQL's 4-byte REAL
    store.insert_sandbox(record("sb-000000000001", created_at=created, timeout_s=2**40))
    got = store.get_sandbox("sb-000000000001")
    assert got is not None and got.created_at == created and got.timeout_s == 2**40


def test_a_unique_violation_is_a_conflict_and_the_connection_stays_usable(
    db_target: Path | str,
) -> None:
    store = Store(db_target)
    store.insert_sandbox(record("sb-000000000001"))
    with pytest.raises(Conflict):
        store.insert_sandbox(record("sb-000000000001"))
    store.insert_sandbox(record("sb-000000000002"))
    assert len(store.list_sandboxes()) == 2


def test_the_unix_socket_and_tcp_urls_reach_the_same_server() -> None:
    server = shared_server()
    tcp_url = server.fresh_database()  # a socket URL
    name = re.sub(r"\?.*", "", tcp_url).rsplit("/", 1)[1]
    Store(tcp_url).insert_sandbox(record("sb-000000000001"))
    assert [r.id for r in Store(server.url(name)).list_sandboxes()] == ["sb-000000000001"]


def test_hutchd_processes_starting_together_migrate_once() -> None:
    url = shared_server().fresh_database()
    errors: list[BaseException] = []

    def start() -> None:
        try:
            Store(url).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    with psycopg.connect(url) as conn:
        versions = [v for (v,) in conn.execute("SELECT version FROM hutch_schema ORDER BY 1")]
    assert versions == list(range(1, len(MIGRATIONS) + 1))


# -- row locks and claims -------------------------------------------------------------


def _work_table(store: Store, n: int) -> None:
    with store.transaction() as db:
        db.execute("CREATE TABLE work (id INTEGER PRIMARY KEY, taken_by TEXT)")
        for i in range(1, n + 1):
            db.execute("INSERT INTO work (id, taken_by) VALUES (?, NULL)", (i,))


_CLAIM = "SELECT id FROM work WHERE taken_by IS NULL ORDER BY id LIMIT 2"


def test_claim_takes_rows_and_marks_them(db_target: Path | str) -> None:
    store = Store(db_target)
    _work_table(store, 3)
    with store.transaction() as db:
        ids = [i for (i,) in claim(db, _CLAIM)]
        for i in ids:
            db.execute("UPDATE work SET taken_by = ? WHERE id = ?", ("a", i))
    assert ids == [1, 2]
    with store.transaction() as db:
        assert [i for (i,) in claim(db, _CLAIM)] == [3]


def test_a_snapshot_stays_on_the_host_that_saved_it_when_its_sandbox_moves(
    db_target: Path | str,
) -> None:
    """Migration 20: a named snapshot's files are where it was saved, wherever its
    sandbox goes afterwards (placement and the sweeps ask ``host_of_snapshot``)."""
    store = Store(db_target)
    try:
        hosts, sid = HostStore(store), "sb-000000000001"
        store.insert_sandbox(
            record(sid, state=SandboxState.PAUSED), also=lambda db: place_in(db, sid, "w1")
        )
        snap = SnapshotRecord("snap-000000000001", "s", sid, "base", Shape(1, 256, 4), "/x", 1, 1.0)
        store.insert_snapshot(snap)
        assert hosts.host_of_snapshot(snap.id) == "w1"
        assert hosts.move_sandbox(sid, "w1", "w2", None)  # a resume on w2 took it
        assert hosts.host_of_snapshot(snap.id) == "w1"
        with store.transaction() as db:  # a row saved before the column: its sandbox's host
            db.execute("UPDATE snapshots SET host = NULL WHERE id = ?", (snap.id,))
        assert hosts.host_of_snapshot(snap.id) == "w2"
        assert hosts.host_of_snapshot("snap-00000000000f") is None
    finally:
        store.close()


def test_two_hosts_claiming_at_once_get_different_rows_and_never_wait() -> None:
    """Two connections (two hutchd hosts): while the first holds its claim open, the
    second's claim skips the locked rows instead of waiting for them."""
    url = shared_server().fresh_database()
    a, b = Store(url), Store(url)
    _work_table(a, 4)
    with a.transaction() as db_a:
        first = [i for (i,) in claim(db_a, _CLAIM)]
        with b.transaction() as db_b:
            db_b.execute("SET LOCAL lock_timeout = '2s'")
            second = [i for (i,) in claim(db_b, _CLAIM)]
    assert first == [1, 2] and second == [3, 4]


def test_an_exclusive_volume_attach_locks_the_volume_row() -> None:
    """While one host's attach of an exclusive volume is open, another's waits for it
    (FOR UPDATE on the volume row) and then sees the mount, so it is refused."""
    url = shared_server().fresh_database()
    a, b = Store(url), Store(url)
    vols = VolumeStore(a)
    vols.insert(VolumeRow("vol-000000000001", "default", "v", VolumeKind.EXCLUSIVE, 1 << 20, 1.0))
    mount = MountRow("vol-000000000001", "sb-000000000001", "/data", False, 0)
    outcome: list[BaseException | None] = []
    started = threading.Event()
    with a.transaction() as db:
        db.execute("SELECT kind FROM volumes WHERE id = ? FOR UPDATE", ("vol-000000000001",))

        def other() -> None:
            started.set()
            try:
                VolumeStore(b).attach("sb-000000000002", [mount], "local")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=other)
        t.start()
        started.wait(5)
        time.sleep(0.3)
        assert outcome == []  # waiting on the row lock
        db.execute(
            "INSERT INTO volume_mounts (volume_id, sandbox_id, path, read_only, slot) "
            "VALUES (?, ?, ?, ?, ?)",
            ("vol-000000000001", "sb-000000000001", "/data", 0, 0),
        )
    t.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Conflict)
    assert "mounted by sandbox sb-000000000001" in str(outcome[0])


# -- connection loss ------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_server() -> Iterator[PgServer]:
    """A server of these tests' own: they stop and restart it."""
    server = PgServer()
    try:
        yield server
    finally:
        server.close()


def test_a_restarted_server_is_reconnected_at_the_next_call(own_server: PgServer) -> None:
    store = Store(own_server.fresh_database())
    store.insert_sandbox(record("sb-000000000001"))
    own_server.restart()
    # reads and writes after the restart reconnect; nothing stored is lost
    assert [r.id for r in store.list_sandboxes()] == ["sb-000000000001"]
    own_server.restart()
    store.insert_sandbox(record("sb-000000000002"))
    assert store.get_sandbox("sb-000000000002") is not None


def test_a_server_that_is_down_is_a_clear_store_error_until_it_is_back(
    own_server: PgServer,
) -> None:
    store = Store(own_server.fresh_database())
    store.insert_sandbox(record("sb-000000000001"))
    own_server.stop()
    try:
        with pytest.raises(StoreError, match="cannot connect to the PostgreSQL database"):
            store.get_sandbox("sb-000000000001")
        with pytest.raises(StoreError, match="next call reconnects"):
            store.insert_sandbox(record("sb-000000000002"))
    finally:
        own_server.start()
    assert [r.id for r in store.list_sandboxes()] == ["sb-000000000001"]


def test_a_connection_lost_inside_a_transaction_rolls_it_back(own_server: PgServer) -> None:
    url = own_server.fresh_database()
    store = Store(url)
    with (
        pytest.raises(StoreError, match="lost the connection") as info,
        store.transaction() as db,
    ):
        db.execute("INSERT INTO projects (name, created_at) VALUES (?, ?)", ("half", 1.0))
        (pid,) = db.execute("SELECT pg_backend_pid()").fetchone()
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        db.execute("SELECT 1")
    assert "did not commit" in str(info.value)
    with store.transaction() as db:  # reconnected; the insert was rolled back
        names = [n for (n,) in db.execute("SELECT name FROM projects ORDER BY name")]
    assert names == ["default"]


def test_settings_database_prefers_the_url() -> None:
    s = Settings(state_dir=Path("/x"), database_url="postgresql://u@h/db")
    assert s.database == "postgresql://u@h/db"


def test_a_newer_postgresql_schema_is_refused() -> None:
    url = shared_server().fresh_database()
    Store(url).close()
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO hutch_schema (version, applied_at) VALUES (%s, 0)", (len(MIGRATIONS) + 5,)
        )
    with pytest.raises(StoreError, match="newer than this hutch") as info:
        Store(url)
    assert "/t_" in str(info.value)  # names the database


def test_the_config_file_takes_database_url_too(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('database_url = "postgresql://u@db/hutch"\n')
    assert load_settings({"HUTCH_STATE_DIR": str(tmp_path)}).database == "postgresql://u@db/hutch"
    (tmp_path / "config.toml").write_text('database_url = "redis://db/0"\n')
    with pytest.raises(InvalidArgument, match=r"config\.toml: database_url=.*scheme must be"):
        load_settings({"HUTCH_STATE_DIR": str(tmp_path)})
