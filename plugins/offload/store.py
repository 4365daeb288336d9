"""One FSDP unit's optimizer state as one safetensors file under the offload directory.

A unit's file is written to a temporary name, flushed to disk, then renamed over the
unit's name, so a reader finds either the whole previous file or the whole new one. The
store remembers each file's size and CRC-32 as it wrote them and checks both while it
reads: a file cut short (a full disk after a crash), changed or replaced by another
process is refused, never taken for state. A write that fails (no space left, a file
size limit, a directory that vanished or turned read-only) raises
:class:`OffloadStorageError` naming the file and the unit, and leaves no temporary file
behind.

Files are opened as the checkpoint readers open theirs: a unit file is read only once
it is known to be a regular file (a named pipe put in its place is an error at once, not
a read that never ends), and a temporary file is created fresh (never opened through a
name someone else placed). The store's clean-up after a failed write never hides the
failure: on a read-only or vanished directory the error raised is still
:class:`OffloadStorageError`.

The files are in the safetensors format (a JSON header, then each tensor's bytes), and
any safetensors reader opens them; the store writes and reads them itself, tensor by
tensor straight between the file and the tensors' memory, so that a unit's state is in
memory once, not also as a serialized copy or a mapped file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import open_regular

if TYPE_CHECKING:
    import torch

#: What every storage error says to do: the state was dropped, and a checkpoint load
#: into the same optimizer restores it (nothing is read from the damaged files).
LOST_STATE = ("The optimizer's offloaded state is dropped: load the last checkpoint into "
              "this optimizer (composer_par.checkpoint.load(path, model, optimizer)) before "
              "training on")

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


#: safetensors' dtype names.
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL"}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"offload cannot store {name} of dtype {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    return len(text).to_bytes(8, "little") + text


def _create(path: Path) -> Any:
    """``path`` created fresh for writing: a file or pipe already there under the name
    (left by a crash, or placed by another process) is removed first, never opened."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o600), "wb")


