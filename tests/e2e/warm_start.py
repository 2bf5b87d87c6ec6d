"""``python tests/e2e/warm_start.py``: a hutchd interpreter started ahead of time.

Importing hutch's daemon (FastAPI, uvicorn, the VM layer) takes about 1.6 s of CPU on
these machines, most of a daemon's start. A test lab that restarts its daemon tens of
times (``tests/e2e/test_crash_points.py`` restarts it twice per crash point) has the
next interpreter spawned while it works: this script imports everything, then waits for
one line on stdin, the daemon's whole environment as JSON, and then runs exactly what
``python -m hutch daemon`` runs (the CLI's ``daemon`` command) in that environment. No
hutch module reads the environment at import time, so nothing of the daemon differs.

EOF on stdin instead of a line (the test ended, or nobody needs this start): exit 0.
"""

from __future__ import annotations

import json
import os
import sys

import hutch.daemon  # noqa: F401  (the slow import, done before the go)
from hutch.cli.main import main


def _go() -> None:
    line = sys.stdin.readline()
    if not line.strip():
        return
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
    # The daemon reads nothing from stdin; give it what `Daemon.start` gives a cold one.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = ["hutch", "daemon"]
    main()


if __name__ == "__main__":
    _go()
