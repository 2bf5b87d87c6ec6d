"""A real OCI registry for tests: Debian's ``docker-registry`` (the distribution
registry v2), installed with apt when missing, run on 127.0.0.1 with its own config
and storage directory, optionally behind htpasswd basic auth, and stopped after."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.leases import free_port

BINARY = "docker-registry"


def ensure_installed() -> str:
    found = shutil.which(BINARY)
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", BINARY],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    found = shutil.which(BINARY)
    assert found, "apt-get installed docker-registry but it is not on PATH"
    return found


def bcrypt(password: str) -> str:
    """htpasswd wants bcrypt; libxcrypt (libcrypt.so.1) has it."""
    lib = ctypes.CDLL("libcrypt.so.1")
    lib.crypt.restype = ctypes.c_char_p
    lib.crypt.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    salt = b"$2b$05$" + os.urandom(16).hex()[:22].encode()
    out = lib.crypt(password.encode(), salt)
    assert out and out.startswith(b"$2b$"), out
    return bytes(out).decode()


@dataclass(frozen=True)
class Registry:
    host: str  # "127.0.0.1:port", as an image reference names it
    auth: tuple[str, str] | None
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}"


@contextlib.contextmanager
def running_registry(root: Path, auth: tuple[str, str] | None = None) -> Iterator[Registry]:
    binary = ensure_installed()
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()  # tests/leases.py
    lines = [
        "version: 0.1",
        "log:",
        "  level: warn",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {root / 'storage'}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: 127.0.0.1:{port}",
    ]
    if auth is not None:
        (root / "htpasswd").write_text(f"{auth[0]}:{bcrypt(auth[1])}\n")
        lines += ["auth:", "  htpasswd:", "    realm: hutch-test", f"    path: {root / 'htpasswd'}"]
    config = root / "config.yml"
    config.write_text("\n".join(lines) + "\n")
    log = root / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=2).status_code
                if status in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield Registry(f"127.0.0.1:{port}", auth, log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
