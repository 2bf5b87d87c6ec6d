"""Entry point: ``python3 -m hutch_agent`` (in the guest, via /opt/hutch/agent.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from hutch_agent import AGENT_VERSION, PROTOCOL_VERSION, runtime
from hutch_agent.core import Agent
from hutch_agent.system import (
    exec_with_fast_copies,
    keep_signal_defaults_for_commands,
    keep_translations_reusable,
)
from hutch_agent.transport import DeviceTransport, UnixTransport, find_port

log = logging.getLogger("hutch-agent")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="hutch guest agent")
    parser.add_argument("--device", help="serial port to use instead of discovering it")
    parser.add_argument(
        "--listen-unix",
        metavar="PATH",
        help="tests only: serve a unix socket; clock and RNG left alone",
    )
    parser.add_argument(
        "--runtime",
        metavar="DIR",
        help="hutch's own runtime is mounted at DIR (an imported image; see runtime.py)",
    )
    args = parser.parse_args(argv)
    runtime.configure(args.runtime)
    keep_signal_defaults_for_commands()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="hutch-agent: %(levelname)s %(message)s"
    )
    transport: DeviceTransport | UnixTransport
    if not args.listen_unix:
        exec_with_fast_copies()
        keep_translations_reusable()
    if args.listen_unix:
        transport = UnixTransport(args.listen_unix)
    else:
        while True:
            try:
                transport = DeviceTransport(args.device or find_port())
                break
            except OSError as exc:
                log.error("cannot open the agent port: %s; retrying", exc)
                time.sleep(1)
    log.info(
        "agent %s (protocol %d.%d) ready, pid %d", AGENT_VERSION, *PROTOCOL_VERSION, os.getpid()
    )
    if not args.listen_unix:
        runtime.start_boot_tasks()
    Agent(transport, vm_mode=not args.listen_unix).run()


if __name__ == "__main__":
    main()
