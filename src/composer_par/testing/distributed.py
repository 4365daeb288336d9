"""Run a function on real ``torch.distributed`` ranks, one process each, on CPU.

Every distributed test of the project goes through :func:`run_ranks`, so it is
built for a small shared machine and for failures that are easy to read:

* Ranks are forked from a forkserver that has torch preloaded: importing torch
  costs seconds, forking costs milliseconds.
* Rendezvous goes through a ``FileStore`` in a fresh temp dir, never a TCP
  port, so concurrent runs (threads, pytest-xdist workers) cannot collide.
* A rank that raises, dies or hangs becomes a :class:`RankFailure` or
  :class:`RankTimeout` carrying every rank's traceback, Python stacks and
  stderr tail, and no rank process outlives the call.

This module imports torch only inside the rank processes, so importing it (and
the pytest plugin built on it) is free.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = ["RankFailure", "RankTimeout", "run_ranks"]

# How long the other ranks get to report once one rank failed: enough for a
# sibling blocked in a collective to see the broken connection and say so.
_FAILURE_GRACE_S = 2.5
# Upper bound on waiting for faulthandler to write the stacks asked for by
# SIGUSR1; the dump is done by a C signal handler, so it normally takes ms and
# the wait ends as soon as every log has grown, but a loaded machine may not
# schedule a rank for a while.
_STACK_DUMP_WAIT_S = 3.0
# Collectives time out a little after the run does, so that a hang is reported
# by the harness, with every rank's stack, rather than by one rank's gloo error.
_PG_TIMEOUT_MARGIN_S = 5.0
_PG_TIMEOUT_MAX_S = 1800.0
# Bytes of each rank's log (stderr plus faulthandler dumps) quoted in errors.
_LOG_TAIL_BYTES = 8000
_PR_SET_PDEATHSIG = 1


class RankFailure(Exception):
    """One or more ranks raised or died.

    The message holds every failing rank's traceback or exit status and stderr
    tail, then the stacks of the ranks that were still running.
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        #: The ranks that failed (or, for a timeout, had not finished), first failure first.
        self.failed_ranks = failed_ranks

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failed_ranks))


class RankTimeout(RankFailure):
    """The run exceeded its timeout; the message holds every live rank's Python stacks."""


@dataclass(frozen=True)
class _Job:
    """What each rank process needs; pickled to it by multiprocessing."""

    fn: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    world_size: int
    backend: str
    store_path: str
    rundir: str
    pg_timeout_s: float
    env: dict[str, str]
    threads_per_rank: int

    def log_path(self, rank: int) -> Path:
        return Path(self.rundir) / f"rank{rank}.log"


@dataclass
class _Rank:
    """The parent's view of one rank process."""

    rank: int
    process: multiprocessing.process.BaseProcess
    reader: Connection
    log_path: Path
    # The rank has initialized the default process group.
    joined: bool = False
    # ("ok", value) or ("error", traceback), and the rank's time.monotonic() at that point.
    report: tuple[str, Any, float] | None = None
    # The result pipe closed without a report: the rank died (its exit status
    # comes separately, through the process sentinel).
    eof: bool = False
    exitcode: int | None = None
    # Position in the order in which failures were seen; the first is reported first.
    failed_at: int | None = None

    @property
    def done(self) -> bool:
        return self.report is not None or self.exitcode is not None

    @property
    def failed(self) -> bool:
        if self.report is not None:
            return self.report[0] != "ok"
        return self.eof or self.exitcode is not None

    @property
    def running(self) -> bool:
        return not self.done and not self.eof


