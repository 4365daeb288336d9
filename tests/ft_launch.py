"""Replica groups of real gloo ranks and a real lighthouse, for the ft plugin's tests.

Each replica group is one launch, as torchrun would make it: its ranks (processes forked
from a server with torch preloaded), its own TCPStore (hosted by its rank 0, as torchrun's
``MASTER_ADDR`` / ``MASTER_PORT``), its own default process group. The lighthouse is the
real ``composer-par lighthouse`` command. Whatever a test starts here it stops: ranks by
SIGKILL (the death the tests inflict too), the lighthouse by SIGTERM then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

PG_TIMEOUT_S = 120.0


# -- the lighthouse -----------------------------------------------------------------------


@contextlib.contextmanager
def lighthouse(*, min_replicas: int = 1, heartbeat_timeout_ms: int = 2000,
               join_timeout_ms: int = 1000, startup_s: float = 120.0,
               log: Path | None = None) -> Iterator[str]:
    """The real ``composer-par lighthouse`` on a free local port; yields its address.
    ``log``: where its stderr goes."""
    errors = log.open("ab") if log is not None else subprocess.DEVNULL
    try:
        address, process = start_lighthouse(
            min_replicas=min_replicas, heartbeat_timeout_ms=heartbeat_timeout_ms,
            join_timeout_ms=join_timeout_ms, startup_s=startup_s, stderr=errors)
        try:
            yield address
        finally:
            stop(process)
    finally:
        if log is not None:
            errors.close()  # type: ignore[union-attr]


def start_lighthouse(*, min_replicas: int = 1, heartbeat_timeout_ms: int = 2000,
                     join_timeout_ms: int = 1000, startup_s: float = 120.0,
                     stderr: Any = subprocess.DEVNULL) -> tuple[str, subprocess.Popen[str]]:
    """Start the lighthouse; (its address, its process), which the caller stops."""
    exe = Path(sys.executable).with_name("composer-par")
    argv = [str(exe), "lighthouse", "--json", "--bind", "127.0.0.1:0",
            "--min-replicas", str(min_replicas),
            "--heartbeat-timeout-ms", str(heartbeat_timeout_ms),
            "--join-timeout-ms", str(join_timeout_ms), "--quorum-tick-ms", "50"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        return json.loads(_read_document(process, startup_s))["address"], process
    except BaseException:
        stop(process)
        raise


def _read_document(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The one JSON document ``--json`` prints once the lighthouse listens."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the lighthouse exited ({process.poll()}) before listening")
        lines.append(line)
        if line.startswith("}"):
            return "".join(lines)
    raise RuntimeError("the lighthouse did not report its address in time")


def stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


def quorum_status(address: str) -> str:
    """The lighthouse's own status page: why the next quorum is (not) ready."""
    import urllib.request

    with urllib.request.urlopen(f"{address}/status", timeout=10) as page:
        return page.read().decode(errors="replace")


# -- replica groups -----------------------------------------------------------------------


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # Only takes effect if no forkserver runs yet (the harness preloads the same).
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class Group:
    """One launch of a replica group: ``ranks`` processes running ``fn(*args)`` once the
    group's process group is up. ``name`` tells its files apart in ``rundir``."""

    def __init__(self, name: str, ranks: int, fn: Callable[..., Any], args: tuple[Any, ...],
                 rundir: Path, env: dict[str, str], kwargs: dict[str, Any] | None = None
                 ) -> None:
        self.name = name
        self.rundir = rundir
        ctx = _context()
        self.processes = [
            ctx.Process(target=_rank_main, name=f"{name}-rank{rank}",
                        args=(fn, args, kwargs or {}, name, rank, ranks, str(rundir),
                              {**os.environ, **env}))
            for rank in range(ranks)]
        for process in self.processes:
            process.start()

    def kill(self) -> None:
        """SIGKILL every rank (a whole group dying at once)."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(10)

    def wait(self, timeout_s: float) -> None:
        """Wait for every rank to exit 0; raise with every rank's log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in self.processes]
        if codes != [0] * len(codes):
            self.kill()
            raise AssertionError(f"replica group {self.name} exit codes {codes}\n"
                                 + self.logs())

    def logs(self) -> str:
        out = []
        for rank in range(len(self.processes)):
            path = self.rundir / f"{self.name}-rank{rank}.log"
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            out.append(f"--- {path.name} ---\n{text[-6000:]}")
        return "\n".join(out)


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               name: str, rank: int, world: int, rundir: str, env: dict[str, str]) -> None:
    """A rank: its log, the group's TCPStore (rank 0 hosts it), the process group, ``fn``."""
    import faulthandler

    log = os.open(Path(rundir) / f"{name}-rank{rank}.log",
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.dup2(log, 1)
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    port_file = Path(rundir) / f"{name}.port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=PG_TIMEOUT_S))
        partial = port_file.with_suffix(".partial")
        partial.write_text(str(store.port))
        partial.rename(port_file)
        port = store.port
    else:
        deadline = time.monotonic() + PG_TIMEOUT_S
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{port_file} never appeared")
            time.sleep(0.05)
        port = int(port_file.read_text())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=timedelta(seconds=PG_TIMEOUT_S))
    # What torchrun gives each worker: torchft's manager meets its group in this store.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        fn(*args, **kwargs)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's manager server and transports hold threads: leave without joining them.
    os._exit(0)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float,
             groups: tuple[Group, ...] = ()) -> None:
    """Poll ``check`` until true; on timeout raise naming ``what`` with the groups' logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        for group in groups:
            dead = [p for p in group.processes if p.exitcode not in (None, 0)]
            if dead:
                raise AssertionError(f"while waiting for {what}: group {group.name} lost "
                                     f"a rank ({dead[0].exitcode})\n{group.logs()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n"
                         + "\n".join(g.logs() for g in groups))
