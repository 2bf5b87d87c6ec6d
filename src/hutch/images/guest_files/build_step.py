"""hutch's Dockerfile build steps that run *inside* the build sandbox.

Run by the agent runtime's own Python (the image may have none):
``python3 -I -S -c <this file> [--root DIR] OP [ARG]`` (``--root``: tests on the host
lay files out under DIR instead of ``/``). Standard library only, Python 3.11.

- ``copy SPEC`` (stdin: a tar from ``hutch.images.build_context.copy_stream``): lay out
  one COPY/ADD as Docker does. SPEC is JSON ``{dest, dest_is_dir, chown, chmod,
  sources: [{kind: file|dir|archive, name}]}``. A directory source copies its content
  into ``dest``; a file source goes to ``dest`` (a file path) or into it when ``dest``
  was written as a directory, is one already, or there are several sources; an
  ``archive`` (ADD) is unpacked into ``dest`` with the owners it records. Files are
  owned by root unless ``--chown`` names a user (looked up in the image's /etc/passwd
  and /etc/group; a user without a group takes the uid as gid, as Docker does), and keep
  their modes unless ``--chmod``; directories this step creates get the same owner.
  Existing directories keep their owner and mode; existing files and links are replaced.
- ``finish``: make the disk a clean layer: put back the files the boot wrote for this
  sandbox (``/etc/hostname``, ``/etc/hosts``, ``/etc/resolv.conf``, ``/etc/machine-id``;
  the initramfs saved the image's own in ``/run/.hutch/orig`` when booted with
  ``hutch.build=1``), sync, and freeze ``/`` (FIFREEZE: the journal is flushed and the
  filesystem marked clean) so nothing changes it before the VM stops.

Errors: a message on stderr, exit status 2 (the builder reports it with the step).
"""

import json
import os
import posixpath
import sys
import tarfile
from typing import IO, Any

ROOT = "/"
ORIG = "/run/.hutch/orig"
IDENTITY_FILES = ("hostname", "hosts", "resolv.conf", "machine-id")
FIFREEZE = 0xC0045877  # _IOWR('X', 119, int)
CHUNK = 1 << 20


class Fail(Exception):
    pass


def host(path: str) -> str:
    """A guest path as this process sees it (under --root in tests)."""
    if ROOT == "/":
        return path
    return os.path.join(ROOT, path.lstrip("/"))