def run_ranks(
    fn: Callable[..., Any] | str,
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    workdir: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their values in rank order.

    ``fn`` is a module-level function or a ``"module:qualname"`` string; it runs
    after the default process group is initialized, and its return value must be
    picklable. ``timeout`` bounds, separately, the start (until every rank has
    initialized the process group) and the call of ``fn``, so that a cold
    forkserver importing torch or a loaded machine does not eat into the time
    of ``fn``. ``env`` is applied on top of this process's environment and
    torchrun's variables.

    Raises :class:`RankFailure` if a rank raises or dies before returning, and
    :class:`RankTimeout` if not every rank has returned after ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be at least 1, got {threads_per_rank}")
    ctx = _context()
    rundir = Path(tempfile.mkdtemp(prefix="ranks-", dir=workdir))
    job = _Job(
        fn=_fn_spec(fn),
        args=args,
        kwargs=kwargs or {},
        world_size=world_size,
        backend=backend,
        store_path=str(rundir / "store"),
        rundir=str(rundir),
        pg_timeout_s=min(timeout + _PG_TIMEOUT_MARGIN_S, _PG_TIMEOUT_MAX_S),
        # The forkserver's environment is frozen at its start; send the current one.
        env={**os.environ, **_torchrun_env(world_size, threads_per_rank), **(env or {})},
        threads_per_rank=threads_per_rank,
    )
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            # Non-daemonic, so that a rank may start worker processes of its own.
            process = ctx.Process(
                target=_rank_main, args=(job, rank, writer), name=f"rank{rank}", daemon=False
            )
            ranks.append(_Rank(rank, process, reader, job.log_path(rank)))
            # The parent must drop its copy of the write end, or a dead rank's
            # pipe would never reach EOF.
            with writer:
                process.start()
        return _supervise(ranks, timeout)
    finally:
        _reap(ranks)
        shutil.rmtree(rundir, ignore_errors=True)


def _context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # "__main__" is the default preload: ranks re-import the parent's main
    # script anyway (spawn semantics), so loading it once in the server is cheaper.
    # This only takes effect if the forkserver is not running yet.
    # This module too: ranks unpickle their entry point from it.
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed", __name__])
    return ctx


def _fn_spec(fn: Callable[..., Any] | str) -> str:
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"expected 'module:qualname', got {fn!r}")
        return fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module is None or "<" in qualname:
        raise ValueError(f"{fn!r} is not importable by name; define it at module level")
    return f"{module}:{qualname}"


def _torchrun_env(world_size: int, threads_per_rank: int) -> dict[str, str]:
    """Variables torchrun would set that do not depend on the rank (one node)."""
    # No MASTER_PORT: rendezvous is through a FileStore, and a made-up port
    # would invite code that reads it to collide with concurrent runs.
    return {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": str(threads_per_rank),
    }


def _resolve(spec: str) -> Callable[..., Any]:
    module_name, qualname = spec.split(":", 1)
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------- rank side


def _rank_main(job: _Job, rank: int, conn: Connection) -> None:
    """Body of a rank process; never returns."""
    # Everything the rank writes to fd 2, including tracebacks printed by C++
    # and faulthandler's dumps, lands where the parent can quote it.
    log_fd = os.open(job.log_path(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _die_with_parent()
    os.environ.clear()
    os.environ.update(job.env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))

    dist: Any = None
    try:
        import torch
        import torch.distributed as dist

        # libgomp read OMP_NUM_THREADS when the forkserver imported torch.
        torch.set_num_threads(job.threads_per_rank)
        fn = _resolve(job.fn)
        dist.init_process_group(
            job.backend,
            store=dist.FileStore(job.store_path, job.world_size),
            rank=rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=job.pg_timeout_s),
        )
        conn.send_bytes(pickle.dumps(("joined", None, time.monotonic())))
        value = fn(*job.args, **job.kwargs)
        report: tuple[str, Any, float] = ("ok", value, time.monotonic())
    except BaseException:
        report = ("error", traceback.format_exc(), time.monotonic())
    # Plain pickle, not multiprocessing's: that one shares tensors through a file
    # descriptor server in this process, which is gone by the time the parent reads.
    try:
        conn.send_bytes(pickle.dumps(report))
    except Exception:
        error = f"could not send the result of rank {rank}:\n{traceback.format_exc()}"
        report = ("error", error, time.monotonic())
        conn.send_bytes(pickle.dumps(report))
    # The report is out: from here on, a crash (gloo often aborts while tearing
    # down) does not change the outcome, and os._exit skips the interpreter
    # teardown where such crashes happen.
    try:
        if dist is not None and dist.is_initialized():
            if report[0] == "ok":
                # A rank that tears down its connections while a peer is still
                # inside init_process_group or a collective makes that peer
                # fail; wait until every rank is past its report. A failed rank
                # skips this, so that its peers' collectives fail fast.
                dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if report[0] == "ok" else 1)


def _die_with_parent() -> None:
    """Have the kernel kill this rank when its parent dies.

    The parent is the forkserver, which exits once every holder of its "alive"
    pipe is gone: the process that started it and, unless they close their
    inherited copy, the ranks themselves, which would keep the forkserver and
    so themselves alive after the test process died.
    """
    # Read first: once the alive pipe is closed the forkserver may exit at once.
    parent = os.getppid()
    # Private to multiprocessing, hence looked up defensively.
    server: Any = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        # Processes this rank starts with "forkserver" get a server of their own.
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect.
    if os.getppid() != parent:
        os._exit(1)


# ------------------------------------------------------------------- parent side