class UnitStore:
    """The files of one optimizer's units in ``directory`` (which must exist)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._written: dict[int, Written] = {}

    def path(self, unit: int) -> Path:
        return self.directory / f"unit-{unit:05d}.safetensors"

    def has(self, unit: int) -> bool:
        return unit in self._written

    def forget(self) -> None:
        """Drop every unit: its record, and its file where it can still be removed."""
        for unit in list(self._written):
            with contextlib.suppress(OSError):
                self.path(unit).unlink(missing_ok=True)
        self._written.clear()

    def write(self, unit: int, label: str, tensors: dict[str, torch.Tensor],
              metadata: dict[str, str]) -> int:
        """Store ``tensors`` as ``unit``'s file; its size in bytes."""
        target = self.path(unit)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        header = _header(tensors, metadata)
        crc, size = zlib.crc32(header), len(header)
        try:
            with _create(temporary) as f:
                f.write(header)
                for tensor in tensors.values():
                    data = _bytes_of(tensor)
                    f.write(data)
                    crc, size = zlib.crc32(data, crc), size + len(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, target)
        except OSError as e:
            with contextlib.suppress(OSError):  # a read-only directory refuses this too
                temporary.unlink(missing_ok=True)
            raise OffloadStorageError(e.errno, self._write_problem(e, unit, label, target)) \
                from e
        self._written[unit] = Written(size, crc)
        return size

    def _write_problem(self, error: OSError, unit: int, label: str, target: Path) -> str:
        where = f"unit {unit} ({label}): {target}"
        if not self.directory.is_dir():
            why = (f"the offload directory {self.directory} is gone; "
                   "fix: keep the directory for the whole run")
        elif error.errno in _FULL:
            why = (f"the device holding {self.directory} is full or over a size limit "
                   f"({os.strerror(error.errno or 0)}); fix: free space there or give "
                   "path = a directory on a larger device")
        elif error.errno == errno.EROFS:
            why = (f"{self.directory} is on a read-only file system; fix: give path = a "
                   "directory on a writable device (a new Offload, wrapping the optimizer "
                   "again)")
        else:
            why = (f"{os.strerror(error.errno or 0) if error.errno else error}; fix: make "
                   f"{self.directory} writable by this process")
        return (f"offload could not write the optimizer state of {where}: {why}. "
                f"{LOST_STATE}")

    def read(self, unit: int, label: str, device: torch.device | str = "cpu"
             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``unit``'s tensors (on ``device``) and metadata, checked against what was
        written."""
        target = self.path(unit)
        expected = self._written.get(unit)
        where = f"the optimizer state of unit {unit} ({label}) at {target}"
        if expected is None:
            raise OffloadStorageError(errno.ENOENT, f"{where} was never written")
        try:
            fd = open_regular(target, what="unit file of offloaded optimizer state")
        except Exception as e:  # missing, or not a regular file
            gone = ("the offload directory is gone" if not self.directory.is_dir()
                    else "the file is gone" if not os.path.lexists(target)
                    else "it is not a regular file")
            raise OffloadStorageError(
                errno.ENOENT if "gone" in gone else errno.EIO,
                f"{where} cannot be read: {gone}; fix: keep {self.directory} for the whole "
                f"run. {LOST_STATE}") from e
        try:
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected.size:
                    raise self._changed(where, f"{size} bytes, {expected.size} written")
                tensors, metadata, crc = self._read_open(f, size)
        except OSError as e:
            if isinstance(e, OffloadStorageError):
                raise
            raise OffloadStorageError(e.errno, f"{where} cannot be read: "
                                      f"{e.strerror or e}. {LOST_STATE}") from e
        except (ValueError, KeyError, EOFError, TypeError, IndexError, AttributeError) as e:
            raise self._changed(where, f"unreadable: {e}") from e
        if crc != expected.crc:
            raise self._changed(where, "its CRC-32 differs from the one written")
        if str(device) != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        return tensors, metadata

    @staticmethod
    def _read_open(f: Any, size: int
                   ) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
        """The tensors and metadata of the open unit file ``f`` of ``size`` bytes, and the
        CRC-32 of what was read. A header that does not describe the file (a changed
        byte can make it claim any length or shape) is a ValueError before anything of
        that size is allocated."""
        import torch

        length_bytes = f.read(8)
        if len(length_bytes) != 8:
            raise EOFError("no header")
        length = int.from_bytes(length_bytes, "little")
        if length > size - 8:
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        text = f.read(length)
        crc = zlib.crc32(text, zlib.crc32(length_bytes))
        try:
            header = json.loads(text)
        except RecursionError:
            raise ValueError("a header nested too deeply") from None
        if not isinstance(header, dict):
            raise ValueError("a header that is not a JSON object")
        metadata = header.pop("__metadata__", {}) or {}
        dtypes = {v: getattr(torch, k) for k, v in _DTYPES.items()}
        data_bytes = size - 8 - length
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = dtypes[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            start, end = (int(n) for n in entry["data_offsets"])
            count = 1
            for n in shape:
                count *= n
            if min(shape, default=0) < 0 or not 0 <= start <= end <= data_bytes or \
                    count * dtype.itemsize != end - start:
                raise ValueError(f"{name}: shape {shape} and offsets [{start}, {end}] do "
                                 "not fit the file")
            tensor = torch.empty(shape, dtype=dtype)
            data = _bytes_of(tensor)
            if f.readinto(data) != len(data):
                raise EOFError(f"{name} cut short")
            crc = zlib.crc32(data, crc)
            tensors[name] = tensor
        return tensors, metadata, crc

    @staticmethod
    def _changed(where: str, found: str) -> OffloadStorageError:
        return OffloadStorageError(
            errno.EIO, f"{where} is not what offload wrote ({found}): it is not taken for "
            f"state; fix: keep other processes out of the directory. {LOST_STATE}")
