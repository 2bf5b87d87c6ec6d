"""The kernel's FUSE protocol (``include/uapi/linux/fuse.h``), the part hutch speaks:
request and reply layouts as structs, sans-IO.

Each read of ``/dev/fuse`` yields one whole request (:data:`IN_HEADER` then the opcode's
arguments); each write is one whole reply (:data:`OUT_HEADER`, error as ``-errno``,
then the results). Protocol 7.31 is what we answer INIT with (the guest kernel, 6.1,
speaks 7.36 and adapts to the lower minor).
"""

from __future__ import annotations

import struct
from enum import IntEnum

KERNEL_VERSION = 7
KERNEL_MINOR = 31
#: Largest WRITE the kernel sends us (FUSE's default of 32 pages) and so READ we ask for.
MAX_WRITE = 128 * 1024
#: A read buffer of /dev/fuse must hold the largest request: a WRITE's headers + data.
READ_BUFFER = MAX_WRITE + 4096


class Opcode(IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    DESTROY = 38
    BATCH_FORGET = 42
    RENAME2 = 45


#: Requests the kernel expects no reply to.
NO_REPLY = frozenset({Opcode.FORGET, Opcode.BATCH_FORGET, Opcode.INTERRUPT})

# INIT flags we may accept.
FUSE_BIG_WRITES = 1 << 5
FUSE_AUTO_INVAL_DATA = 1 << 12

# SETATTR valid bits.
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8

ROOT_ID = 1

# len, opcode, unique, nodeid, uid, gid, pid, padding
IN_HEADER = struct.Struct("<IIQQIIII")
# len, error, unique
OUT_HEADER = struct.Struct("<IiQ")
# major, minor, max_readahead, flags
INIT_IN = struct.Struct("<IIII")
# major, minor, max_readahead, flags, max_background, congestion_threshold, max_write,
# time_gran, max_pages, map_alignment, flags2, unused[7]
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")
# ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, nlink,
# uid, gid, rdev, blksize, flags
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
# nodeid, generation, entry_valid, attr_valid, entry_valid_nsec, attr_valid_nsec
ENTRY_HEAD = struct.Struct("<QQQQII")
# attr_valid, attr_valid_nsec, dummy
ATTR_HEAD = struct.Struct("<QII")
# getattr_flags, dummy, fh
GETATTR_IN = struct.Struct("<IIQ")
# valid, padding, fh, size, lock_owner, atime, mtime, ctime, atimensec, mtimensec,
# ctimensec, mode, unused4, uid, gid, unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
# flags, open_flags
OPEN_IN = struct.Struct("<II")
# fh, open_flags, padding
OPEN_OUT = struct.Struct("<QII")
# flags, mode, umask, open_flags
CREATE_IN = struct.Struct("<IIII")
# fh, offset, size, read_flags, lock_owner, flags, padding
READ_IN = struct.Struct("<QQIIQII")
# fh, offset, size, write_flags, lock_owner, flags, padding
WRITE_IN = struct.Struct("<QQIIQII")
# size, padding
WRITE_OUT = struct.Struct("<II")
# fh, flags, release_flags, lock_owner
RELEASE_IN = struct.Struct("<QIIQ")
# fh, fsync_flags, padding
FSYNC_IN = struct.Struct("<QII")
# mode, umask
MKDIR_IN = struct.Struct("<II")
# mode, rdev, umask, padding
MKNOD_IN = struct.Struct("<IIII")
# newdir
RENAME_IN = struct.Struct("<Q")
# newdir, flags, padding
RENAME2_IN = struct.Struct("<QII")
# oldnodeid
LINK_IN = struct.Struct("<Q")
# nlookup
FORGET_IN = struct.Struct("<Q")
# count, dummy
BATCH_FORGET_IN = struct.Struct("<II")
# nodeid, nlookup
FORGET_ONE = struct.Struct("<QQ")
# blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, padding, spare[6]
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
# ino, off, namelen, type (the name follows, padded to 8 bytes)
DIRENT = struct.Struct("<QQII")


def reply(unique: int, error: int = 0, payload: bytes = b"") -> bytes:
    """One reply for request ``unique``: ``error`` is a positive errno (0: success)."""
    return OUT_HEADER.pack(OUT_HEADER.size + len(payload), -error, unique) + payload


def dirent(ino: int, off: int, dtype: int, name: bytes) -> bytes:
    body = DIRENT.pack(ino, off, len(name), dtype) + name
    return body + b"\0" * (-len(body) % 8)
