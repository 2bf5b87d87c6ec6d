"""Numbered, forward-only schema migrations. Append; never edit a released entry.

One list serves SQLite and PostgreSQL. The entries are written in SQLite's DDL; what
PostgreSQL spells differently is rewritten by :func:`script_for` with the table
``POSTGRES_REWRITES`` below (the only place the two differ): column types (SQLite's
INTEGER is 64-bit, REAL a double, BLOB bytes; an ``INTEGER PRIMARY KEY`` is an
auto-assigned id) and the two SQLite date functions some entries use. A new entry uses only
what both accept, or adds its rewrite here (``tests/unit/test_store_backends.py`` applies
every entry to both databases and compares the resulting schemas).

Which entries a database has is the ``hutch_schema`` ledger (one row per applied version)
on both; SQLite keeps ``PRAGMA user_version`` in step too, as hutch before the ledger read
it (an older hutch still refuses a newer database).
"""

from __future__ import annotations

import re

MIGRATIONS: tuple[str, ...] = (
    # 1: sandboxes
    """
    CREATE TABLE sandboxes (
        id            TEXT PRIMARY KEY,
        name          TEXT,
        image         TEXT NOT NULL,
        image_digest  TEXT,
        state         TEXT NOT NULL,
        vcpus         INTEGER NOT NULL,
        memory_mib    INTEGER NOT NULL,
        disk_gib      INTEGER NOT NULL,
        env_json      TEXT NOT NULL DEFAULT '{}',
        metadata_json TEXT NOT NULL DEFAULT '{}',
        timeout_s     INTEGER,
        created_at    REAL NOT NULL,
        started_at    REAL,
        expires_at    REAL,
        ended_at      REAL,
        error         TEXT
    );
    CREATE INDEX sandboxes_state ON sandboxes(state);
    -- Names are unique among sandboxes that are not ended (private DNS will rely on it).
    CREATE UNIQUE INDEX sandboxes_live_name ON sandboxes(name)
        WHERE name IS NOT NULL AND state IN ('creating', 'running', 'stopping');
    """,
    # 2: pause / resume / fork
    """
    ALTER TABLE sandboxes ADD COLUMN pause_mode TEXT;
    ALTER TABLE sandboxes ADD COLUMN paused_at REAL;
    ALTER TABLE sandboxes ADD COLUMN resume_from TEXT;
    ALTER TABLE sandboxes ADD COLUMN resume_clone INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN parent_id TEXT;
    ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
    DROP INDEX sandboxes_live_name;
    CREATE UNIQUE INDEX sandboxes_live_name ON sandboxes(name)
        WHERE name IS NOT NULL AND state NOT IN ('destroyed', 'failed');
    """,
    # 3: named snapshots, lifecycle policies
    """
    CREATE TABLE snapshots (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        sandbox_id  TEXT NOT NULL,
        image       TEXT NOT NULL,
        vcpus       INTEGER NOT NULL,
        memory_mib  INTEGER NOT NULL,
        disk_gib    INTEGER NOT NULL,
        path        TEXT NOT NULL,
        size_bytes  INTEGER NOT NULL,
        created_at  REAL NOT NULL
    );
    ALTER TABLE sandboxes ADD COLUMN auto_pause_s INTEGER;
    ALTER TABLE sandboxes ADD COLUMN auto_delete_s INTEGER;
    ALTER TABLE sandboxes ADD COLUMN snapshot_id TEXT;
    """,
    # 4: networking
    """
    ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT 'default';
    CREATE TABLE net_leases (
        sandbox_id  TEXT PRIMARY KEY,
        block       INTEGER NOT NULL UNIQUE,
        tap         TEXT NOT NULL UNIQUE
    );
    CREATE TABLE egress_rules (
        sandbox_id  TEXT PRIMARY KEY,
        rules_json  TEXT NOT NULL,
        updated_at  REAL NOT NULL
    );
    CREATE TABLE networks (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL UNIQUE,
        created_at  REAL NOT NULL
    );
    CREATE TABLE network_members (
        network_id  TEXT NOT NULL REFERENCES networks(id),
        sandbox_id  TEXT NOT NULL,
        PRIMARY KEY (network_id, sandbox_id)
    );
    CREATE TABLE exposed_ports (
        sandbox_id  TEXT NOT NULL,
        guest_port  INTEGER NOT NULL,
        host_port   INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, guest_port)
    );
    """,
    # 5: a named snapshot's row is written before its files (ready = 0 while it is saved),
    # so a daemon killed during the save finds it (crash safety, ARCHITECTURE.md)
    """
    ALTER TABLE snapshots ADD COLUMN ready INTEGER NOT NULL DEFAULT 1;
    """,
    # 6: imported (OCI) images. ``project`` is '' for global images until projects
    # exist; the key is (project, name) so that per-project images need no rebuild.
    """
    CREATE TABLE images (
        project      TEXT NOT NULL DEFAULT '',
        name         TEXT NOT NULL,
        digest       TEXT NOT NULL,
        source_json  TEXT NOT NULL,
        config_json  TEXT NOT NULL,
        start        INTEGER NOT NULL DEFAULT 0,
        size_bytes   INTEGER NOT NULL,
        created_at   REAL NOT NULL,
        PRIMARY KEY (project, name)
    );
    """,
    # 7: projects (issue 10). Every resource belongs to one; existing rows go to
    # 'default'. Sandbox names are unique among a project's live sandboxes, network names
    # within a project (networks is rebuilt for that: SQLite cannot drop a UNIQUE; its
    # members table is rebuilt with it so the foreign key follows). Ports, egress rules
    # and leases follow their sandbox. Images keep their (project, name) key.
    # api_keys: per-project keys, the secret stored only as its sha256.
    """
    CREATE TABLE projects (
        name                TEXT PRIMARY KEY,
        created_at          REAL NOT NULL,
        max_sandboxes       INTEGER,
        max_vcpus           INTEGER,
        max_memory_mib      INTEGER,
        max_snapshot_bytes  INTEGER
    );
    INSERT INTO projects (name, created_at) VALUES ('default', strftime('%s', 'now'));
    CREATE TABLE api_keys (
        id             TEXT PRIMARY KEY,
        project        TEXT NOT NULL,
        name           TEXT NOT NULL,
        role           TEXT NOT NULL,
        secret_sha256  TEXT NOT NULL,
        created_at     REAL NOT NULL,
        created_by     TEXT,
        expires_at     REAL,
        revoked_at     REAL,
        last_used_at   REAL
    );
    CREATE INDEX api_keys_project ON api_keys(project);
    ALTER TABLE sandboxes ADD COLUMN project TEXT NOT NULL DEFAULT 'default';
    CREATE INDEX sandboxes_project ON sandboxes(project, state);
    DROP INDEX sandboxes_live_name;
    CREATE UNIQUE INDEX sandboxes_live_name ON sandboxes(project, name)
        WHERE name IS NOT NULL AND state NOT IN ('destroyed', 'failed');
    ALTER TABLE snapshots ADD COLUMN project TEXT NOT NULL DEFAULT 'default';
    CREATE INDEX snapshots_project ON snapshots(project);
    CREATE TABLE networks_v7 (
        id          TEXT PRIMARY KEY,
        project     TEXT NOT NULL DEFAULT 'default',
        name        TEXT NOT NULL,
        created_at  REAL NOT NULL,
        UNIQUE (project, name)
    );
    INSERT INTO networks_v7 (id, project, name, created_at)
        SELECT id, 'default', name, created_at FROM networks;
    CREATE TABLE network_members_v7 (
        network_id  TEXT NOT NULL REFERENCES networks_v7(id),
        sandbox_id  TEXT NOT NULL,
        PRIMARY KEY (network_id, sandbox_id)
    );
    INSERT INTO network_members_v7 (network_id, sandbox_id)
        SELECT network_id, sandbox_id FROM network_members;
    DROP TABLE network_members;
    DROP TABLE networks;
    ALTER TABLE networks_v7 RENAME TO networks;
    ALTER TABLE network_members_v7 RENAME TO network_members;
    UPDATE images SET project = 'default' WHERE project = '';
    """,
    # 8: volumes (per project) and which sandbox mounts which. A mount row lives from
    # the create that asks for it until the sandbox's teardown (ARCHITECTURE.md "Volumes").
    """
    CREATE TABLE volumes (
        id          TEXT PRIMARY KEY,
        project     TEXT NOT NULL DEFAULT 'default',
        name        TEXT NOT NULL,
        kind        TEXT NOT NULL,
        size_bytes  INTEGER NOT NULL,
        created_at  REAL NOT NULL,
        UNIQUE (project, name)
    );
    CREATE TABLE volume_mounts (
        volume_id   TEXT NOT NULL REFERENCES volumes(id),
        sandbox_id  TEXT NOT NULL,
        path        TEXT NOT NULL,
        read_only   INTEGER NOT NULL,
        slot        INTEGER NOT NULL,
        PRIMARY KEY (volume_id, sandbox_id)
    );
    CREATE INDEX volume_mounts_sandbox ON volume_mounts(sandbox_id);
    """,
    # 9: secrets (write-only values, sealed with AES-256-GCM under <state>/secrets.key;
    # only the current version of each is kept) and the sandboxes' env_secrets
    # ({VAR: secret name}, resolved when a command's environment is built)
    """
    CREATE TABLE secrets (
        project     TEXT NOT NULL DEFAULT 'default',
        name        TEXT NOT NULL,
        version     INTEGER NOT NULL,
        key_id      TEXT NOT NULL,
        nonce       BLOB NOT NULL,
        ciphertext  BLOB NOT NULL,
        created_at  REAL NOT NULL,
        updated_at  REAL NOT NULL,
        PRIMARY KEY (project, name)
    );
    ALTER TABLE sandboxes ADD COLUMN env_secrets_json TEXT NOT NULL DEFAULT '{}';
    """,
    # 10: named egress policies, reusable per project (issue 12); a sandbox gets a copy
    # at create or PUT (its own row in egress_rules)
    """
    CREATE TABLE egress_policies (
        project      TEXT NOT NULL,
        name         TEXT NOT NULL,
        policy_json  TEXT NOT NULL,
        created_at   REAL NOT NULL,
        updated_at   REAL NOT NULL,
        PRIMARY KEY (project, name)
    );
    """,
    # 11: the event log (traces, audit trail) and the meter (ARCHITECTURE.md, "Metering
    # and events"). ``seq`` is AUTOINCREMENT so a pruned number is never handed out again
    # (followers page with ``after=<seq>``). Meter intervals are written in the same
    # transaction as the state change they follow; an open one has ``ended_at`` NULL and
    # ``alive_at`` = the last heartbeat of the VM it bills. Sandboxes and snapshots live
    # when this runs start their intervals now: no usage is invented for the time before.
    """
    CREATE TABLE events (
        seq         INTEGER PRIMARY KEY AUTOINCREMENT,
        at          REAL NOT NULL,
        project     TEXT NOT NULL,
        sandbox_id  TEXT,
        type        TEXT NOT NULL,
        actor       TEXT,
        source      TEXT,
        data_json   TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_sandbox ON events(sandbox_id, seq);
    CREATE INDEX events_project ON events(project, seq);
    CREATE INDEX events_at ON events(at);
    CREATE TABLE meter (
        id          INTEGER PRIMARY KEY,
        project     TEXT NOT NULL,
        subject     TEXT NOT NULL,
        kind        TEXT NOT NULL,
        quantity    REAL NOT NULL,
        started_at  REAL NOT NULL,
        ended_at    REAL,
        alive_at    REAL NOT NULL
    );
    CREATE UNIQUE INDEX meter_open ON meter(subject, kind) WHERE ended_at IS NULL;
    CREATE INDEX meter_project ON meter(project, started_at);
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT project, id, 'vcpu', vcpus, (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state IN ('running', 'pausing', 'resuming');
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT project, id, 'memory', memory_mib / 1024.0,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state IN ('running', 'pausing', 'resuming');
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT project, id, 'memory_paused', memory_mib / 1024.0,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state = 'paused' AND pause_mode = 'memory';
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT project, id, 'disk', disk_gib * 1.073741824,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state NOT IN ('destroyed', 'failed');
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT project, id, 'snapshot', size_bytes / 1e9,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM snapshots WHERE ready = 1;
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT project, 'image:' || project || '/' || name, 'image', size_bytes / 1e9,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM images;
    """,
    # 12: hosts (many hutchds on one database): the hosts and their leases, the host
    # each sandbox runs on, and address leases per host (each host has its own pool, so
    # a block number is unique per host only; the table is rebuilt for that: SQLite
    # cannot drop a UNIQUE). Rows from before name host 'local', the one-host id.
    """
    CREATE TABLE hosts (
        id            TEXT PRIMARY KEY,
        address       TEXT NOT NULL,
        role          TEXT NOT NULL,
        state         TEXT NOT NULL,
        vcpus         INTEGER NOT NULL,
        memory_mib    INTEGER NOT NULL,
        disk_gib      INTEGER NOT NULL,
        max_sandboxes INTEGER NOT NULL,
        accel         TEXT NOT NULL,
        qemu_version  TEXT NOT NULL,
        cpu_model     TEXT NOT NULL,
        labels_json   TEXT NOT NULL DEFAULT '{}',
        started_at    REAL NOT NULL,
        renewed_at    REAL NOT NULL,
        lease_until   REAL NOT NULL,
        down_at       REAL,
        down_reason   TEXT,
        swept         INTEGER NOT NULL DEFAULT 0
    );
    ALTER TABLE sandboxes ADD COLUMN host TEXT NOT NULL DEFAULT 'local';
    CREATE INDEX sandboxes_host ON sandboxes(host, state);
    CREATE TABLE net_leases_v12 (
        sandbox_id  TEXT PRIMARY KEY,
        block       INTEGER NOT NULL,
        tap         TEXT NOT NULL UNIQUE,
        host        TEXT NOT NULL DEFAULT 'local',
        UNIQUE (host, block)
    );
    INSERT INTO net_leases_v12 (sandbox_id, block, tap)
        SELECT sandbox_id, block, tap FROM net_leases;
    DROP TABLE net_leases;
    ALTER TABLE net_leases_v12 RENAME TO net_leases;
    """,
    # 13: the placement labels a sandbox was created with ({KEY: VALUE}): its moves
    # (a resume off a draining or down host) and its fork children keep to hosts
    # carrying them
    """
    ALTER TABLE sandboxes ADD COLUMN placement_labels_json TEXT NOT NULL DEFAULT '{}';
    """,
    # 14: net_tunnels (private networks across hosts): each host's end of the overlay
    # (its underlay address, UDP port, device MAC) and its sandbox pool, which the other
    # hosts read to reach its members (hutch.net.tunnel).
    """
    CREATE TABLE net_tunnels (
        host        TEXT PRIMARY KEY,
        address     TEXT NOT NULL,
        port        INTEGER NOT NULL,
        mac         TEXT NOT NULL,
        pool        TEXT NOT NULL,
        updated_at  REAL NOT NULL
    );
    """,
    # 15: image_uploads: what a host uploaded of an image's content or a boot set to the
    # blob store (each file's size and sha256, the index's meta), written by that host
    # from the bytes it sent; a host fetching it verifies against this, not against the
    # index in the same bucket (hutch.services.image_blobs). No row: not fetchable.
    """
    CREATE TABLE image_uploads (
        prefix      TEXT PRIMARY KEY,
        files_json  TEXT NOT NULL,
        meta_json   TEXT NOT NULL DEFAULT '{}',
        uploaded_at REAL NOT NULL
    );
    """,
    # 16: each host's sandbox address pool (HUTCH_NET_POOL), so that any host shows the
    # guest address of a sandbox another host leased (its lease names a block of it).
    """
    ALTER TABLE hosts ADD COLUMN net_pool TEXT NOT NULL DEFAULT '';
    """,
    # 17: image_upload_claims (issue 14): which host uploads a prefix of the blob store
    # now. Two hosts importing one digest derive other bytes (mkfs is not
    # reproducible); the claim makes one of them the uploader, and the first complete
    # upload is what every host then holds (the others adopt it). A claim older than
    # an hour without renewal is stale: its host died mid-upload, another may take it.
    """
    CREATE TABLE image_upload_claims (
        prefix      TEXT PRIMARY KEY,
        host        TEXT NOT NULL,
        claimed_at  REAL NOT NULL
    );
    """,
    # 18: the host whose disk holds each volume's file (issue 14: a sandbox mounting it
    # runs there; its file operations go there). NULL: made before hosts were recorded;
    # the host whose state directory holds the file claims it at its start.
    """
    ALTER TABLE volumes ADD COLUMN host TEXT;
    """,
    # 19: the built-in images each host holds ({name: {digest: rootfs sha256}}), written
    # by the host at its start and after an adoption or a fetch (hutch.services.
    # builtin_blobs): placement keeps a frozen state off a host whose bytes differ.
    """
    ALTER TABLE hosts ADD COLUMN images_json TEXT NOT NULL DEFAULT '{}';
    """,
    # 20: the host that saved each named snapshot (its files are there until an upload
    # completes). Its sandbox may move to another host afterwards; the snapshot's files
    # do not. NULL: saved before this column; the sandbox's host is the best guess.
    """
    ALTER TABLE snapshots ADD COLUMN host TEXT;
    """,
)


