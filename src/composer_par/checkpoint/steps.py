"""Step directories, commit markers, ``latest`` and keep-last-N retention.

A checkpoint root holds one directory per save, ``step-000000120``. A save writes into a
fresh step directory and is *committed* by the marker file ``COMMITTED``, which rank 0
writes (to a temporary name, then ``os.replace``) only after every rank has finished
writing. A directory without the marker is a save that never finished (a crash, a
killed job) and is ignored by :func:`latest` and refused by ``load``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from composer_par.checkpoint.errors import CheckpointError, UncommittedError

MARKER = "COMMITTED"
INFO = "composer_par.json"
STEP_PATTERN = re.compile(r"^step-(\d+)$")
DCP_METADATA = ".metadata"


def step_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int; got {step!r}")
    return f"step-{step:09d}"


def step_of(directory: str | os.PathLike[str]) -> int | None:
    m = STEP_PATTERN.match(Path(directory).name)
    return int(m.group(1)) if m else None


def is_committed(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / MARKER).is_file()


def step_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path, bool]]:
    """``(step, directory, committed)`` for every step directory under ``root``, by step."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        step = step_of(child)
        if step is not None and child.is_dir():
            found.append((step, child, is_committed(child)))
    return sorted(found, key=lambda item: item[0])


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The committed step directory with the highest step under ``root`` (None if none).
    Directories without a commit marker (unfinished saves) are skipped."""
    committed = [d for _, d, ok in step_dirs(root) if ok]
    return committed[-1] if committed else None


def is_checkpoint_dir(directory: str | os.PathLike[str]) -> bool:
    """A DCP checkpoint directory (committed or not): it has DCP's ``.metadata`` or our
    info file or marker."""
    p = Path(directory)
    return any((p / name).exists() for name in (DCP_METADATA, INFO, MARKER))


def resolve(path: str | os.PathLike[str]) -> Path:
    """The committed checkpoint directory ``path`` means: a step directory (which must be
    committed) or a root (its latest committed step)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint directory")
    if is_checkpoint_dir(p) or step_of(p) is not None:
        # A bare DCP directory (written by other tools) has only DCP's .metadata, which DCP
        # writes last, after every rank finished; ours must carry the marker.
        ours = (p / INFO).exists() or step_of(p) is not None
        if ours and not is_committed(p):
            raise UncommittedError(
                f"{p}: uncommitted checkpoint directory (no {MARKER} marker): its save never "
                "finished; load an earlier step, e.g. latest() of its parent")
        if not (p / DCP_METADATA).is_file():
            raise CheckpointError(f"{p}: not a DCP checkpoint (no {DCP_METADATA})")
        return p
    found = latest(p)
    if found is None:
        partial = [str(d.name) for _, d, ok in step_dirs(p) if not ok]
        detail = (f"; uncommitted (unfinished) saves: {', '.join(partial)}" if partial
                  else "")
        raise CheckpointError(f"{p}: no committed checkpoint{detail}")
    return found


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(directory: Path, step: int) -> None:
    """Mark ``directory`` committed (rank 0, after every rank finished writing)."""
    write_json_atomic(directory / MARKER, {"step": step, "committed_at": time.time()})


def read_info(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(directory) / INFO
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint info ({exc})") from exc
    return data if isinstance(data, dict) else {}


def remove(directory: Path) -> None:
    """Delete a step directory so that a crash midway never leaves it looking committed:
    the marker goes first."""
    with contextlib.suppress(FileNotFoundError):
        (directory / MARKER).unlink()
    fsync_dir(directory)
    shutil.rmtree(directory, ignore_errors=True)


def retain(root: str | os.PathLike[str], keep_last: int, current: int) -> list[Path]:
    """Keep the newest ``keep_last`` committed steps; drop older committed ones and the
    unfinished saves older than ``current`` (the step just committed: they can never be
    completed now). Returns the removed directories."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1; got {keep_last}")
    entries = step_dirs(root)
    committed = [d for _, d, ok in entries if ok]
    doomed = committed[:-keep_last]
    doomed += [d for step, d, ok in entries if not ok and step < current]
    for d in doomed:
        remove(d)
    return doomed
