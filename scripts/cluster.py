"""``make cluster-up`` / ``make cluster-down``: N hutchd workers on this machine.

Each worker has its own state dir (``<root>/w<i>``), port (``7071`` + i - 1), address
pool (``10.214.<i>.0/24``) and run dir (derived from its state dir), and all share one
database, one cluster secret, one admin key and one secrets key. The database
(``--db``): ``postgres`` (default) is Debian's PostgreSQL 15 run here, its data in
``<root>/pg`` (initdb on the first start, the ``postgres`` system user the package
makes, 127.0.0.1:7079 and a unix socket, trust for local connections only), database
``hutch``; ``sqlite`` is one WAL SQLite file (``<root>/shared/cluster.db``,
``HUTCH_SHARED_DB``); ``HUTCH_DATABASE_URL`` set: that database. Their blob store is
``<root>/shared/blobs`` (``file://``; ``HUTCH_BLOB_URL`` set: that one), so paused
sandboxes, forks and snapshots move between them. Any worker serves the whole API;
``hutch host ls`` lists them. Private networks span them (hutch.net.tunnel): each
worker's VXLAN end is on 127.0.0.1, UDP port ``--tunnel-port`` + i - 1 (default 14789;
0: no tunnel, a network's members reach only those on their own worker).

    python scripts/cluster.py up [--workers 3] [--root var/cluster] [--db postgres|sqlite]
                                 [--tunnel-port 14789]
    python scripts/cluster.py down [--root var/cluster]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_PORT = 7071
PG_PORT = 7079
TUNNEL_PORT = 14789
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_USER = "postgres"


def _pg(tool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = [str(PG_BIN / tool), *args]
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        argv = ["runuser", "-u", PG_USER, "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=cwd)


def pg_up(root: Path) -> str:
    """Start (initdb on first use) the cluster's PostgreSQL; its database URL."""
    if not os.access(PG_BIN / "postgres", os.X_OK):
        raise SystemExit(f"no PostgreSQL 15 in {PG_BIN}: `make cluster-up` installs postgresql")
    pg = root / "pg"
    data = pg / "data"
    if not data.is_dir():
        pg.mkdir(parents=True, exist_ok=True)
        # The server runs as postgres: it must pass through the root (the workers' own
        # state dirs stay 0700).
        os.chmod(root, 0o711)
        if os.geteuid() == 0:
            shutil.chown(pg, PG_USER, PG_USER)
        done = _pg(
            "initdb", "-D", str(data), "-U", PG_USER, "--auth=trust", "--no-locale", "-E",
            "UTF8", "--no-instructions", cwd=pg,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"initdb failed: {done.stdout}{done.stderr}")
    if _pg("pg_ctl", "-D", str(data), "status", cwd=pg).returncode != 0:
        options = f"-p {PG_PORT} -k {pg} -c listen_addresses=127.0.0.1 -c max_connections=200"
        done = _pg(
            "pg_ctl", "-D", str(data), "-l", str(pg / "server.log"), "-w", "-o", options,
            "start", cwd=pg,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"PostgreSQL did not start: {done.stdout}{done.stderr}")
    psql = ["-h", str(pg), "-p", str(PG_PORT), "-U", PG_USER, "-tA"]
    exists = _pg("psql", *psql, "-c", "SELECT 1 FROM pg_database WHERE datname = 'hutch'", cwd=pg)
    if exists.stdout.strip() != "1":
        done = _pg("createdb", "-h", str(pg), "-p", str(PG_PORT), "-U", PG_USER, "hutch", cwd=pg)
        if done.returncode != 0:
            raise SystemExit(f"createdb failed: {done.stdout}{done.stderr}")
    print(f"PostgreSQL: up on 127.0.0.1:{PG_PORT} (data {data})")
    return f"postgresql://{PG_USER}@127.0.0.1:{PG_PORT}/hutch"


def pg_down(root: Path) -> None:
    data = root / "pg" / "data"
    if data.is_dir() and _pg("pg_ctl", "-D", str(data), "status", cwd=root).returncode == 0:
        _pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop", cwd=root)
        print("PostgreSQL: stopped")