#: The ledger: which numbered migrations a database has (created before the first one).
LEDGER = """
    CREATE TABLE IF NOT EXISTS hutch_schema (
        version     INTEGER NOT NULL PRIMARY KEY,
        applied_at  REAL NOT NULL
    )
"""

#: SQLite DDL -> PostgreSQL, applied in order (regex, replacement).
POSTGRES_REWRITES: tuple[tuple[str, str], ...] = (
    # a rowid alias (assigned by the database, AUTOINCREMENT: never reused)
    (
        r"\bINTEGER PRIMARY KEY(?: AUTOINCREMENT)?",
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    ),
    (r"\bINTEGER\b", "BIGINT"),
    (r"\bREAL\b", "DOUBLE PRECISION"),
    (r"\bBLOB\b", "BYTEA"),
    # the current Unix time, as SQLite had to say it
    (r"strftime\('%s', 'now'\)", "extract(epoch from now())"),
    (r"\(julianday\('now'\) - 2440587\.5\) \* 86400\.0", "extract(epoch from now())"),
)  # fmt: skip


def script_for(script: str, dialect: str) -> str:
    """A migration's SQL as ``dialect`` ("sqlite" | "postgresql") runs it."""
    if dialect == "sqlite":
        return script
    for pattern, replacement in POSTGRES_REWRITES:
        script = re.sub(pattern, replacement, script)
    return script


def statements(script: str) -> list[str]:
    """The statements of a script (no entry has a ``;`` inside a literal or comment)."""
    return [s for s in script.split(";") if s.strip()]
