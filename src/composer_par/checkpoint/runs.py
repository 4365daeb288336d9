"""Runs: which job a committed step belongs to, and which step resuming a run means.

A *run* is one training job, however many times it is started: every save records its
run id in the step's commit marker, retention (``keep_last``) deletes only older steps of
the run that saves, and loading a root picks the newest step of the run being resumed.

The run id of a save is, first that is set:

1. the ``run=`` argument of ``save``;
2. the environment variable ``COMPOSER_PAR_RUN_ID``;
3. the run this process resumed: ``load`` of a step of this root adopts its run, so a job
   restarted by hand continues the run it loaded;
4. torchrun's ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``; ``--standalone`` makes one per
   invocation), which every restart (``--max-restarts``) of one torchrun job shares.
   torchrun's default, ``none``, is shared by unrelated jobs and is not used;
5. otherwise a random id of this process (rank 0's, sent to the other ranks).

Loading a root (``load(root)``, ``--resume``) picks the newest committed step of the run
named by ``run=``; without one, of the run the environment names (2 or 4) when the root
has steps of it; otherwise the newest step of the root if all its steps belong to one
run. A root holding steps of several runs, none of them named, is refused, naming each
run and its newest step. Steps committed before run ids were recorded belong to no run
(they count as one group, and retention of a run never deletes them).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from collections.abc import Iterator

RUN_ENV = "COMPOSER_PAR_RUN_ID"
_TORCHRUN_DEFAULT = "none"
_MAX_LENGTH = 200

# Root (resolved path) -> the run this process resumed there (set by ``load``).
_adopted: dict[str, str] = {}


def check_run(run: Any, what: str = "run") -> str:
    """``run`` if it is a usable run id (a non-empty printable string), else ValueError."""
    if not isinstance(run, str) or not run or len(run) > _MAX_LENGTH or not run.isprintable():
        raise ValueError(f"{what} must be a non-empty printable string of at most "
                         f"{_MAX_LENGTH} characters; got {run!r}")
    return run


def _key(root: str | os.PathLike[str]) -> str:
    return os.path.realpath(root)


def adopt(root: str | os.PathLike[str], run: str | None) -> None:
    """Record that this process resumed ``run`` from ``root``: its later saves there
    continue that run (unless ``run=`` or ``COMPOSER_PAR_RUN_ID`` says otherwise)."""
    if run is not None:
        _adopted[_key(root)] = run


def _environment_run() -> str | None:
    value = os.environ.get(RUN_ENV, "").strip()
    return check_run(value, RUN_ENV) if value else None


def _torchrun_run() -> str | None:
    value = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    return value if value and value != _TORCHRUN_DEFAULT else None


def run_for_save(root: str | os.PathLike[str], run: str | None, fallback: str) -> str:
    """The run id a save into ``root`` records (see the module docstring);
    ``fallback`` is this process's own id."""
    if run is not None:
        return check_run(run)
    return (_environment_run() or _adopted.get(_key(root)) or _torchrun_run()
            or fallback)


def run_of(directory: Path) -> tuple[bool, str | None]:
    """``(still committed, run)`` of a step directory: the run its commit records (None
    for a step committed before runs were recorded). A marker that vanished (retention
    removing the step) reads as not committed."""
    from composer_par.checkpoint.steps import read_commit

    try:
        data = read_commit(directory)
    except CheckpointError:
        if not (directory / "COMMITTED").exists():
            return False, None
        raise
    run = data.get("run")
    return True, run if isinstance(run, str) and run else None


def committed_by_run(root: str | os.PathLike[str]
                     ) -> dict[str | None, list[tuple[int, Path]]]:
    """Run -> its committed ``(step, directory)`` under ``root``, by step (a step whose
    commit marker cannot be read belongs to none: see :func:`_grouped`)."""
    return _grouped(root)[0]


def _grouped(root: str | os.PathLike[str]
             ) -> tuple[dict[str | None, list[tuple[int, Path]]],
                        list[tuple[int, CheckpointError]]]:
    """The committed steps by run, and ``(step, error)`` of those whose marker cannot be
    read (corrupt: no run can be told for them, and no retention deletes them)."""
    from composer_par.checkpoint.steps import step_dirs

    groups: dict[str | None, list[tuple[int, Path]]] = {}
    unreadable: list[tuple[int, CheckpointError]] = []
    for step, directory, committed in step_dirs(root):
        if not committed:
            continue
        try:
            still, run = run_of(directory)
        except CheckpointError as exc:
            unreadable.append((step, exc))
            continue
        if still:
            groups.setdefault(run, []).append((step, directory))
    return groups, unreadable


def describe_run(run: str | None) -> str:
    return f"run {run}" if run is not None else "steps saved without a run id"


def _committed_at(directory: Path) -> str:
    from composer_par.checkpoint.steps import read_commit

    try:
        when = read_commit(directory).get("committed_at")
    except CheckpointError:
        return ""
    if not isinstance(when, (int, float)) or isinstance(when, bool):
        return ""
    return ", committed " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def _candidates(groups: dict[str | None, list[tuple[int, Path]]]) -> Iterator[str]:
    newest_first = sorted(groups.items(), key=lambda item: item[1][-1][0], reverse=True)
    for run, entries in newest_first:
        directory = entries[-1][1]
        yield (f"{describe_run(run)} (newest {directory.name}{_committed_at(directory)}, "
               f"{len(entries)} step(s))")


def choose(root: Path, run: str | None = None) -> Path | None:
    """The step directory loading ``root`` means (see the module docstring); None when
    the root has no committed step; CheckpointError when the run is not clear."""
    from composer_par.checkpoint.steps import step_of

    groups, unreadable = _grouped(root)
    chosen = _chosen(root, groups, run)
    # A newer step whose marker is damaged might be the run's newest: name it rather
    # than resume from an older step without a word.
    newer = [exc for step, exc in unreadable
             if chosen is None or step > (step_of(chosen) or 0)]
    if newer:
        raise newer[-1]
    return chosen


def _chosen(root: Path, groups: dict[str | None, list[tuple[int, Path]]],
            run: str | None) -> Path | None:
    if not groups:
        return None
    if run is not None:
        check_run(run)
        if run in groups:
            return groups[run][-1][1]
        raise CheckpointError(f"{root}: no committed step of run {run}; it holds "
                              + "; ".join(_candidates(groups)))
    named = [r for r in (_environment_run(), _adopted.get(_key(root)), _torchrun_run())
             if r is not None]
    for candidate in named:
        if candidate in groups:
            return groups[candidate][-1][1]
    if len(groups) == 1:
        return next(iter(groups.values()))[-1][1]
    this = f"this job's run ({named[0]}) is none of them" if named else \
        "this job names no run"
    raise CheckpointError(
        f"{root} holds the committed steps of {len(groups)} runs and {this}: "
        + "; ".join(_candidates(groups))
        + f". Say which to resume: run=... (train.py --run-id, or {RUN_ENV}), or load a "
        "step directory")


__all__ = ["RUN_ENV", "adopt", "check_run", "choose", "committed_by_run", "describe_run",
           "run_for_save", "run_of"]
