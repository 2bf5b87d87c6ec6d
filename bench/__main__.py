"""``python -m bench [names...] [--quick]`` from the repository root; see README.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# Run from a checkout without `pip install -e .`: the daemon subprocess gets the same path.
if importlib.util.find_spec("hutch") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from bench.run import main

if __name__ == "__main__":
    sys.exit(main())
