"""One FSDP unit's optimizer state as one safetensors file under the offload directory.

A unit's file is written to a temporary name, flushed to disk, then renamed over the
unit's name, so a reader finds either the whole previous file or the whole new one. The
store remembers each file's size and CRC-32 as it wrote them and checks both before a
read: a file cut short (a full disk after a crash), changed or replaced by another
process is refused, never taken for state. A write that fails (no space left, a file
size limit, a directory that vanished or turned read-only) raises
:class:`OffloadStorageError` naming the file and the unit, and leaves no temporary file
behind.
"""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20

#: errno values that mean the device cannot take more bytes.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class OffloadStorageError(OSError):
    """An offloaded unit's optimizer state could not be written or read back intact;
    ``errno`` is the cause's (ENOSPC, EFBIG, ENOENT, ...), the message names the file, the
    unit and the fix."""

    def __str__(self) -> str:
        return str(self.strerror)


@attrs.frozen
class Written:
    """What the store wrote for a unit: its size in bytes and CRC-32."""

    size: int
    crc: int


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class UnitStore:
    """The files of one optimizer's units in ``directory`` (which must exist)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._written: dict[int, Written] = {}

    def path(self, unit: int) -> Path:
        return self.directory / f"unit-{unit:05d}.safetensors"

    def has(self, unit: int) -> bool:
        return unit in self._written

    def write(self, unit: int, label: str, tensors: dict[str, torch.Tensor],
              metadata: dict[str, str]) -> int:
        """Store ``tensors`` (contiguous, on any device) as ``unit``'s file; its size."""
        from safetensors.torch import save

        target = self.path(unit)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                    metadata=metadata)
        try:
            with temporary.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, target)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            raise OffloadStorageError(e.errno, self._write_problem(e, unit, label, target)) \
                from e
        self._written[unit] = Written(len(data), zlib.crc32(data))
        return len(data)

    def _write_problem(self, error: OSError, unit: int, label: str, target: Path) -> str:
        where = f"unit {unit} ({label}): {target}"
        if not self.directory.is_dir():
            why = (f"the offload directory {self.directory} is gone; "
                   "fix: keep the directory for the whole run")
        elif error.errno in _FULL:
            why = (f"the device holding {self.directory} is full or over a size limit "
                   f"({os.strerror(error.errno or 0)}); fix: free space there or give "
                   "path = a directory on a larger device")
        else:
            why = (f"{os.strerror(error.errno or 0) if error.errno else error}; fix: make "
                   f"{self.directory} writable by this process")
        return (f"offload could not write the optimizer state of {where}: {why}. This "
                "unit's state after the step was not stored: load the last checkpoint "
                "before training on")

    def read(self, unit: int, label: str, device: torch.device | str = "cpu"
             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``unit``'s tensors (on ``device``) and metadata, once checked against what
        was written."""
        from safetensors import safe_open

        target = self.path(unit)
        expected = self._written.get(unit)
        where = f"the optimizer state of unit {unit} ({label}) at {target}"
        if expected is None:
            raise OffloadStorageError(errno.ENOENT, f"{where} was never written")
        try:
            size = target.stat().st_size
            crc = _crc(target) if size == expected.size else None
        except FileNotFoundError as e:
            gone = ("the offload directory is gone" if not self.directory.is_dir()
                    else "the file is gone")
            raise OffloadStorageError(
                errno.ENOENT, f"{where} cannot be read: {gone}; fix: keep {self.directory} "
                "for the whole run, then load the last checkpoint") from e
        if size != expected.size or crc != expected.crc:
            found = (f"{size} bytes, {expected.size} written" if size != expected.size
                     else "its CRC-32 differs from the one written")
            raise OffloadStorageError(
                errno.EIO, f"{where} is not what offload wrote ({found}): it is not taken "
                "for state; fix: keep other processes out of the directory, then load the "
                "last checkpoint")
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(target), framework="pt", device=str(device)) as f:
            metadata = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = f.get_tensor(key)
        return tensors, metadata
