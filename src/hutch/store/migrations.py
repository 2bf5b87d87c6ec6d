"""Numbered, forward-only schema migrations. Append; never edit a released entry."""

from __future__ import annotations

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
    # 7: the event log (traces, audit trail) and the meter (ARCHITECTURE.md, "Metering
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
        SELECT 'default', id, 'vcpu', vcpus, (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state IN ('running', 'pausing', 'resuming');
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT 'default', id, 'memory', memory_mib / 1024.0,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state IN ('running', 'pausing', 'resuming');
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT 'default', id, 'memory_paused', memory_mib / 1024.0,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state = 'paused' AND pause_mode = 'memory';
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT 'default', id, 'disk', disk_gib * 1.073741824,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM sandboxes WHERE state NOT IN ('destroyed', 'failed');
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT 'default', id, 'snapshot', size_bytes / 1e9,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM snapshots WHERE ready = 1;
    INSERT INTO meter (project, subject, kind, quantity, started_at, alive_at)
        SELECT 'default', 'image:' || project || '/' || name, 'image', size_bytes / 1e9,
               (julianday('now') - 2440587.5) * 86400.0,
               (julianday('now') - 2440587.5) * 86400.0
        FROM images;
    """,
)