def _supervise(ranks: list[_Rank], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    started = False
    grace_end: float | None = None
    failed: list[_Rank] = []
    while True:
        pending = [r for r in ranks if not r.done]
        if not pending:
            break
        if not started and all(r.joined or r.done for r in ranks):
            # From here on the clock is fn's.
            started = True
            deadline = time.monotonic() + timeout
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if grace_end is None and now >= deadline:
            _stop_with_stacks([r for r in pending if r.running])
            what = "the call" if started else "the start (joining the process group)"
            raise RankTimeout(
                f"run_ranks timed out: {what} took over {timeout:g}s; stacks of every rank:\n\n"
                + _describe(ranks),
                tuple(r.rank for r in pending),
            )
        handles: list[Any] = [r.process.sentinel for r in pending]
        handles += [r.reader for r in pending if not r.eof]
        ready = set(wait(handles, timeout=(grace_end or deadline) - now))
        for r in pending:
            if r.reader in ready or r.process.sentinel in ready:
                _collect(r)
        for r in sorted((r for r in pending if r.failed and r.failed_at is None), key=_cause_first):
            r.failed_at = len(failed)
            failed.append(r)
            if grace_end is None:
                grace_end = time.monotonic() + _FAILURE_GRACE_S
    if failed:
        _stop_with_stacks([r for r in ranks if r.running])
        raise RankFailure(
            f"{len(failed)} of {len(ranks)} ranks failed:\n\n" + _describe(ranks),
            tuple(r.rank for r in failed),
        )
    return [r.report[1] for r in ranks if r.report is not None]


def _cause_first(r: _Rank) -> tuple[bool, float]:
    """Order failures seen at the same moment, likely cause first.

    A dying rank breaks its peers' connections, so their errors follow its
    death; among errors, the rank's own clock says which was raised first
    (CLOCK_MONOTONIC is shared by all processes of the machine).
    """
    return (r.report is not None, r.report[2] if r.report is not None else 0.0)


def _collect(r: _Rank) -> None:
    """Take in a rank's report, or notice that it died without one."""
    # The pipe reaches EOF the moment the rank dies, while its exit status goes
    # through the forkserver and arrives later than a sibling's report that
    # the death caused; EOF keeps the failures in the order they happened.
    while not r.eof and r.report is None and r.reader.poll():
        try:
            message = pickle.loads(r.reader.recv_bytes())
        except EOFError:
            r.eof = True
            break
        if message[0] == "joined":
            r.joined = True
        else:
            r.report = message
    if r.report is None and not r.process.is_alive():
        r.exitcode = r.process.exitcode


def _stop_with_stacks(ranks: list[_Rank]) -> None:
    """Have each rank's faulthandler dump its Python stacks into its log, then kill it."""
    if not ranks:
        return
    sizes = {r.rank: _log_size(r) for r in ranks}
    for r in ranks:
        _signal(r, signal.SIGUSR1)
    limit = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < limit and any(_log_size(r) == sizes[r.rank] for r in ranks):
        time.sleep(0.02)
    # Let a dump that has started finish.
    time.sleep(0.05)
    for r in ranks:
        _signal(r, signal.SIGKILL)


def _signal(r: _Rank, sig: signal.Signals) -> None:
    if r.process.pid is not None and r.process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.process.pid, sig)


def _reap(ranks: list[_Rank]) -> None:
    """Kill and join every rank that was started, whatever state the run is in."""
    for r in ranks:
        r.reader.close()
        if r.process.pid is not None:
            if r.process.is_alive():
                r.process.kill()
            r.process.join()
        r.process.close()


def _log_size(r: _Rank) -> int:
    try:
        return r.log_path.stat().st_size
    except FileNotFoundError:
        return 0


def _log_tail(r: _Rank) -> str:
    try:
        with r.log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            return f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def _describe(ranks: list[_Rank]) -> str:
    """One section per rank, failures first in the order they happened."""
    n = len(ranks)
    order = sorted(ranks, key=lambda r: (r.failed_at is None, r.failed_at or 0, r.rank))
    sections = []
    for r in order:
        if r.report is not None and r.report[0] == "ok":
            sections.append(f"--- rank {r.rank}/{n}: returned")
            continue
        if r.report is not None:
            head = f"--- rank {r.rank}/{n}: raised\n{r.report[1].rstrip()}"
        elif r.exitcode is not None:
            head = f"--- rank {r.rank}/{n}: {_exit_status(r.exitcode)} before reporting"
        elif r.eof:
            head = f"--- rank {r.rank}/{n}: died before reporting"
        elif r.joined:
            head = f"--- rank {r.rank}/{n}: still running when stopped"
        else:
            head = f"--- rank {r.rank}/{n}: still starting when stopped (not in the process group)"
        tail = _log_tail(r)
        sections.append(f"{head}\n[rank {r.rank} stderr and stacks]\n{tail}" if tail else head)
    return "\n\n".join(sections)


def _exit_status(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
