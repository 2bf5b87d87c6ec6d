"""``replace_dir`` (``hutch.images.cache``): a directory put in place of another so that
a crash at any moment leaves the old one or the new one, whole: the atomic exchange,
and the fallback where a file system cannot exchange (renamed aside, then in), whose
crash between the two renames the next start repairs (``restore_replaced``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hutch.images import cache
from hutch.images.cache import replace_dir, restore_replaced


def _dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "f").write_text(text)
    return path


def test_an_existing_directory_is_exchanged_and_the_old_one_handed_back(tmp_path: Path) -> None:
    final, new = _dir(tmp_path / "d", "old"), _dir(tmp_path / ".d.fetch-1", "new")
    old = replace_dir(new, final)
    assert (final / "f").read_text() == "new"
    assert old == new and (old / "f").read_text() == "old"


def test_a_missing_directory_is_renamed_in(tmp_path: Path) -> None:
    new = _dir(tmp_path / ".d.fetch-1", "new")
    assert replace_dir(new, tmp_path / "d") is None
    assert (tmp_path / "d" / "f").read_text() == "new" and not new.exists()


def test_without_the_exchange_a_crash_between_the_renames_is_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache, "_exchange", lambda a, b: False)
    final, new = _dir(tmp_path / "d", "old"), _dir(tmp_path / ".d.fetch-1", "new")
    old = replace_dir(new, final)
    assert old is not None and old.name.startswith(".d.old-")
    assert (final / "f").read_text() == "new" and (old / "f").read_text() == "old"
    assert restore_replaced(final) == [old]  # complete: the aside is the caller's to remove

    # The crash: the old one renamed aside, the new one not yet in.
    final.rename(tmp_path / ".d.fetch-2")
    assert not final.exists()
    assert restore_replaced(final) == []
    assert (final / "f").read_text() == "old"  # the old one back, whole
