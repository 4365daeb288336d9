"""Exclusive step directories: a save claims its directory, and nothing removes one that
another job may still be writing.

A save's rank 0 creates the step directory already holding a ``CLAIM`` file: it builds a
private directory with the claim inside and renames it to ``step-NNNNNNNNN``, which
fails when that name exists, so exactly one job owns a step directory. The claim names
the job: a random id shared by all its ranks, the host, rank 0's pid and process start
time, and (under torchrun) the elastic run id and restart count. It stays in the
directory after the commit, recording who saved it.

An uncommitted step directory that already exists is taken over only when its writer is
provably gone:

* its claim is this job's own (an earlier failed save of the same step) and no thread of
  this process is still saving it (each save's claim has its own id: two threads of one
  process saving one step are two claims, and the second is refused);
* its claim is from this machine (same host name, boot and pid namespace) and that pid
  is not running, or runs a process started at another time (the pid was reused);
* its claim is from an earlier attempt of this torchrun job (the same elastic run id and
  a lower restart count: torchrun stops every worker of an attempt before the next);
* it is empty.

Anything else (a live job, a claim from another machine, a directory without a claim) is
an error naming the directory and the job. Stale directories are cleaned explicitly with
:func:`clean_stale`, which never touches one younger than the age it is given or whose
claim is live.

Decisions happen under an advisory lock of the root (``flock`` of ``.composer_par.lock``,
released by the kernel if its holder dies), so two jobs cannot both decide to take over
one stale directory. Where the file system has no locks, claiming a fresh directory stays
exclusive (the rename), and a warning says the take-over is not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.jsonfile import read_json_object
from composer_par.logging import get_logger

log = get_logger(__name__)

CLAIM = "CLAIM"
LOCK = ".composer_par.lock"
# A claim is a few hundred bytes; anything far larger is not one.
_CLAIM_LIMIT = 1 << 20
_LOCK_WAIT_S = 120.0
_STAGING = ".claim-"
_TRASH = ".trash-"

_job: tuple[int, str] = (0, "")  # (pid, id): a forked child gets an id of its own
# The saves of this process that hold a claim now (Job.save), across its threads.
_saving: set[str] = set()
_saving_lock = threading.Lock()


def job_id() -> str:
    """This process's random job id (used when it is rank 0; sent to the other ranks)."""
    global _job
    if _job[0] != os.getpid():
        _job = (os.getpid(), uuid.uuid4().hex[:16])
    return _job[1]


