"""Finding the lighthouse: its address, and whether anything answers there.

torchft's lighthouse is a gRPC server that forms each step's quorum of replica groups
(``composer-par lighthouse``, or torchft's own ``torchft_lighthouse``). A replica group
whose lighthouse does not answer would otherwise fail deep inside torchft's first quorum;
:func:`wait_for_lighthouse` fails first, naming the address and the way to start one.
Pure standard library: no torch.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

# torchft's own variable for the lighthouse's address (its examples and Manager read it).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class LighthouseUnreachable(ConnectionError):
    """Nothing answered at the lighthouse's address within the plan's timeout."""


def lighthouse_address(option: str | None) -> str:
    """The lighthouse's address as torchft takes it (``http://host:port``): the option,
    else ``$TORCHFT_LIGHTHOUSE``; ValueError naming both when neither says."""
    value = option if option is not None else os.environ.get(LIGHTHOUSE_ENV)
    if not value:
        raise ValueError(
            "the ft plugin needs the lighthouse's address: set its lighthouse option (e.g. "
            f'lighthouse = "http://host:29510") or ${LIGHTHOUSE_ENV}; start one with '
            "`composer-par lighthouse --min-replicas N`")
    return normalize(value)


def normalize(value: str) -> str:
    """``host:port`` or ``http://host:port`` as ``http://host:port``; ValueError otherwise."""
    text = value.strip()
    url = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme not in ("http", "https") or not url.hostname or port is None:
        raise ValueError(f"lighthouse address {value!r} is not host:port or http://host:port")
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    return f"{url.scheme}://{host}:{port}"


def wait_for_lighthouse(address: str, timeout_s: float, *, interval_s: float = 0.5) -> None:
    """Return once a TCP connection to ``address`` opens; after ``timeout_s`` seconds of
    refusals raise :class:`LighthouseUnreachable` naming the address, the last error and
    the fix. A lighthouse started a little after its replica groups is waited for."""
    url = urlsplit(address)
    host, port = url.hostname or "", url.port or 0
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError as exc:
            error = exc
        if time.monotonic() + interval_s >= deadline:
            raise LighthouseUnreachable(
                f"no torchft lighthouse answers at {address} (waited {timeout_s:g} s, the "
                f"plan's timeout; last error: {error.strerror or error}): start one with "
                "`composer-par lighthouse --min-replicas N --bind [::]:PORT` (or torchft's "
                f"torchft_lighthouse), and give its address as the ft plugin's lighthouse "
                f"option or ${LIGHTHOUSE_ENV}")
        time.sleep(interval_s)


__all__ = ["LIGHTHOUSE_ENV", "LighthouseUnreachable", "lighthouse_address", "normalize",
           "wait_for_lighthouse"]
