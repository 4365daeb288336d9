"""Reading names and files that come from other files, safely.

An index json or DCP metadata names the files to open. A name that is absolute, that
climbs out with ``..``, or that is a symlink resolving elsewhere would make a loader read
a file outside the directory it was given (a system file, another user's data), so every
such name is resolved (symlinks followed) and must land inside that directory.

The one exception is the Hugging Face hub cache, where ``snapshots/<revision>/`` holds
symlinks into the repository's ``blobs/``: a name there may resolve inside that
``blobs/`` directory too, and nowhere else.

Files read whole (index json, checkpoint info, commit record, DCP metadata) are read with
a bound: a non-regular file (a device, a pipe) or one larger than the bound is refused
before anything is allocated.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from composer_par.checkpoint.errors import CheckpointError, CorruptFileError


def allowed_roots(base: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The resolved directories a name read inside ``base`` may point into."""
    directory = Path(base)
    roots = [Path(os.path.realpath(directory))]
    if directory.parent.name == "snapshots":
        blobs = directory.parent.parent / "blobs"
        if blobs.is_dir():
            roots.append(Path(os.path.realpath(blobs)))
    return tuple(roots)


def contained(base: str | os.PathLike[str], name: str, *, what: str,
              roots: tuple[Path, ...] | None = None) -> Path:
    """``base / name``, where ``name`` was read from ``what`` (an index, a metadata file).

    Raises CheckpointError naming ``what`` and the entry when the name is empty,
    absolute, or resolves (after following symlinks) outside ``base``.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{what}: entry {name!r} is not a file name")
    if os.path.isabs(name):
        raise CheckpointError(f"{what}: entry {name!r} is an absolute path; entries must be "
                              f"relative to {base}")
    path = Path(base) / name
    real = Path(os.path.realpath(path))
    for root in roots if roots is not None else allowed_roots(base):
        if real == root or real.is_relative_to(root):
            return path
    raise CheckpointError(f"{what}: entry {name!r} resolves to {real}, outside {base}; "
                          "a loader only opens files inside the directory it was given")


def relative_name(base: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """``path`` relative to ``base`` when inside it, else ``path`` as given."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(base))
    return str(path) if rel.startswith("..") else rel


def read_bounded(path: str | os.PathLike[str], limit: int, *, what: str = "file") -> bytes:
    """The bytes of the regular file ``path`` if it holds at most ``limit`` bytes.

    A device, pipe or socket is refused (it could be endless), and so is a larger file,
    both before any buffer is allocated.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptFileError(f"{path}: not a regular file; a {what} must be a file")
        if info.st_size > limit:
            raise CorruptFileError(f"{path}: {info.st_size} bytes, more than a {what} may "
                                   f"hold ({limit} bytes)")
        chunks = []
        total = 0
        while True:
            # One byte past the bound: a file that grew while being read is refused too.
            block = os.read(fd, min(1 << 24, limit + 1 - total))
            if not block:
                break
            chunks.append(block)
            total += len(block)
            if total > limit:
                raise CorruptFileError(f"{path}: more than a {what} may hold ({limit} bytes)")
        return b"".join(chunks)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def open_regular(path: str | os.PathLike[str], *, what: str = "file") -> int:
    """A read-only descriptor of the regular file ``path``.

    The file is opened without blocking and checked before anything reads it: opening a
    named pipe for reading waits for a writer that may never come, and a device or a
    directory where a file belongs is as wrong. Each is a CorruptFileError naming it, as
    is a missing file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CorruptFileError(f"{path}: missing (a {what})") from None
    except OSError as exc:
        raise CorruptFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptFileError(f"{path}: not a regular file; a {what} must be one")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | os.PathLike[str], *, what: str = "file") -> os.stat_result:
    """The status of ``path``, which must be a regular file (CorruptFileError naming it
    otherwise; FileNotFoundError when it is missing, for the caller to word)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise CorruptFileError(f"{path}: not a regular file; a {what} must be one")
    return info
