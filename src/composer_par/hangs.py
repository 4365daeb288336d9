"""Naming the rank a job waits for, when a collective times out.

A rank that dies breaks its connections: its peers' collectives fail at once and the
launcher names the dead rank. A rank that is alive but stuck -- in its own code, in a
data loader, on a different code path -- breaks nothing: its peers wait in a collective
until the process-group timeout, and each then reports only that *it* timed out.

Inside :func:`name_stuck_ranks`, a rank whose collective times out adds itself to a roll
call in the job's store (the one ``init_process_group`` met through), waits up to
:data:`ROLL_CALL_S` for the other ranks that time out too (or lose their connection to
one that did: gloo closes a pair whose wait timed out), and raises
:class:`StuckRankError` naming the ranks that never answered, with the host and pid each
recorded on entry, so that its stack can be looked at. A job with one stuck rank thus
ends about ``timeout + ROLL_CALL_S`` after the rank stopped, and says which one.

The roll call needs the ranks' timeouts to fall within :data:`ROLL_CALL_S` of each
other, which they do when the stuck rank's peers all block in the same step. Where every
rank answers, none is named: the ranks wait in different collectives (one called on
some ranks only, or in another order), or one is slower than the timeout.

NCCL's watchdog aborts a timed-out process instead of raising (by default): no Python
code runs then, and torch's flight recorder is the tool (``TORCH_NCCL_TRACE_BUFFER_SIZE``).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["ROLL_CALL_S", "StuckRankError", "name_stuck_ranks"]

# How long a rank that timed out waits for the others that time out too. Peers blocked in
# one step enter their collectives within milliseconds of each other on the models this
# trains; a few seconds leave room for a loaded machine.
ROLL_CALL_S = 3.0
_PREFIX = "composer_par/roll_call/"
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_LOST = re.compile(r"connection (closed|reset)|broken pipe|closed by peer", re.IGNORECASE)


class StuckRankError(RuntimeError):
    """Collectives timed out; ``stuck`` are the ranks that never joined, ``waiting`` the
    ranks that timed out waiting (this one among them)."""

    def __init__(self, message: str, stuck: tuple[int, ...] = (),
                 waiting: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.stuck = stuck
        self.waiting = waiting

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.stuck, self.waiting))


@contextlib.contextmanager
def name_stuck_ranks(timeout: float | timedelta | None = None, *,
                     roll_call_s: float = ROLL_CALL_S) -> Iterator[None]:
    """Turn a collective timeout inside the block into :class:`StuckRankError` naming
    the ranks that never joined. Every rank enters it (after ``init_process_group``);
    ``timeout`` is only quoted in the message. Other errors pass through unchanged."""
    store = _store()
    if store is not None:
        import torch.distributed as dist

        with contextlib.suppress(RuntimeError):  # a store that is gone costs the names only
            store.set(f"where/{dist.get_rank()}", f"pid {os.getpid()} on {socket.gethostname()}")
    try:
        yield
    except StuckRankError:
        raise
    except Exception as exc:
        if store is None:
            raise
        # gloo closes a pair whose wait timed out, so the rank at its other end fails with
        # a lost connection: that rank joins the roll call the timed-out one started. A
        # lost connection with no roll call is a dead peer, which torchrun names.
        if _timed_out(exc) or (_lost_connection(exc) and _roll_call_started(store,
                                                                            roll_call_s)):
            raise _roll_call(store, exc, timeout, roll_call_s) from exc
        raise


def _store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from composer_par.plugin import torch_private

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{_PREFIX}{restart}/", torch_private.default_store())


def _timed_out(exc: BaseException) -> bool:
    return _matches(exc, _TIMED_OUT)


def _lost_connection(exc: BaseException) -> bool:
    return _matches(exc, _LOST)


def _matches(exc: BaseException, pattern: re.Pattern[str]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (RuntimeError, TimeoutError, ConnectionError)) and \
                pattern.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _roll_call_started(store: Any, wait_s: float) -> bool:
    """Whether a rank that timed out opened the roll call (within ``wait_s``: it closes
    the connection before it can say so)."""
    deadline = time.monotonic() + wait_s
    try:
        while not store.check(["timed_out"]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
    except RuntimeError:
        return False
    return True


def _roll_call(store: Any, exc: BaseException, timeout: float | timedelta | None,
               roll_call_s: float) -> BaseException:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    after = _seconds(timeout, first)
    try:
        if after:
            # A rank whose peer closed the connection on it (it joins the roll call with
            # a lost connection, no timeout of its own) quotes the timed-out rank's wait.
            store.set("waited", after)
        store.append("timed_out", f"{rank},")
        deadline = time.monotonic() + roll_call_s
        while True:
            answered = {int(r) for r in store.get("timed_out").decode().split(",") if r}
            if len(answered) >= world or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        stuck = tuple(r for r in range(world) if r not in answered)
        where = {r: store.get(f"where/{r}").decode() for r in stuck
                 if store.check([f"where/{r}"])}
        if not after and store.check(["waited"]):
            after = store.get("waited").decode()
    except RuntimeError as store_error:  # the store went away with its host
        return StuckRankError(f"rank {rank}: a collective timed out ({first}); the ranks "
                              f"it waited for could not be named: {store_error}")
    waiting = tuple(sorted(answered))
    if not stuck:
        return StuckRankError(
            f"every rank timed out waiting in a collective{after}: the ranks are in "
            "different collectives (one called on some ranks only, or in another order), "
            "or one is slower than the timeout (raise it: ParallelPlan(..., timeout=...)). "
            f"Rank {rank}: {first}", (), waiting)
    names = _ranks(stuck)
    located = "; ".join(f"rank {r}: {where[r]}" for r in stuck if r in where)
    return StuckRankError(
        f"{names} never joined: {_ranks(waiting)} timed out{after} waiting in a collective "
        f"that needs {'it' if len(stuck) == 1 else 'them'}, while "
        f"{'it is' if len(stuck) == 1 else 'they are'} alive but elsewhere (stuck in "
        "user code, a data loader, or a different code path)"
        + (f". {located}: look at the stack there (e.g. py-spy dump --pid PID)"
           if located else "")
        + f". Rank {rank}: {first}", stuck, waiting)


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _seconds(timeout: float | timedelta | None, message: str) -> str:
    if isinstance(timeout, timedelta):
        return f" after {timeout.total_seconds():g} s"
    if isinstance(timeout, (int, float)):
        return f" after {timeout:g} s"
    found = re.search(r"(\d+)\s*ms", message)  # gloo: "Timed out waiting 10000ms for ..."
    return f" after {int(found.group(1)) / 1000:g} s" if found else ""
