"""The guest agent's watch decisions (``hutch_agent.ops_watch.Watcher``) on raw inotify
events, without a guest: when a rename's first half counts as a delete."""

from __future__ import annotations

import sys
from pathlib import Path

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "guest_agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from hutch_agent import inotify  # noqa: E402
from hutch_agent.ops_watch import MAX_HOLD_S, MOVE_PAIR_S, Watcher  # noqa: E402


def _watcher(tmp_path: Path) -> tuple[Watcher, int, int]:
    (tmp_path / "sub").mkdir()
    ino = inotify.Inotify()
    watcher = Watcher(None, ino, str(tmp_path), recursive=True)  # type: ignore[arg-type]
    watcher.add_tree(str(tmp_path), announce=False)
    wds = {path: wd for wd, path in ino.paths.items()}
    return watcher, wds[str(tmp_path)], wds[str(tmp_path / "sub")]


def test_a_rename_read_in_two_halves_stays_one_rename_however_slow_the_agent(
    tmp_path: Path,
) -> None:
    """A read can fall between a rename's two halves, and a stalled guest's clock moves on
    while the second waits in the queue: only waiting on an empty queue (or the longest
    hold) turns the first half into a delete. Once reported `deleted` + `created`
    (tests/vm/test_ladder.py::test_watch_sees_a_file_created_by_exec[forked], loaded host)."""
    watcher, root_wd, sub_wd = _watcher(tmp_path)
    try:
        watcher.handle(inotify.RawEvent(sub_wd, inotify.IN_MOVED_FROM, 7, "new.txt"), 0.0)
        watcher.expire_moves(now=MOVE_PAIR_S * 10, idle=False)  # busy, not waiting
        assert watcher.out == []
        watcher.handle(inotify.RawEvent(root_wd, inotify.IN_MOVED_TO, 7, "moved.txt"), 0.6)
        assert [(e["type"], e["from"], e["to"]) for e in watcher.out] == [
            ("renamed", str(tmp_path / "sub" / "new.txt"), str(tmp_path / "moved.txt"))
        ]
    finally:
        watcher.ino.close()


def test_a_move_out_of_the_tree_is_a_delete_after_an_idle_wait_or_the_longest_hold(
    tmp_path: Path,
) -> None:
    watcher, _root_wd, sub_wd = _watcher(tmp_path)
    try:
        watcher.handle(inotify.RawEvent(sub_wd, inotify.IN_MOVED_FROM, 1, "a"), 0.0)
        watcher.expire_moves(now=MOVE_PAIR_S / 2, idle=True)
        assert watcher.out == []
        watcher.expire_moves(now=MOVE_PAIR_S, idle=True)
        assert [e["type"] for e in watcher.out] == ["deleted"]
        watcher.out.clear()
        watcher.handle(inotify.RawEvent(sub_wd, inotify.IN_MOVED_FROM, 2, "b"), 0.0)
        watcher.expire_moves(now=MAX_HOLD_S, idle=False)  # events never stop coming
        assert [(e["type"], e["path"]) for e in watcher.out] == [
            ("deleted", str(tmp_path / "sub" / "b"))
        ]
    finally:
        watcher.ino.close()
