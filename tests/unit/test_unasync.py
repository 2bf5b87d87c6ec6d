"""The blocking SDK shells are generated from the asyncio ones (``scripts/unasync.py``):
the committed ``_sync/`` must be exactly what the script writes, and the two APIs must
match name for name."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest

import hutch.sdk

REPO = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync", REPO / "scripts" / "unasync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["unasync"] = module
    spec.loader.exec_module(module)
    return module


def test_the_generated_sync_shells_are_up_to_date() -> None:
    unasync = load_script()
    stale = unasync.stale(unasync.generate())
    assert not stale, (
        f"stale generated files {[str(p.relative_to(REPO)) for p in stale]}: edit "
        "src/hutch/sdk/_async/ and run `python scripts/unasync.py`"
    )


def test_the_token_rules() -> None:
    unasync = load_script()
    source = (
        "from hutch.sdk import _io_async as _io\n"
        "from hutch.sdk._async.client import AsyncClient\n"
        "class AsyncThing(AsyncClosesOnExit):\n"
        "    async def __aenter__(self) -> AsyncThing:\n"
        "        async with x as y:\n"
        "            return [c async for c in await anext(self._it)]\n"
        "    async def aclose(self) -> None:  # noqa: ASYNC109\n"
        "        raise StopAsyncIteration(httpx.AsyncBaseTransport, r.aiter_bytes())\n"
        "    close = aclose  # unasync: drop\n"
    )
    assert unasync.unasync(source) == (
        "from hutch.sdk import _io_sync as _io\n"
        "from hutch.sdk._sync.client import Client\n"
        "class Thing(ClosesOnExit):\n"
        "    def __enter__(self) -> Thing:\n"
        "        with x as y:\n"
        "            return [c for c in next(self._it)]\n"
        "    def close(self) -> None:\n"
        "        raise StopIteration(httpx.BaseTransport, r.iter_bytes())\n"
    )


def test_a_stale_file_is_reported(tmp_path: Path) -> None:
    unasync = load_script()
    files = unasync.generate()
    first = next(iter(files))
    changed = {**files, first: files[first] + "# drift\n"}
    assert unasync.stale(changed) == [first]


ASYNC_NAMES = sorted(n for n in hutch.sdk.__all__ if n.startswith("Async") and n != "AsyncClient")


@pytest.mark.parametrize("name", [*ASYNC_NAMES, "AsyncClient"])
def test_each_async_class_has_a_sync_twin_with_the_same_api(name: str) -> None:
    async_cls = getattr(hutch.sdk, name)
    sync_cls = getattr(hutch.sdk, name.removeprefix("Async"))
    renamed = {"__aenter__": "__enter__", "__aexit__": "__exit__", "__aiter__": "__iter__",
               "__anext__": "__next__", "aclose": "close"}  # fmt: skip
    for attr, member in vars(async_cls).items():
        if attr.startswith("_") and attr not in renamed:
            continue
        twin = getattr(sync_cls, renamed.get(attr, attr), None)
        assert twin is not None, f"{sync_cls.__name__} lacks {attr}"
        if callable(member) and not isinstance(member, type):
            got = list(inspect.signature(twin).parameters)
            want = list(inspect.signature(member).parameters)
            assert got == want, f"{name}.{attr}: {want} vs {got}"