def _table(path: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        with open(host(path), encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 3 and fields[0] not in out:
                    out[fields[0]] = fields
    except OSError:
        pass
    return out


def owner(chown: str | None) -> tuple[int, int]:
    """(uid, gid) of a --chown value, looked up in the image's own files."""
    if chown is None:
        return 0, 0
    user, _, group = chown.partition(":")
    if user.isdigit():
        uid = int(user)
    else:
        entry = _table("/etc/passwd").get(user)
        if entry is None or not entry[2].isdigit():
            raise Fail(f"--chown={chown}: the image's /etc/passwd has no user {user!r}")
        uid = int(entry[2])
    if not group:
        return uid, uid
    if group.isdigit():
        return uid, int(group)
    entry = _table("/etc/group").get(group)
    if entry is None or not entry[2].isdigit():
        raise Fail(f"--chown={chown}: the image's /etc/group has no group {group!r}")
    return uid, int(entry[2])


class Copier:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.dest = spec["dest"]
        self.dest_is_dir = bool(spec["dest_is_dir"])
        self.sources = spec["sources"]
        self.chmod = spec.get("chmod")
        self.uid, self.gid = owner(spec.get("chown"))
        self.chowned = spec.get("chown") is not None
        self.targets: dict[int, str] = {}

    # -- places ------------------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        """``path`` and its missing parents (created ones owned like the copy)."""
        missing = []
        p = path
        while not os.path.lexists(host(p)):
            missing.append(p)
            parent = posixpath.dirname(p)
            if parent == p:
                break
            p = parent
        if os.path.lexists(host(p)) and not os.path.isdir(host(p)):
            raise Fail(f"{p} exists in the image and is not a directory")
        for d in reversed(missing):
            os.mkdir(host(d), 0o755)
            os.chmod(host(d), 0o755)
            os.lchown(host(d), self.uid, self.gid)

    def plan(self) -> None:
        several = len(self.sources) > 1
        for i, src in enumerate(self.sources):
            kind = src["kind"]
            if kind in ("dir", "archive"):
                if os.path.lexists(host(self.dest)) and not os.path.isdir(host(self.dest)):
                    raise Fail(f"{self.dest} exists in the image and is not a directory")
                self.makedirs(self.dest)
                self.targets[i] = self.dest
            elif self.dest_is_dir or several or os.path.isdir(host(self.dest)):
                self.makedirs(self.dest)
                self.targets[i] = posixpath.join(self.dest, src["name"])
            else:
                self.makedirs(posixpath.dirname(self.dest) or "/")
                self.targets[i] = self.dest

    # -- entries -----------------------------------------------------------------------

    def _clear(self, target: str) -> None:
        path = host(target)
        if os.path.lexists(path):
            if os.path.isdir(path) and not os.path.islink(path):
                raise Fail(f"cannot replace the directory {target} with a file or link")
            os.unlink(path)

    def put(
        self,
        target: str,
        member: tarfile.TarInfo,
        data: IO[bytes] | None,
        uid: int,
        gid: int,
        link_to: str | None = None,
    ) -> None:
        mode = member.mode & 0o7777
        if self.chmod is not None:
            mode = self.chmod
        path = host(target)
        if member.isdir():
            if os.path.isdir(path):
                return
            if os.path.lexists(path):
                raise Fail(f"cannot replace {target} with a directory")
            os.mkdir(path, 0o700)
            os.lchown(path, uid, gid)
            os.chmod(path, mode)
        elif member.issym():
            self._clear(target)
            os.symlink(member.linkname, path)
            os.lchown(path, uid, gid)
        elif member.islnk() and link_to is not None:
            self._clear(target)
            os.link(host(link_to), path)
        elif member.isreg() and data is not None:
            self._clear(target)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                while chunk := data.read(CHUNK):
                    os.write(fd, chunk)
                os.fchown(fd, uid, gid)  # before the mode: chown clears setuid
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        elif member.ischr() or member.isblk() or member.isfifo():
            self._clear(target)
            kind = {tarfile.CHRTYPE: 0o020000, tarfile.BLKTYPE: 0o060000}.get(member.type, 0o010000)
            os.mknod(path, kind | mode, os.makedev(member.devmajor, member.devminor))
            os.lchown(path, uid, gid)
            os.chmod(path, mode)
        else:
            return
        if not member.issym():
            os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)

    def unpack(self, fileobj: IO[bytes] | None, dest: str, label: str) -> None:
        """An archive (ADD) into ``dest``: its owners kept (unless --chown), its members
        kept inside ``dest``."""
        try:
            with tarfile.open(fileobj=fileobj, mode="r|*") as inner:
                for member in inner:
                    rel = posixpath.normpath("/" + member.name).lstrip("/")
                    if not rel or rel == ".":
                        continue
                    if ".." in member.name.split("/"):
                        raise Fail(f"{label}: member {member.name!r} climbs out of {dest}")
                    target = posixpath.join(dest, rel)
                    self.makedirs(posixpath.dirname(target))
                    link_to = None
                    if member.islnk():
                        link = posixpath.normpath("/" + member.linkname).lstrip("/")
                        link_to = posixpath.join(dest, link)
                    uid, gid = (self.uid, self.gid) if self.chowned else (member.uid, member.gid)
                    data = inner.extractfile(member) if member.isreg() else None
                    self.put(target, member, data, uid, gid, link_to)
        except tarfile.TarError as exc:
            raise Fail(f"{label} is not a valid archive: {exc}") from exc

    def run(self, stream: IO[bytes]) -> None:
        self.plan()
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                index, _, rel = member.name.partition("/")
                src = self.sources[int(index)]
                if src["kind"] == "archive":
                    self.unpack(tar.extractfile(member), self.targets[int(index)], src["name"])
                    continue
                if src["kind"] == "dir":
                    target = posixpath.join(self.targets[int(index)], rel)
                else:
                    target = self.targets[int(index)]
                data = tar.extractfile(member) if member.isreg() else None
                self.put(target, member, data, self.uid, self.gid)


def restore_identity() -> None:
    """Put back what the boot wrote into the image for this one sandbox."""
    for name in IDENTITY_FILES:
        path = host("/etc/" + name)
        saved = host(f"{ORIG}/{name}")
        if os.path.exists(saved + ".absent"):
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
        elif os.path.isfile(saved) and not os.path.islink(saved):
            if os.path.islink(path) or os.path.isdir(path):
                continue
            with open(saved, "rb") as f:
                data = f.read()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


def finish() -> None:
    restore_identity()
    os.sync()
    if ROOT == "/":
        import fcntl

        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)
        finally:
            os.close(fd)


def main(argv: list[str]) -> None:
    global ROOT
    if len(argv) >= 2 and argv[0] == "--root":
        ROOT = argv[1]
        argv = argv[2:]
    os.umask(0)
    op = argv[0] if argv else ""
    if op == "copy":
        Copier(json.loads(argv[1])).run(sys.stdin.buffer)
    elif op == "finish":
        finish()
    else:
        raise Fail(f"unknown operation {op!r}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Fail as exc:
        print(f"hutch build: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        print(f"hutch build: {exc}", file=sys.stderr)
        sys.exit(2)
