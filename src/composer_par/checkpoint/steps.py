"""Step directories, commit markers, ``latest`` and keep-last-N retention.

A checkpoint root holds one directory per save, ``step-000000120``. A save claims a
fresh step directory (see :mod:`~composer_par.checkpoint.claims`) and is *committed* by
the marker file ``COMMITTED``, which rank 0 writes (to a temporary name, then
``os.replace``) only after every rank has finished writing; the marker records the size
and digests of every file of the step (see :mod:`~composer_par.checkpoint.integrity`).
A directory without the marker is a save that never finished (a crash, a killed job, or
one still running) and is ignored by :func:`latest` and refused by ``load``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.checkpoint.errors import CheckpointError, CorruptFileError, UncommittedError
from composer_par.checkpoint.jsonfile import parse_json_object, read_json_object
from composer_par.checkpoint.paths import read_bounded

if TYPE_CHECKING:
    from composer_par.checkpoint.claims import Job
    from composer_par.checkpoint.integrity import Manifest

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


def resolve(path: str | os.PathLike[str], run: str | None = None) -> Path:
    """The committed checkpoint directory ``path`` means: a step directory (which must be
    committed) or a root (the newest committed step of ``run``, or of the run being
    resumed: see :mod:`~composer_par.checkpoint.runs`)."""
    from composer_par.checkpoint.runs import choose

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
        if not os.path.lexists(p / DCP_METADATA):  # one that is not a file: read_metadata
            raise CheckpointError(f"{p}: not a DCP checkpoint (no {DCP_METADATA})")
        return p
    found = choose(p, run)
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


# Bounds of the JSON files read whole (a device or a runaway file is refused).
INFO_LIMIT = 1 << 30
MARKER_LIMIT = 1 << 31


def commit(directory: Path, step: int, manifest: Manifest | None = None,
           job: str | None = None, run: str | None = None) -> None:
    """Mark ``directory`` committed (rank 0, after every rank finished writing), with the
    digest record of its files and the run that saved it."""
    data: dict[str, Any] = {"step": step, "committed_at": time.time()}
    if job is not None:
        data["job"] = job
    if run is not None:
        data["run"] = run
    if manifest is not None:
        data.update(manifest.to_json())
    write_json_atomic(directory / MARKER, data)


def read_commit(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The content of the commit marker (CorruptFileError naming it when unreadable)."""
    path = Path(directory) / MARKER
    return read_json_object(path, MARKER_LIMIT, what="commit marker")


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The digest record of a committed directory (None: committed before digests were
    recorded, or not committed)."""
    from composer_par.checkpoint.integrity import Manifest

    p = Path(directory)
    if not is_committed(p):
        return None
    return Manifest.from_commit(p, read_commit(p))


def _positive_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# field -> (what it must be, check)
_INFO_FIELDS: dict[str, tuple[str, Any]] = {
    "format": ("an integer", lambda v: _positive_int(v, 0)),
    "step": ("a non-negative integer", lambda v: _positive_int(v, 0)),
    "world_size": ("a positive integer", lambda v: _positive_int(v, 1)),
    "plan": ("a string (the plan's TOML) or null", lambda v: v is None or isinstance(v, str)),
    "torch": ("a string", lambda v: isinstance(v, str)),
    "saved_at": ("a number", lambda v: isinstance(v, (int, float))
                 and not isinstance(v, bool)),
    "optimizer": ("an object with param_groups (a list of objects), scalars (an object) "
                  "and class (a string)",
                  lambda v: isinstance(v, dict)
                  and isinstance(v.get("param_groups"), list)
                  and all(isinstance(g, dict) for g in v.get("param_groups", []))
                  and isinstance(v.get("scalars", {}), dict)
                  and isinstance(v.get("class", ""), str)),
}


def parse_info(path: Path, raw: bytes) -> dict[str, Any]:
    """The checkpoint info in ``raw`` (the bytes of ``path``), every field it uses checked:
    CorruptFileError names the file and the field."""
    data = parse_json_object(path, raw, what="checkpoint info")
    for field, (expected, ok) in _INFO_FIELDS.items():
        if field in data and not ok(data[field]):
            raise CorruptFileError(f"{path}: field {field} must be {expected}; found "
                                   f"{data[field]!r}")
    return data


def read_info(directory: str | os.PathLike[str], manifest: Manifest | None = None
              ) -> dict[str, Any]:
    """The checkpoint info (``{}`` when there is none), its fields checked, and with a
    ``manifest`` its bytes checked against the commit record."""
    path = Path(directory) / INFO
    if not os.path.lexists(path):
        if manifest is not None and INFO in manifest.files:
            raise CorruptFileError(f"{path}: missing (the commit records it)")
        return {}
    raw = read_bounded(path, INFO_LIMIT, what="checkpoint info")
    data = parse_info(path, raw)
    if manifest is not None:
        manifest.check_bytes(INFO, raw)
    return data


@contextlib.contextmanager
def reading(directory: Path) -> Iterator[None]:
    """Hold a shared advisory lock of ``directory``'s commit marker while it is loaded:
    retention leaves a step being read for a later save to delete (see
    :func:`in_use`). Best effort: where there are no locks (or no marker), nothing."""
    fd = -1
    with contextlib.suppress(OSError, ImportError):
        import fcntl

        fd = os.open(directory / MARKER, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def in_use(directory: Path) -> bool:
    """Whether a load on this machine holds ``directory``'s marker (see :func:`reading`)."""
    try:
        import fcntl

        fd = os.open(directory / MARKER, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ImportError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def remove(directory: Path) -> None:
    """Delete a step directory so that a crash midway never leaves it looking committed:
    the marker goes first."""
    with contextlib.suppress(FileNotFoundError):
        (directory / MARKER).unlink()
    fsync_dir(directory)
    shutil.rmtree(directory, ignore_errors=True)


def retain(root: str | os.PathLike[str], keep_last: int, current: int,
           job: Job | None = None) -> list[Path]:
    """Retention of the run that just committed step ``current`` (``job.run``; None: the
    steps saved without a run id): keep its newest ``keep_last`` committed steps, and
    always ``current``; delete its older committed ones, and its unfinished saves older
    than ``current`` whose claim proves their writer gone (``job``, the job that saves,
    counts its own earlier claims as gone). A step a load on this machine is reading
    (:func:`reading`) is left for a later save. Steps of other runs are never touched (see
    :func:`prune` and ``clean_stale`` for those). Returns the removed directories."""
    from composer_par.checkpoint.claims import is_stale, read_claim, root_lock
    from composer_par.checkpoint.runs import committed_by_run

    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1; got {keep_last}")
    run = job.run if job is not None else None
    with root_lock(Path(root)):
        ours = committed_by_run(root).get(run, [])
        # A step a load is reading is left for a later save's retention.
        doomed = [d for step, d in ours[:-keep_last] if step != current and not in_use(d)]
        for step, d, ok in step_dirs(root):
            claim = read_claim(d) if not ok and step < current else None
            if claim is not None and claim.run == run and is_stale(d, job):
                doomed.append(d)
        for d in doomed:
            remove(d)
    return doomed


def prune(root: str | os.PathLike[str], *, keep_last: int, older_than: float,
          run: str | None = None, dry_run: bool = False) -> list[Path]:
    """The explicit clean-up of committed steps: of every run (or only ``run``), delete
    the committed steps beyond its newest ``keep_last`` that were committed at least
    ``older_than`` seconds ago; the newest step of a run is never deleted. With
    ``dry_run`` nothing is deleted. Returns the (would-be) removed directories."""
    from composer_par.checkpoint.claims import root_lock, root_to_clean
    from composer_par.checkpoint.runs import committed_by_run

    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer of at least 1; got {keep_last!r}")
    base = root_to_clean(root, older_than)
    doomed: list[Path] = []
    with root_lock(base):
        now = time.time()
        for group, entries in committed_by_run(base).items():
            if run is not None and group != run:
                continue
            for _, d in entries[:-keep_last]:
                when = read_commit(d).get("committed_at")
                if isinstance(when, (int, float)) and now - when >= older_than:
                    doomed.append(d)
        if not dry_run:
            for d in doomed:
                remove(d)
    return doomed
