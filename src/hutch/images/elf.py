"""Pure parsers for the kernel formats the builder handles: the x86 bzImage setup header
and ELF64 program headers/notes. Bytes in, facts out; no I/O, so they are unit-tested on
synthetic inputs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from hutch.errors import ImageBuildError

__all__ = [
    "PAYLOAD_MAGICS",
    "BzImagePayload",
    "ElfInfo",
    "find_payload",
    "needed_libraries",
    "parse_elf",
]

#: Leading bytes of each compressor the kernel can use for its payload.
PAYLOAD_MAGICS: dict[str, bytes] = {
    "lz4": bytes.fromhex("02214c18"),  # LZ4 legacy frame, as the kernel writes it
    "gzip": bytes.fromhex("1f8b"),
    "xz": bytes.fromhex("fd377a585a00"),
    "zstd": bytes.fromhex("28b52ffd"),
}

_PT_INTERP = 3
_PT_NOTE = 4
_XEN_ELFNOTE_PHYS32_ENTRY = 18  # the note that makes a vmlinux bootable through PVH


@dataclass(frozen=True)
class BzImagePayload:
    """Where the compressed kernel ELF sits inside a bzImage, in bytes from file start."""

    offset: int
    length: int
    compression: str


def find_payload(header: bytes) -> BzImagePayload:
    """Locate the compressed payload of a bzImage (``header`` = at least its setup code
    plus the payload's first bytes; the whole file is fine).

    Boot protocol: ``setup_sects`` at 0x1f1 (0 means 4), ``HdrS`` at 0x202, version at
    0x206 (>= 2.08 has the payload fields), ``payload_offset``/``payload_length`` at
    0x248/0x24c relative to the protected-mode code, which starts at
    ``(setup_sects + 1) * 512``. Raises ``ImageBuildError`` on anything else.
    """
    if len(header) < 0x250:
        raise ImageBuildError(f"bzImage too short ({len(header)} bytes) for a setup header")
    if header[0x202:0x206] != b"HdrS":
        raise ImageBuildError("not a bzImage: no 'HdrS' signature at 0x202")
    (version,) = struct.unpack_from("<H", header, 0x206)
    if version < 0x208:
        raise ImageBuildError(
            f"bzImage boot protocol {version >> 8}.{version & 0xFF} predates payload fields "
            "(needs >= 2.08)"
        )
    setup_sects = header[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", header, 0x248)
    offset = (setup_sects + 1) * 512 + payload_offset
    head = header[offset : offset + 8]
    if len(head) < 4:
        raise ImageBuildError(f"bzImage payload offset {offset} is past the data given")
    for name, magic in PAYLOAD_MAGICS.items():
        if head.startswith(magic):
            return BzImagePayload(offset=offset, length=payload_length, compression=name)
    raise ImageBuildError(f"bzImage payload at {offset} has an unknown magic {head.hex()}")


@dataclass(frozen=True)
class ElfInfo:
    """What the builder checks in an ELF64 little-endian x86-64 file."""

    has_interp: bool  # dynamically linked (has PT_INTERP)
    xen_notes: frozenset[int]  # types of the notes owned by "Xen"

    @property
    def pvh_bootable(self) -> bool:
        return _XEN_ELFNOTE_PHYS32_ENTRY in self.xen_notes


def _notes(seg: bytes) -> list[tuple[bytes, int]]:
    out: list[tuple[bytes, int]] = []
    pos = 0
    while pos + 12 <= len(seg):
        namesz, descsz, ntype = struct.unpack_from("<III", seg, pos)
        pos += 12
        name = seg[pos : pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        pos += (descsz + 3) & ~3
        if pos > len(seg):
            break
        out.append((name, ntype))
    return out


def parse_elf(data: bytes) -> ElfInfo:
    """Parse an ELF64 LE x86-64 file's program headers. Raises ``ImageBuildError`` when
    ``data`` is not one (wrong magic, class, machine, or truncated headers)."""
    if data[:4] != b"\x7fELF":
        raise ImageBuildError("not an ELF file (no \\x7fELF magic)")
    if data[4] != 2 or data[5] != 1:
        raise ImageBuildError("not a 64-bit little-endian ELF file")
    (machine,) = struct.unpack_from("<H", data, 0x12)
    if machine != 62:
        raise ImageBuildError(f"ELF machine is {machine}, not x86-64 (62)")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phentsize < 56 or phoff + phnum * phentsize > len(data):
        raise ImageBuildError("ELF program headers are truncated")
    has_interp = False
    xen: set[int] = set()
    for i in range(phnum):
        base = phoff + i * phentsize
        (ptype,) = struct.unpack_from("<I", data, base)
        (p_offset,) = struct.unpack_from("<Q", data, base + 8)
        (p_filesz,) = struct.unpack_from("<Q", data, base + 32)
        if p_offset + p_filesz > len(data):
            raise ImageBuildError(f"ELF segment {i} runs past the end of the file (truncated)")
        if ptype == _PT_INTERP:
            has_interp = True
        elif ptype == _PT_NOTE:
            for name, ntype in _notes(data[p_offset : p_offset + p_filesz]):
                if name == b"Xen":
                    xen.add(ntype)
    return ElfInfo(has_interp=has_interp, xen_notes=frozenset(xen))


_PT_LOAD = 1
_PT_DYNAMIC = 2
_DT_NEEDED = 1
_DT_STRTAB = 5


def needed_libraries(data: bytes) -> list[str]:
    """The ``DT_NEEDED`` sonames of an ELF64 LE x86-64 file, in order (empty for a
    static one). Raises ``ImageBuildError`` when the dynamic section is malformed."""
    parse_elf(data)  # the header checks
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None
    for i in range(phnum):
        base = phoff + i * phentsize
        (ptype,) = struct.unpack_from("<I", data, base)
        p_offset, p_vaddr = struct.unpack_from("<QQ", data, base + 8)
        (p_filesz,) = struct.unpack_from("<Q", data, base + 32)
        if ptype == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif ptype == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    needed: list[int] = []
    strtab_vaddr: int | None = None
    offset, size = dynamic
    for pos in range(offset, min(offset + size, len(data) - 15), 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == 0:
            break
        if tag == _DT_NEEDED:
            needed.append(value)
        elif tag == _DT_STRTAB:
            strtab_vaddr = value
    if not needed:
        return []
    if strtab_vaddr is None:
        raise ImageBuildError("ELF dynamic section has DT_NEEDED but no DT_STRTAB")
    strtab = next(
        (off + strtab_vaddr - va for va, off, sz in loads if va <= strtab_vaddr < va + sz), None
    )
    if strtab is None:
        raise ImageBuildError("ELF DT_STRTAB is outside every loaded segment")
    names = []
    for index in needed:
        start = strtab + index
        end = data.find(b"\0", start)
        if start >= len(data) or end < 0:
            raise ImageBuildError("ELF DT_NEEDED name runs past the end of the file")
        names.append(data[start:end].decode("ascii", "replace"))
    return names
