"""bzImage header and ELF parsing on synthetic inputs."""

from __future__ import annotations

import struct

import pytest

from hutch.errors import ImageBuildError
from hutch.images.elf import PAYLOAD_MAGICS, find_payload, parse_elf


def make_bzimage(
    setup_sects: int, payload_offset: int, payload: bytes, version: int = 0x20F
) -> bytes:
    pm_start = ((setup_sects or 4) + 1) * 512
    data = bytearray(pm_start + payload_offset + len(payload))
    data[0x1F1] = setup_sects
    data[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", data, 0x206, version)
    struct.pack_into("<II", data, 0x248, payload_offset, len(payload))
    data[pm_start + payload_offset :] = payload
    return bytes(data)


@pytest.mark.parametrize("compression", sorted(PAYLOAD_MAGICS))
def test_find_payload_locates_each_compressor(compression: str) -> None:
    payload = PAYLOAD_MAGICS[compression] + b"\xaa" * 100
    image = make_bzimage(setup_sects=39, payload_offset=716, payload=payload)
    found = find_payload(image)
    assert found.offset == 40 * 512 + 716  # (setup_sects + 1) * 512 + payload_offset
    assert found.length == len(payload)
    assert found.compression == compression
    assert image[found.offset : found.offset + found.length] == payload


def test_setup_sects_zero_means_four() -> None:
    image = make_bzimage(setup_sects=0, payload_offset=8, payload=PAYLOAD_MAGICS["lz4"] + b"x")
    assert find_payload(image).offset == 5 * 512 + 8


def test_rejects_non_bzimage_and_old_protocol() -> None:
    with pytest.raises(ImageBuildError, match="HdrS"):
        find_payload(b"\0" * 0x300)
    old = make_bzimage(39, 0, PAYLOAD_MAGICS["gzip"] + b"x", version=0x207)
    with pytest.raises(ImageBuildError, match=r"2\.08"):
        find_payload(old)
    with pytest.raises(ImageBuildError, match="too short"):
        find_payload(b"HdrS")


def test_rejects_unknown_payload_magic() -> None:
    with pytest.raises(ImageBuildError, match="unknown magic"):
        find_payload(make_bzimage(39, 0, b"\x11\x22\x33\x44rest"))


def _note(name: bytes, ntype: int, desc: bytes) -> bytes:
    def pad(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return struct.pack("<III", len(name), len(desc), ntype) + pad(name) + pad(desc)


def make_elf(notes: bytes = b"", interp: bool = False, machine: int = 62) -> bytes:
    phdrs: list[tuple[int, int, int]] = []  # (type, offset, size)
    body = bytearray()
    base = 64 + 56 * 2
    if notes:
        phdrs.append((4, base, len(notes)))
        body += notes
    if interp:
        phdrs.append((3, base + len(body), 28))
        body += b"/lib64/ld-linux-x86-64.so.2\0"
    hdr = bytearray(64)
    hdr[:4] = b"\x7fELF"
    hdr[4], hdr[5] = 2, 1
    struct.pack_into("<H", hdr, 0x12, machine)
    struct.pack_into("<Q", hdr, 0x20, 64)
    struct.pack_into("<HH", hdr, 0x36, 56, len(phdrs))
    table = bytearray(56 * 2)
    for i, (ptype, off, size) in enumerate(phdrs):
        struct.pack_into("<IIQ", table, i * 56, ptype, 0, off)
        struct.pack_into("<Q", table, i * 56 + 32, size)
    return bytes(hdr + table + body)


def test_elf_with_pvh_note_is_bootable() -> None:
    notes = _note(b"GNU", 3, b"\x01" * 20) + _note(b"Xen", 18, b"\0\0\0\x01")
    info = parse_elf(make_elf(notes))
    assert info.pvh_bootable
    assert 18 in info.xen_notes
    assert not info.has_interp


def test_elf_without_pvh_note_is_not_bootable() -> None:
    info = parse_elf(make_elf(_note(b"Xen", 6, b"linux\0") + _note(b"GNU", 18, b"abcd")))
    assert not info.pvh_bootable  # type 18 under another owner does not count


def test_dynamic_elf_is_detected() -> None:
    assert parse_elf(make_elf(interp=True)).has_interp


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"MZ" + b"\0" * 100, "not an ELF"),
        (b"\x7fELF\x01\x01" + b"\0" * 100, "64-bit"),
        (make_elf(machine=183), "x86-64"),
        (make_elf(_note(b"Xen", 18, b"abcd"))[:130], "truncated"),
    ],
)
def test_elf_rejects_wrong_files(data: bytes, message: str) -> None:
    with pytest.raises(ImageBuildError, match=message):
        parse_elf(data)
