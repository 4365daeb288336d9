"""The errors of checkpoint and weight I/O, and the bridge from DCP's BaseException.

Every message names the file (or directory) and, where one is involved, the key, the
expected and the found shape/dtype (DESIGN.md section 7).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
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


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a ``BaseException``, which ``except
    Exception`` would let through) as a :class:`CheckpointError` saying ``what`` failed;
    silence DCP's warning that one process means no process group."""
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
            detail = _failures(exc) or str(exc)
            # A CheckpointError raised inside DCP on one rank keeps its own message.
            inner = _inner_checkpoint_error(exc)
            if inner is not None:
                raise type(inner)(str(inner)) from exc
            raise CheckpointError(f"{what} failed: {detail}") from exc
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
