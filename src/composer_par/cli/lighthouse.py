"""``composer-par lighthouse``: run torchft's lighthouse for fault-tolerant replica groups.

The lighthouse forms each step's quorum of replica groups (the ft plugin's, each group
its own launch). It runs until interrupted (Ctrl-C, SIGTERM) and prints its address once
it listens: the value of the ft plugin's ``lighthouse`` option (or
``$TORCHFT_LIGHTHOUSE``) in every group. torchft (the ``ft`` extra) is imported only when
this command runs; its wheel's own ``torchft_lighthouse`` is the same server.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
import time
from typing import Any

from composer_par.cli.common import EXIT_OK, InputError, Output, bounded_int


def lighthouse_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-replicas", type=bounded_int(1), required=True,
                        help="the fewest replica groups a quorum forms with")
    parser.add_argument("--bind", default="[::]:29510",
                        help="address to listen on, host:port (port 0: a free one; default "
                        "[::]:29510, torchft's)")
    parser.add_argument("--join-timeout-ms", type=bounded_int(0), default=60000,
                        help="how long a quorum waits for groups that heartbeat but have "
                        "not asked to join (default 60000, torchft's)")
    parser.add_argument("--heartbeat-timeout-ms", type=bounded_int(1), default=5000,
                        help="silence after which a group counts as dead (default 5000)")
    parser.add_argument("--quorum-tick-ms", type=bounded_int(1), default=100,
                        help="how often a waiting quorum is checked again (default 100)")
    parser.add_argument("--for", dest="seconds", type=float, default=None, metavar="SECONDS",
                        help="stop after this long (default: run until interrupted)")


def _address(server_address: str, bind: str) -> str:
    """The address groups should use: torchft's, with this host's name when it bound to
    every interface."""
    port = server_address.rsplit(":", 1)[-1]
    host = bind.rsplit(":", 1)[0].strip("[]")
    if host in ("", "::", "0.0.0.0"):
        host = socket.gethostname()
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def run_lighthouse(args: argparse.Namespace, out: Output) -> int:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise InputError(f"the lighthouse needs torchft ({exc}): pip install "
                         "'composer-par[ft]'") from None
    if ":" not in args.bind:
        raise InputError(f"--bind {args.bind!r} is not host:port")
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                      join_timeout_ms=args.join_timeout_ms,
                                      quorum_tick_ms=args.quorum_tick_ms,
                                      heartbeat_timeout_ms=args.heartbeat_timeout_ms)
        except Exception as exc:  # torchft's bind errors are plain RuntimeErrors
            raise InputError(f"cannot start the lighthouse on {args.bind}: {exc}") from None
        address = _address(server.address(), args.bind)
        out.result({"ok": True, "address": address, "bind": args.bind,
                    "min_replicas": args.min_replicas,
                    "join_timeout_ms": args.join_timeout_ms,
                    "heartbeat_timeout_ms": args.heartbeat_timeout_ms},
                   f"lighthouse listening at {address} (min_replicas {args.min_replicas}); "
                   f"give it to each replica group as TORCHFT_LIGHTHOUSE={address}")
        out.stdout.flush()
        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        while not stop.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            stop.wait(0.5 if left is None else min(0.5, left))
        server.shutdown()
        out.note("lighthouse stopped")
        return EXIT_OK
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["lighthouse_arguments", "run_lighthouse"]
