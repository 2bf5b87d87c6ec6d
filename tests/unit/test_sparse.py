"""Sparse files sent as their non-zero extents (hutch.storage.sparse): holes and zero
pages stay behind, the file comes back byte for byte with holes in their place, and a
layout or data that does not add up is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hutch.storage.sparse import MERGE_GAP, PAGE, SparseLayout, pack, scan, unpack

MiB = 1 << 20


def _sparse(path: Path, size: int, data: dict[int, bytes]) -> Path:
    with path.open("wb") as f:
        f.truncate(size)
        for at, chunk in data.items():
            f.seek(at)
            f.write(chunk)
    return path


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_only_non_zero_pages_are_packed_and_come_back_in_place(tmp_path: Path) -> None:
    rnd = os.urandom(3 * PAGE)
    src = _sparse(
        tmp_path / "memory.ram",
        64 * MiB,
        {MiB: rnd, 8 * MiB: bytes(MiB), 20 * MiB: b"x", 64 * MiB - PAGE: b"end"},
    )
    layout = pack(src, tmp_path / "packed")
    # The zero MiB (data on disk, zeros in content) is not sent; a page with one byte is.
    assert layout.extents == ((MiB, 3 * PAGE), (20 * MiB, PAGE), (64 * MiB - PAGE, PAGE))
    assert (tmp_path / "packed").stat().st_size == layout.data_size == 5 * PAGE
    out = tmp_path / "again"
    unpack(tmp_path / "packed", layout, out)
    assert out.read_bytes() == src.read_bytes()
    assert _allocated(out) <= 8 * PAGE  # holes where the zeros were (a MiB of them)
    with pytest.raises(FileExistsError):  # never written over
        unpack(tmp_path / "packed", layout, out)


def test_runs_closer_than_the_merge_gap_go_as_one_extent(tmp_path: Path) -> None:
    near = MERGE_GAP - PAGE  # the gap between the two pages below
    src = _sparse(tmp_path / "f", 4 * MiB, {0: b"a", PAGE + near: b"b", 2 * MiB: b"c"})
    layout = scan(src)
    assert layout.extents == ((0, 2 * PAGE + near), (2 * MiB, PAGE))
    assert scan(src, merge_gap=PAGE).extents == ((0, PAGE), (PAGE + near, PAGE), (2 * MiB, PAGE))


def test_an_empty_or_all_hole_file_packs_to_nothing(tmp_path: Path) -> None:
    src = _sparse(tmp_path / "f", 16 * MiB, {})
    layout = pack(src, tmp_path / "packed")
    assert layout == SparseLayout(16 * MiB, ())
    unpack(tmp_path / "packed", layout, tmp_path / "out")
    assert (tmp_path / "out").stat().st_size == 16 * MiB and _allocated(tmp_path / "out") == 0


def test_a_file_whose_size_is_not_whole_pages(tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"\0" * PAGE + b"tail")
    layout = pack(src, tmp_path / "packed")
    assert layout.extents == ((PAGE, 4),)
    unpack(tmp_path / "packed", layout, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == src.read_bytes()


@pytest.mark.parametrize(
    "obj",
    [
        {"size": 10, "extents": [[0, 4], [2, 4]]},  # overlapping
        {"size": 10, "extents": [[4, 2], [0, 2]]},  # out of order
        {"size": 10, "extents": [[8, 4]]},  # past the end
        {"size": 10, "extents": [[0, 0]]},  # empty
        {"size": -1, "extents": []},
        {"size": 10, "extents": [[0, True]]},
        {"size": 10, "extents": "0-4"},
        [10],
    ],
)
def test_a_layout_that_does_not_add_up_is_refused(obj: object) -> None:
    with pytest.raises(ValueError):
        SparseLayout.from_json(obj)


def test_data_of_another_size_than_the_layout_is_refused(tmp_path: Path) -> None:
    (tmp_path / "packed").write_bytes(b"abc")
    with pytest.raises(ValueError, match="holds 3 bytes"):
        unpack(tmp_path / "packed", SparseLayout(10, ((0, 4),)), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert SparseLayout.from_json(SparseLayout(10, ((0, 4),)).to_json()) == SparseLayout(
        10, ((0, 4),)
    )
