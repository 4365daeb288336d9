"""The errors of checkpoint and weight I/O, and the bridge from DCP's BaseException.

Every message names the file (or directory) and, where one is involved, the key, the
expected and the found shape/dtype (DESIGN.md section 7).
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


class CheckpointError(Exception):
    """A checkpoint or weights file could not be saved, read or matched to the model."""


class CorruptFileError(CheckpointError):
    """A weights file is truncated or its header is not valid safetensors."""


class UncommittedError(CheckpointError):
    """A checkpoint directory has no commit marker: its save never finished."""


class KeyMismatchError(CheckpointError):
    """The model and the file disagree on keys, shapes or dtypes (strict loading).

    ``missing``: model keys the file lacks; ``unexpected``: file keys the model lacks;
    ``mismatched``: ``(key, expected, found)`` for shapes/dtypes that cannot be loaded.
    """

    def __init__(
        self,
        source: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        self.source = source
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        super().__init__(describe_mismatch(source, self.missing, self.unexpected,
                                           self.mismatched))


def _first(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... (+{len(keys) - limit} more)" if len(keys) > limit else "")


def describe_mismatch(
    source: str,
    missing: Sequence[str],
    unexpected: Sequence[str],
    mismatched: Sequence[tuple[str, str, str]],
) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) of the model are missing from {source}: "
                     f"{_first(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) in {source} are not in the model: "
                     f"{_first(unexpected)}")
    for key, expected, found in mismatched[:5]:
        parts.append(f"{key}: the model expects {expected}, {source} has {found}")
    if len(mismatched) > 5:
        parts.append(f"... and {len(mismatched) - 5} more shape/dtype mismatches")
    return "; ".join(parts) or f"{source} matches the model"


def _checkpoint_exception() -> type[BaseException] | None:
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return CheckpointException


def _failures(exc: BaseException) -> str:
    failures: Any = getattr(exc, "failures", None) or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
    return "; ".join(parts)


# What torch's zip writer says when a write came back short (the disk filled up).
_SHORT_WRITE = ("unexpected pos", "file write failed", "No space left on device",
                "Disk quota exceeded")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures: Any = getattr(e, "failures", None) or {}
        for failure in failures.values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it, on any rank) is a write that found no space."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, (RuntimeError, OSError)) and any(m in str(e) for m in _SHORT_WRITE):
            return True
    return False


def disk_full_message(directory: str | os.PathLike[str], what: str) -> str:
    """``what`` failed because the disk holding ``directory`` is full, and what to do."""
    free = ""
    with contextlib.suppress(OSError):
        probe = Path(directory)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        st = os.statvfs(probe)
        free = f"; {st.f_bavail * st.f_frsize} bytes free now"
    return (f"{what} failed: the disk is full at {directory} (no space left, or the quota "
            f"is used up{free}): free space or write elsewhere")


def describe_failure(exc: BaseException, rank: int, directory: str | os.PathLike[str],
                     what: str) -> str:
    """One line for a rank's failure (``what`` it was doing), the disk-full case said
    plainly."""
    if is_disk_full(exc):
        return f"rank {rank}: {disk_full_message(directory, what)} ({type(exc).__name__}: {exc})"
    return f"rank {rank}: {what}: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def dcp_errors(what: str, directory: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a ``BaseException``, which ``except
    Exception`` would let through) as a :class:`CheckpointError` saying ``what`` failed
    (and, when a write found no space, that the disk at ``directory`` is full); silence
    DCP's warning that one process means no process group."""
    wrapped = _checkpoint_exception()
    try:
        with warnings.catch_warnings():
            # DCP warns on every single-process call, even when told no_dist=True.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointError:
        raise
    except BaseException as exc:
        if wrapped is not None and isinstance(exc, wrapped):
            # DCP turns Ctrl-C inside its steps into its exception: it stays Ctrl-C.
            if any(isinstance(e, KeyboardInterrupt) for e in _chain(exc)):
                raise KeyboardInterrupt from exc
            detail = _failures(exc) or str(exc)
            if directory is not None and is_disk_full(exc):
                raise CheckpointError(f"{disk_full_message(directory, what)} ({detail})") \
                    from exc
            # A CheckpointError raised inside DCP on one rank keeps its own message.
            inner = _inner_checkpoint_error(exc)
            if inner is not None:
                raise type(inner)(str(inner)) from exc
            raise CheckpointError(f"{what} failed: {detail}") from exc
        if directory is not None and isinstance(exc, Exception) and is_disk_full(exc):
            raise CheckpointError(f"{disk_full_message(directory, what)} "
                                  f"({type(exc).__name__}: {exc})") from exc
        raise


def _inner_checkpoint_error(exc: BaseException) -> CheckpointError | None:
    failures: Any = getattr(exc, "failures", None) or {}
    for _, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, KeyMismatchError):
            return CheckpointError(str(inner))
        if isinstance(inner, CheckpointError):
            return inner
    return None