def _machine() -> dict[str, str]:
    """What makes a pid meaningful: the host, its boot and the pid namespace."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    pid_ns = ""
    with contextlib.suppress(OSError):
        pid_ns = os.readlink("/proc/self/ns/pid")
    return {"host": socket.gethostname(), "boot_id": boot, "pid_ns": pid_ns}


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _int_env(name: str) -> int | None:
    with contextlib.suppress(KeyError, ValueError):
        return int(os.environ[name])
    return None


@attrs.frozen
class Job:
    """Who writes a step directory (the claim's content)."""

    id: str
    host: str
    boot_id: str
    pid_ns: str
    pid: int
    pid_start: int | None
    started_at: float
    world_size: int
    run_id: str | None = None  # torchrun's TORCHELASTIC_RUN_ID
    restart: int | None = None  # torchrun's TORCHELASTIC_RESTART_COUNT
    claimed_at: float = 0.0
    run: str | None = None  # the run this save belongs to (see checkpoint.runs)
    # One save of this job: two threads of one process saving share the job id.
    save: str = ""

    @classmethod
    def current(cls, world_size: int, run: str | None = None) -> Job:
        """This process as rank 0 of a job of ``world_size`` ranks, for one save."""
        pid = os.getpid()
        return cls(id=job_id(), pid=pid, pid_start=_start_ticks(pid),
                   started_at=_process_started(), world_size=world_size,
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                   restart=_int_env("TORCHELASTIC_RESTART_COUNT"), claimed_at=time.time(),
                   run=run, save=uuid.uuid4().hex[:16], **_machine())

    @classmethod
    def from_dict(cls, data: Any) -> Job | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(id=str(data["job"]), host=str(data["host"]),
                       boot_id=str(data.get("boot_id", "")), pid_ns=str(data.get("pid_ns", "")),
                       pid=int(data["pid"]),
                       pid_start=None if data.get("pid_start") is None else int(data["pid_start"]),
                       started_at=float(data.get("started_at", 0.0)),
                       world_size=int(data.get("world_size", 0)),
                       run_id=None if data.get("run_id") is None else str(data["run_id"]),
                       restart=None if data.get("restart") is None else int(data["restart"]),
                       claimed_at=float(data.get("claimed_at", 0.0)),
                       run=None if data.get("run") is None else str(data["run"]),
                       save=str(data.get("save", "")))
        except (KeyError, TypeError, ValueError):
            return None

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["job"] = data.pop("id")
        return data

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        elastic = (f", torchrun run {self.run_id} attempt {self.restart}"
                   if self.run_id is not None else "")
        return (f"job {self.id} (host {self.host}, pid {self.pid}, started {started}, "
                f"{self.world_size} rank(s){elastic})")

    def same_machine(self) -> bool:
        here = _machine()
        return (self.host == here["host"] and self.boot_id == here["boot_id"]
                and self.pid_ns == here["pid_ns"])


def _process_started() -> float:
    """Wall-clock start of this process (Linux: from its start ticks), else now."""
    ticks = _start_ticks(os.getpid())
    if ticks is not None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            uptime = float(Path("/proc/uptime").read_text().split()[0])
            return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    return time.time()


def liveness(claim: Job, me: Job | None = None) -> tuple[str, str]:
    """``("live" | "dead" | "unknown", why)`` for the job of ``claim``.

    ``dead`` only when provable: this job's own earlier claim, a pid on this machine
    that is gone or reused, or an earlier torchrun attempt of the same run.
    """
    if me is not None and claim.id == me.id and claim.pid == me.pid and claim.same_machine():
        if claim.save and claim.save in _saving:
            return "live", (f"another thread of this process (pid {claim.pid}) is saving it "
                            f"now (save {claim.save})")
        return "dead", "an earlier save of this same job"
    if (me is not None and claim.run_id not in (None, "", "none") and claim.run_id == me.run_id
            and claim.restart is not None and me.restart is not None
            and claim.restart < me.restart):
        return "dead", (f"an earlier attempt ({claim.restart}) of this torchrun run "
                        f"{claim.run_id}, now at attempt {me.restart}")
    if not claim.same_machine():
        return "unknown", f"claimed on another machine ({claim.host})"
    try:
        os.kill(claim.pid, 0)
    except ProcessLookupError:
        return "dead", f"pid {claim.pid} is not running on {claim.host}"
    except PermissionError:
        pass  # it exists (another user's process)
    now = _start_ticks(claim.pid)
    if claim.pid_start is not None and now is not None and now != claim.pid_start:
        return "dead", f"pid {claim.pid} now belongs to another process"
    return "live", f"pid {claim.pid} is running on {claim.host}"


def read_claim(directory: str | os.PathLike[str]) -> Job | None:
    """The job that claims ``directory``; None when no claim can be read (none was
    written, or a crash left it partial)."""
    try:
        data = read_json_object(Path(directory) / CLAIM, _CLAIM_LIMIT, what="claim")
    except CheckpointError:
        return None
    return Job.from_dict(data)


def claim_directory(directory: str | os.PathLike[str]) -> Job:
    """Write this process's claim into ``directory``, a private directory it has just
    made (a convert's staging directory, an optimizer's offload directory), so that a
    later process can tell whether its maker is gone (:func:`remove_dead_directories`)."""
    job = Job.current(1)
    path = Path(directory) / CLAIM
    with open(path, "w", encoding="utf-8") as f:
        json.dump(job.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    return job


def remove_dead_directories(parent: str | os.PathLike[str], matches: Callable[[str], bool], *,
                            unclaimed_age: float) -> list[Path]:
    """Remove the directories in ``parent`` whose names ``matches`` and whose maker is
    provably gone: their claim (:func:`claim_directory`) names a process of this machine
    that is not running, or they have no readable claim and are older than
    ``unclaimed_age`` seconds (killed between making the directory and claiming it).
    A live claim, or one from another machine, keeps its directory. Returns those
    removed."""
    removed = []
    base = Path(parent)
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    for path in entries:
        if not matches(path.name) or path.is_symlink() or not path.is_dir():
            continue
        claim = read_claim(path)
        if claim is not None:
            gone = liveness(claim)[0] == "dead"
        else:
            age = 0.0
            with contextlib.suppress(OSError):
                age = time.time() - path.stat().st_mtime
            gone = age > unclaimed_age
        if gone:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# -- the root lock ----------------------------------------------------------------------------

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EBADF}
_warned_no_lock: set[str] = set()


@contextlib.contextmanager
def root_lock(root: Path, *, wait_s: float = _LOCK_WAIT_S) -> Iterator[None]:
    """Hold the advisory lock of ``root`` (the kernel releases it if the holder dies)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: the claims stay exclusive (rename)
        yield
        return

    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"{root / LOCK}: still locked by another process after {wait_s:.0f} s "
                        "(a job hung while claiming or cleaning a step directory)") from None
                time.sleep(0.01)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                if str(root) not in _warned_no_lock:
                    _warned_no_lock.add(str(root))
                    log.warning("the file system has no advisory locks: claiming a step "
                                "stays exclusive, taking over a stale one is not",
                                root=str(root), error=str(exc))
                break
        yield
    finally:
        os.close(fd)  # releases the lock


# -- claiming ---------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def discard(directory: Path) -> None:
    """Remove a directory so that it vanishes from its name at once (a rename), then
    delete it; a crash midway leaves a hidden ``.trash-`` directory, never a half-deleted
    step that could look committed."""
    trash = directory.parent / f"{_TRASH}{directory.name}-{uuid.uuid4().hex[:8]}"
    os.rename(directory, trash)
    _fsync_dir(directory.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _owner_text(directory: Path) -> str:
    claim = read_claim(directory)
    return claim.describe() if claim is not None else "a job that left no claim"


def claim_step(directory: Path, job: Job) -> None:
    """Create ``directory`` holding ``job``'s claim, or raise CheckpointError naming the
    directory and the job that has it. An existing uncommitted directory is replaced only
    when its writer is provably gone (see the module docstring)."""
    from composer_par.checkpoint.steps import is_committed

    root = directory.parent
    with root_lock(root):
        if directory.exists() or directory.is_symlink():
            _take_over(directory, job, is_committed(directory))
        staging = root / f".{directory.name}{_STAGING}{job.id}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            data = job.to_dict()
            data["step_dir"] = directory.name
            with open(staging / CLAIM, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(staging)
            try:
                os.rename(staging, directory)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                    raise
                raise CheckpointError(
                    f"{directory} was created by {_owner_text(directory)} at the same time; "
                    "two jobs save into one checkpoint root with the same step: give each "
                    "job its own root (or its own steps)") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        with _saving_lock:
            _saving.add(job.save)
        _fsync_dir(root)


def release(job: Job) -> None:
    """The save of ``job`` ended (committed or failed): its claim no longer stands for a
    thread at work, so a later save of this process may take an uncommitted one over."""
    with _saving_lock:
        _saving.discard(job.save)


def _take_over(directory: Path, job: Job, committed: bool) -> None:
    if not directory.is_dir() or directory.is_symlink():
        raise CheckpointError(f"{directory} exists and is not a step directory; remove it "
                              "or save another step")
    claim = read_claim(directory)
    owner = claim.describe() if claim is not None else "a job that left no claim"
    if committed:
        raise CheckpointError(
            f"{directory} is already a committed checkpoint (saved by {owner}); every save "
            "goes to a fresh step directory: pass another step")
    if claim is None:
        if not any(directory.iterdir()):
            directory.rmdir()
            return
        raise CheckpointError(
            f"{directory} is an unfinished save without a claim (an older version or another "
            "tool wrote it, and it may still be writing); if nothing writes it, remove it or "
            "run composer_par.checkpoint.clean_stale(root, older_than=...)")
    state, why = liveness(claim, job)
    if state != "dead":
        raise CheckpointError(
            f"{directory} is being written by another {owner}: {why}; two jobs must not "
            "save the same step into one root. If that job is gone, run "
            "composer_par.checkpoint.clean_stale(root, older_than=...) or save another step")
    log.warning("taking over an unfinished step directory", path=str(directory),
                previous=claim.id, reason=why)
    discard(directory)


def still_ours(directory: Path, job: Job) -> str:
    """Empty when ``directory``'s claim is this save's of ``job``, else why not (call
    under the root lock, right before committing)."""
    claim = read_claim(directory)
    if claim is None:
        return f"{directory} lost its claim while this job wrote it (was it removed?)"
    if claim.id != job.id or claim.save != job.save:
        return (f"{directory} was taken over by {claim.describe()} while this job wrote "
                "it; nothing was committed")
    return ""


def is_stale(directory: Path, me: Job | None = None) -> bool:
    """Whether a claim file proves the writer of an uncommitted ``directory`` gone
    (``me``: the job asking, whose own earlier claims count as gone)."""
    claim = read_claim(directory)
    return claim is not None and liveness(claim, me)[0] == "dead"


# -- explicit cleaning ------------------------------------------------------------------------


def _age(path: Path, now: float) -> float:
    """Seconds since anything under ``path`` last changed (or its claim was made)."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = path.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    claim = read_claim(path) if path.is_dir() else None
    if claim is not None:
        newest = max(newest, claim.claimed_at)
    return now - newest


@attrs.frozen
class Cleaned:
    """What :func:`clean_stale` did: removed paths, and kept ones with the reason."""

    removed: tuple[Path, ...]
    kept: tuple[tuple[Path, str], ...]


def root_to_clean(root: str | os.PathLike[str], older_than: float) -> Path:
    """``root`` as a path, once ``older_than`` (seconds) and the root itself are checked:
    what every clean-up of a root (stale steps, old committed steps) starts with."""
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) \
            or older_than < 0:
        raise ValueError(f"older_than must be a number of seconds >= 0; got {older_than!r}")
    base = Path(root)
    if not base.is_dir():
        raise CheckpointError(f"{base}: no such checkpoint root")
    return base


