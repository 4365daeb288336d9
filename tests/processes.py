"""Finding the processes a test started, without psutil: each test marks its launch with
a unique environment variable, which every child and grandchild inherits."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from pathlib import Path

MARK_ENV = "COMPOSER_PAR_TEST_MARK"


def new_mark() -> str:
    return f"composer-par-test-{uuid.uuid4().hex}"


def marked(mark: str) -> list[int]:
    """Pids of live processes whose environment holds ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if f"{MARK_ENV}={mark}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return found


def kill_marked(mark: str) -> None:
    for pid in marked(mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from each process's stat line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found
