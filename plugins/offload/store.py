"""One FSDP unit's optimizer state as one safetensors file under the offload directory.

A unit's file is written to a temporary name, flushed to disk, then renamed over the
unit's name, so a reader finds either the whole previous file or the whole new one. The
store remembers each file's size and CRC-32 as it wrote them and checks both while it
reads: a file cut short (a full disk after a crash), changed or replaced by another
process is refused, never taken for state. A write that fails (no space left, a file
size limit, a directory that vanished or turned read-only) raises
:class:`OffloadStorageError` naming the file and the unit, and leaves no temporary file
behind.

The files are in the safetensors format (a JSON header, then each tensor's bytes), and
any safetensors reader opens them; the store writes and reads them itself, tensor by
tensor straight between the file and the tensors' memory, so that a unit's state is in
memory once, not also as a serialized copy or a mapped file.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

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
        """Store ``tensors`` as ``unit``'s file; its size in bytes."""
        target = self.path(unit)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        header = _header(tensors, metadata)
        crc, size = zlib.crc32(header), len(header)
        try:
            with temporary.open("wb") as f:
                f.write(header)
                for tensor in tensors.values():
                    data = _bytes_of(tensor)
                    f.write(data)
                    crc, size = zlib.crc32(data, crc), size + len(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, target)
        except OSError as e:
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
        else:
            why = (f"{os.strerror(error.errno or 0) if error.errno else error}; fix: make "
                   f"{self.directory} writable by this process")
        return (f"offload could not write the optimizer state of {where}: {why}. This "
                "unit's state after the step was not stored: load the last checkpoint "
                "before training on")

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
            with target.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected.size:
                    raise self._changed(where, f"{size} bytes, {expected.size} written")
                tensors, metadata, crc = self._read_open(f)
        except FileNotFoundError as e:
            gone = ("the offload directory is gone" if not self.directory.is_dir()
                    else "the file is gone")
            raise OffloadStorageError(
                errno.ENOENT, f"{where} cannot be read: {gone}; fix: keep {self.directory} "
                "for the whole run, then load the last checkpoint") from e
        except (ValueError, KeyError, EOFError) as e:
            raise self._changed(where, f"unreadable: {e}") from e
        if crc != expected.crc:
            raise self._changed(where, "its CRC-32 differs from the one written")
        if str(device) != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        return tensors, metadata

    @staticmethod
    def _read_open(f: Any) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
        import torch

        length_bytes = f.read(8)
        if len(length_bytes) != 8:
            raise EOFError("no header")
        text = f.read(int.from_bytes(length_bytes, "little"))
        crc = zlib.crc32(text, zlib.crc32(length_bytes))
        header = json.loads(text)
        metadata = header.pop("__metadata__", {}) or {}
        dtypes = {v: getattr(torch, k) for k, v in _DTYPES.items()}
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            tensor = torch.empty(entry["shape"], dtype=dtypes[entry["dtype"]])
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
            "state; fix: keep other processes out of the directory, then load the last "
            "checkpoint")