def clean_stale(root: str | os.PathLike[str], *, older_than: float,
                dry_run: bool = False) -> Cleaned:
    """Remove the unfinished (uncommitted) step directories under ``root`` that nothing
    can still be writing: unchanged for at least ``older_than`` seconds and without a live
    claim (a claim from this machine whose pid runs). Committed steps are never touched;
    neither are leftovers younger than ``older_than``. With ``dry_run`` nothing is
    removed. Also removes hidden leftovers of interrupted claims and removals; a root
    this user may not change is a CheckpointError saying so."""
    base = root_to_clean(root, older_than)
    try:
        return _clean_stale(base, older_than, dry_run)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise CheckpointError(
            f"{base}: cannot clean stale steps: {exc.strerror or 'permission denied'} on "
            f"{exc.filename or base} (cleaning takes the root's lock and removes "
            "directories: the root must be writable by this user)") from exc


def _clean_stale(base: Path, older_than: float, dry_run: bool) -> Cleaned:
    from composer_par.checkpoint import steps

    removed: list[Path] = []
    kept: list[tuple[Path, str]] = []
    with root_lock(base):
        now = time.time()
        candidates = [d for _, d, ok in steps.step_dirs(base) if not ok]
        candidates += sorted(p for p in base.iterdir()
                             if p.name.startswith(".") and (_STAGING in p.name
                                                            or p.name.startswith(_TRASH)))
        for path in candidates:
            age = _age(path, now)
            if age < older_than:
                kept.append((path, f"changed {age:.0f} s ago (younger than {older_than:.0f} s)"))
                continue
            claim = read_claim(path) if path.is_dir() else None
            if claim is not None:
                state, why = liveness(claim)
                if state == "live":
                    kept.append((path, f"claimed by a live {claim.describe()}: {why}"))
                    continue
            if not dry_run:
                if path.name.startswith("."):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    discard(path)
            removed.append(path)
    if removed and not dry_run:
        log.info("removed stale step directories", root=str(base),
                 removed=[p.name for p in removed])
    return Cleaned(tuple(removed), tuple(kept))