def _write_secret(path: Path, value: str) -> None:
    if not path.exists():
        path.write_text(value + "\n")
    path.chmod(0o600)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _alive(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def up(root: Path, workers: int, images: Path | None, db: str, tunnel_port: int) -> int:
    database = os.environ.get("HUTCH_DATABASE_URL") or (pg_up(root) if db == "postgres" else "")
    shared = root / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    _write_secret(shared / "cluster-secret", secrets.token_hex(32))
    _write_secret(shared / "api-key", "hk_" + secrets.token_urlsafe(32))
    # The E2B face's access tokens (HUTCH_E2B_LISTEN): one secret for every worker, so
    # a token one hands out is good through all of them and after a move.
    _write_secret(shared / "e2b-token-secret", secrets.token_hex(32))
    for i in range(1, workers + 1):
        state = root / f"w{i}"
        (state / "logs").mkdir(parents=True, exist_ok=True)
        os.chmod(state, 0o700)
        shutil.copy(shared / "api-key", state / "api-key")
        shutil.copy(shared / "e2b-token-secret", state / "e2b-token-secret")
        if (shared / "secrets.key").exists():
            shutil.copy(shared / "secrets.key", state / "secrets.key")
        port = BASE_PORT + i - 1
        if (pid := _alive(state / "hutchd.pid")) is not None:
            print(f"w{i}: already running (pid {pid}) on http://127.0.0.1:{port}")
            continue
        env = {
            **os.environ,
            "HUTCH_STATE_DIR": str(state),
            "HUTCH_LISTEN": f"127.0.0.1:{port}",
            "HUTCH_NET_POOL": f"10.214.{i}.0/24",
            "HUTCH_ROLE": "worker",
            "HUTCH_HOST_ID": f"w{i}",
            "HUTCH_CLUSTER_SECRET_FILE": str(shared / "cluster-secret"),
            # One port each: all the ends share 127.0.0.1 on one machine.
            "HUTCH_TUNNEL_PORT": str(tunnel_port + i - 1 if tunnel_port else 0),
        }
        if database:
            env["HUTCH_DATABASE_URL"] = database
        else:
            env["HUTCH_SHARED_DB"] = str(shared / "cluster.db")
        if images is not None:
            env["HUTCH_IMAGES_DIR"] = str(images)
            # One images directory for every worker: their built-in images are the same
            # bytes, nothing to upload or converge (hutch.services.builtin_blobs).
            env.setdefault("HUTCH_BLOB_BUILTIN_IMAGES", "0")
        # The workers' blob store, through which paused sandboxes, forks and named
        # snapshots move between them: a directory they share on this machine, unless
        # HUTCH_BLOB_URL names another (an S3 bucket).
        env.setdefault("HUTCH_BLOB_URL", (shared / "blobs").as_uri())
        with (state / "logs" / "hutchd.out").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hutch", "daemon"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        (state / "hutchd.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + 60
        while not _healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"w{i} did not start; see {state / 'logs' / 'hutchd.out'}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        if i == 1 and not (shared / "secrets.key").exists():
            # The first worker made the database and the secrets key: the others share it.
            shutil.copy(state / "secrets.key", shared / "secrets.key")
        print(f"w{i}: up on http://127.0.0.1:{port} (state {state})")
    key = (shared / "api-key").read_text().strip()
    print(
        f"\nany worker serves the API: HUTCH_URL=http://127.0.0.1:{BASE_PORT} HUTCH_API_KEY={key}"
    )
    return 0


def down(root: Path) -> int:
    for state in sorted(root.glob("w*")):
        pid = _alive(state / "hutchd.pid")
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if _alive(state / "hutchd.pid") is None:
                break
            time.sleep(0.2)
        (state / "hutchd.pid").unlink(missing_ok=True)
        print(f"{state.name}: stopped (its sandboxes keep running; a start adopts them)")
    pg_down(root)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--root", type=Path, default=REPO / "var" / "cluster")
    parser.add_argument("--images", type=Path, help="built images (default: var/images if any)")
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--tunnel-port", type=int, default=TUNNEL_PORT)
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= 32:
        parser.error("--workers: 1-32")
    if args.tunnel_port and not 1 <= args.tunnel_port <= 65535 - args.workers:
        parser.error("--tunnel-port: 0 (no tunnel) or a UDP port with room for every worker")
    root = args.root.resolve()
    if args.action == "up":
        if args.images is not None and not args.images.is_dir():
            # Workers without images would start, then fail every create.
            parser.error(f"--images {args.images}: no such directory (build them: make image)")
        default = REPO / "var" / "images"
        images = args.images or (default if default.is_dir() else None)
        images = None if images is None else images.resolve()
        return up(root, args.workers, images, args.db, args.tunnel_port)
    return down(root)


if __name__ == "__main__":
    raise SystemExit(main())
