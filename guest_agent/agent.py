#!/usr/bin/env python3
"""Launcher of the hutch guest agent (the ``hutch_agent`` package next to this file).

The guest runs ``python3 -I /opt/hutch/agent.py``: isolated mode keeps PYTHONPATH and the
user's site-packages out, so the package is found from this file's own directory.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hutch_agent.__main__ import main

if __name__ == "__main__":
    main()
