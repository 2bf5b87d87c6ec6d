"""``nft_apply.apply`` in its production form: through the daemon's one libnftables
context (``hutch.net.nft_lib``), not the ``nft`` program.

The applying process runs inside the lab's host namespace (``ip netns exec``), so the
library path (``netns=None``) is the one taken and the real host's ruleset is never
touched; what it did is read back with the ``nft`` program, independently of it. One
process applies every script in turn, so later scripts go through a context that
earlier ones (and changes made behind its back) left behind.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from tests.privileged.conftest import REPO, Lab, sh

pytestmark = pytest.mark.privileged

#: Run in the lab's host namespace: applies each script read from stdin (one JSON list
#: per line) and prints one JSON answer per script: "ok" or the NetworkError's text.
APPLIER = r"""
import asyncio, json, sys
from hutch.errors import NetworkError
from hutch.net import nft_apply, nft_lib

async def main():
    for line in sys.stdin:
        script = json.loads(line)
        ran = await nft_lib.run("list tables\n")
        assert ran is not None, "libnftables is missing: the test would prove nothing"
        try:
            await nft_apply.apply(script)
            print(json.dumps("ok"), flush=True)
        except NetworkError as exc:
            print(json.dumps(str(exc)), flush=True)

asyncio.run(main())
"""


def _elements(lab: Lab, table: str) -> list[str]:
    out = sh("ip", "netns", "exec", lab.host, "nft", "-j", "list", "set", "inet", table, "s")
    for item in json.loads(out.stdout)["nftables"]:
        if "set" in item:
            return sorted(str(e) for e in item["set"].get("elem", []))
    raise AssertionError(f"no set s in {out.stdout}")


def test_scripts_apply_atomically_through_one_library_context(lab: Lab) -> None:
    table = f"libtest_{secrets.token_hex(3)}"
    create = (
        f"table inet {table} {{\n  set s {{ type ipv4_addr; }}\n}}\n"
        f"add element inet {table} s {{ 10.1.0.1 }}\n"
    )
    replace = f"flush set inet {table} s\nadd element inet {table} s {{ 10.1.0.2, 10.1.0.3 }}\n"
    # The second line fails: nothing of the script may stay (the flush included).
    refused = f"flush set inet {table} s\nadd element inet {table} nosuchset {{ 10.1.0.9 }}\n"
    applier = subprocess.Popen(
        ["ip", "netns", "exec", lab.host, sys.executable, "-c", APPLIER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert applier.stdin is not None and applier.stdout is not None

    def apply(script: str) -> str:
        assert applier.stdin is not None and applier.stdout is not None
        applier.stdin.write(json.dumps(script) + "\n")
        applier.stdin.flush()
        answer = applier.stdout.readline()
        if not answer:
            raise AssertionError(f"the applier died: {applier.communicate()[1]}")
        return str(json.loads(answer))

    try:
        assert apply(create) == "ok"
        assert _elements(lab, table) == ["10.1.0.1"]
        assert apply(replace) == "ok"
        assert _elements(lab, table) == ["10.1.0.2", "10.1.0.3"]

        answer = apply(refused)
        assert "nftables refused hutch's ruleset (nothing was changed)" in answer
        assert "No such file or directory" in answer, answer  # nft's words for the set
        assert _elements(lab, table) == ["10.1.0.2", "10.1.0.3"]

        # Changed behind the context's back: its next script sees the table as it is.
        sh("ip", "netns", "exec", lab.host, "nft", "delete", "table", "inet", table)
        assert apply(create) == "ok"
        assert _elements(lab, table) == ["10.1.0.1"]
    finally:
        _out, err = applier.communicate(timeout=30)  # closes stdin: the applier ends
        sh("ip", "netns", "exec", lab.host, "nft", "delete", "table", "inet", table, check=False)
    assert applier.returncode == 0, err


#: Run in the lab's host namespace: makes a table with named counters through the
#: library, then lists them through the same context (twice: the output buffer is
#: reused) and a table that is not there; prints what it got as one JSON object.
LISTER = r"""
import asyncio, json, sys
from hutch.net import nft_apply, nft_lib

async def main():
    table = sys.argv[1]
    await nft_apply.apply(
        f"table inet {table} {{\n"
        "  counter c1 { packets 7 bytes 700 }\n"
        "  counter c2 { packets 1 bytes 60 }\n"
        "}\n"
    )
    answers = [await nft_lib.list_json(f"list counters table inet {table}") for _ in range(2)]
    missing = await nft_lib.list_json(f"list counters table inet {table}_gone")
    assert all(a is not None for a in (*answers, missing)), "libnftables is missing"
    print(json.dumps({
        "codes": [a[0] for a in answers],
        "lists": [json.loads(a[1])["nftables"] for a in answers],
        "missing": [missing[0], missing[1], missing[2]],
    }))

asyncio.run(main())
"""


def _counters(items: list[dict[str, object]]) -> dict[str, tuple[object, object]]:
    found = [i["counter"] for i in items if "counter" in i]
    return {str(c["name"]): (c["packets"], c["bytes"]) for c in found}  # type: ignore[index]


def test_listings_come_through_the_same_context_as_the_nft_program_prints_them(
    lab: Lab,
) -> None:
    """``nft_lib.list_json`` (what the counters are read with every couple of seconds)
    gives what ``nft -j`` prints, again on a second call through the same context, and
    a listing of a table that is not there is nft's error, not an empty answer."""
    table = f"libtest_{secrets.token_hex(3)}"
    try:
        ran = subprocess.run(
            ["ip", "netns", "exec", lab.host, sys.executable, "-c", LISTER, table],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            timeout=60,
            check=False,
        )
        assert ran.returncode == 0, ran.stderr
        got = json.loads(ran.stdout)
        program = sh("ip", "netns", "exec", lab.host, "nft", "-j", "list", "counters", "table",
                     "inet", table)  # fmt: skip
        expected = _counters(json.loads(program.stdout)["nftables"])
        assert expected == {"c1": (7, 700), "c2": (1, 60)}
        assert got["codes"] == [0, 0]
        assert [_counters(items) for items in got["lists"]] == [expected, expected]
        code, out, err = got["missing"]
        assert code != 0 and not out.strip() and "No such file or directory" in err
    finally:
        sh("ip", "netns", "exec", lab.host, "nft", "delete", "table", "inet", table, check=False)
