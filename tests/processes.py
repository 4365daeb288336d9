"""Finding the processes a test started, without psutil: each test marks its launch with
a unique environment variable, which every child and grandchild inherits."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

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


@dataclasses.dataclass
class Watched:
    """A finished launch: exit code, when it ended, its stderr lines with the time each
    arrived, and the marked processes still alive when it ended."""

    code: int
    ended: float
    lines: list[tuple[float, str]]
    left: list[int]

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, text: str) -> float:
        """When the first stderr line holding ``text`` arrived."""
        return next(t for t, line in self.lines if text in line)


def run_watched(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float,
                stdout: Any = subprocess.DEVNULL) -> Watched:
    """Run ``argv`` marked, timestamping each stderr line; afterwards kill whatever it
    left, having first recorded it."""
    mark = new_mark()
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env={**env, MARK_ENV: mark}) as run:
        assert run.stderr is not None
        stream = run.stderr
        reader = threading.Thread(target=lambda: lines.extend(
            (time.monotonic(), line) for line in stream), daemon=True)
        reader.start()
        try:
            code = run.wait(timeout=timeout)
            ended = time.monotonic()
            reader.join(timeout=10)
            left = marked(mark)
        finally:
            run.kill()
            kill_marked(mark)
    return Watched(code, ended, lines, left)
