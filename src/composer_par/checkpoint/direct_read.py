"""Reading a stored DCP chunk straight into the tensor that receives it.

DCP's ``FileSystemReader`` loads each stored chunk with ``torch.load`` into a tensor of
its own and then copies the part it needs into the model: every byte is copied twice and
the whole chunk is held a second time, which is what puts a load above a rank's share of
memory. A stored chunk is a ``torch.save`` zip whose tensor bytes lie uncompressed in one
record, so where the part a rank needs is contiguous in that record and the tensor that
receives it is a plain contiguous CPU tensor of the same dtype, the bytes are read with
``preadv`` directly into it: one copy, no temporary. Everything else (a non-contiguous
part, a dtype to convert, a zip this module does not recognise) returns ``False`` and is
left to DCP, so this is never less general than DCP, only faster where it applies.

The zip is parsed here rather than with ``torch.load`` on the meta device (which gives the
same layout) because that runs torch's whole load path for every chunk, where finding
the bytes takes only the few small reads below. Its pickle is read by an unpickler that knows
the names torch.save writes for a plain tensor (its two tensor rebuilds,
``OrderedDict``, the storage types, the dtypes); anything else means
"not recognised", never an error.
"""

from __future__ import annotations

import collections
import ctypes
import io
import os
import pickle
import struct
import sys
from typing import Any

import attrs

READ_BLOCK = 64 * 1024 * 1024  # bytes per preadv: well below Linux's 2 GiB cap per call
_TAIL = 4096  # bytes read from a chunk's end: the end records and, usually, the directory


@attrs.frozen
class StoredTensor:
    """Where a chunk's tensor lies in its file and how its elements are laid out."""

    data_offset: int  # in the file: the first byte of the storage record
    nbytes: int  # of the storage record
    dtype: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements


class _NotRecognised(Exception):
    pass


_DTYPES: dict[str, Any] | None = None


@attrs.frozen
class _Storage:
    dtype: Any
    key: str
    numel: int


@attrs.frozen
class _Rebuilt:
    storage: _Storage
    dtype: Any
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> _Rebuilt:
    """torch's ``_rebuild_tensor_v2``: the storage's type gives the dtype."""
    if not isinstance(storage, _Storage):
        raise _NotRecognised
    return _Rebuilt(storage, storage.dtype, int(storage_offset), tuple(map(int, size)),
                    tuple(map(int, stride)))


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, _grad: Any,
                _hooks: Any, dtype: Any, *_: Any) -> _Rebuilt:
    """torch's ``_rebuild_tensor_v3`` (dtypes without a storage type, float8 say): an
    untyped storage (bytes) and the dtype given apart."""
    import torch

    if not isinstance(storage, _Storage) or not isinstance(dtype, torch.dtype):
        raise _NotRecognised
    return _Rebuilt(storage, dtype, int(storage_offset), tuple(map(int, size)),
                    tuple(map(int, stride)))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        global _DTYPES
        import torch

        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return ("dtype", torch.uint8)
        if module == "torch":
            if _DTYPES is None:
                from composer_par.plugin import torch_private

                _DTYPES = torch_private.storage_dtypes()
            if name in _DTYPES:
                return ("dtype", _DTYPES[name])
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise _NotRecognised

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], tuple) and pid[1][0] == "dtype"):
            raise _NotRecognised
        return _Storage(pid[1][1], str(pid[2]), int(pid[4]))


def _pread(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise _NotRecognised
    return data


def _directory(fd: int, start: int, length: int) -> dict[str, tuple[int, int]]:
    """The chunk's zip directory: record name -> (size, local header offset); every record
    stored uncompressed, or not recognised."""
    tail_len = min(length, _TAIL)
    tail = _pread(fd, tail_len, start + length - tail_len)
    if tail[-22:-18] != b"PK\x05\x06" or struct.unpack("<H", tail[-2:])[0] != 0:
        raise _NotRecognised  # torch writes no zip comment
    entries, cd_size, cd_offset = struct.unpack("<xxxxxxxxxxHII", tail[-22:-2])
    if tail[-42:-38] == b"PK\x06\x07":  # the zip64 end record, which torch always writes
        (record_at,) = struct.unpack("<Q", tail[-34:-26])
        if record_at + 56 > length:
            raise _NotRecognised
        record = _pread(fd, 56, start + record_at)
        if record[:4] != b"PK\x06\x06":
            raise _NotRecognised
        entries, _, cd_size, cd_offset = struct.unpack("<QQQQ", record[24:56])
    if cd_offset + cd_size > length:
        raise _NotRecognised
    if cd_offset >= length - tail_len:
        directory = tail[cd_offset - (length - tail_len):][:cd_size]
    else:
        directory = _pread(fd, cd_size, start + cd_offset)
    found: dict[str, tuple[int, int]] = {}
    at = 0
    for _ in range(entries):
        if directory[at:at + 4] != b"PK\x01\x02":
            raise _NotRecognised
        (method, _crc, packed, size, name_len, extra_len, comment_len, header) = \
            struct.unpack("<10xHxxxxIIIHHH8xI", directory[at:at + 46])
        name = directory[at + 46:at + 46 + name_len].decode("utf-8", "replace")
        extra = directory[at + 46 + name_len:at + 46 + name_len + extra_len]
        wide = [v == 0xFFFFFFFF for v in (size, packed, header)]
        if any(wide):  # the zip64 extra field holds the values that did not fit
            values = _zip64_values(extra, sum(wide))
            size, packed, header = (values.pop(0) if w else v
                                    for v, w in zip((size, packed, header), wide, strict=True))
        if method != 0 or packed != size:
            raise _NotRecognised  # compressed: not a plain run of bytes
        found[name.split("/", 1)[-1]] = (size, header)
        at += 46 + name_len + extra_len + comment_len
    return found


def _zip64_values(extra: bytes, count: int) -> list[int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[at:at + 4])
        if tag == 1 and size >= 8 * count:
            return list(struct.unpack(f"<{count}Q", extra[at + 4:at + 4 + 8 * count]))
        at += 4 + size
    raise _NotRecognised


def _record(fd: int, start: int, length: int, entry: tuple[int, int]) -> tuple[int, int]:
    """(offset in the chunk, size) of a record's bytes."""
    size, header = entry
    local = _pread(fd, 30, start + header)
    if local[:4] != b"PK\x03\x04":
        raise _NotRecognised
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    data = header + 30 + name_len + extra_len
    if data + size > length:
        raise _NotRecognised
    return data, size


def stored_tensor(fd: int, start: int, length: int) -> StoredTensor | None:
    """The layout of the tensor DCP stored at ``start, length`` of the file ``fd`` (a
    ``torch.save`` zip), or None where it is not one this module reads."""
    try:
        records = _directory(fd, start, length)
        if "data.pkl" not in records or "byteorder" not in records:
            return None
        at, size = _record(fd, start, length, records["byteorder"])
        if _pread(fd, size, start + at).decode("ascii", "replace") != sys.byteorder:
            return None
        at, size = _record(fd, start, length, records["data.pkl"])
        if size > 1 << 20:
            return None
        rebuilt = _Unpickler(io.BytesIO(_pread(fd, size, start + at))).load()
        if not isinstance(rebuilt, _Rebuilt):
            return None
        storage = rebuilt.storage
        entry = records.get(f"data/{storage.key}")
        if entry is None:
            return None
        at, size = _record(fd, start, length, entry)
    except Exception:  # whatever the bytes hold: DCP reads them (and reports on them)
        return None
    if size != storage.numel * storage.dtype.itemsize:
        return None
    return StoredTensor(start + at, size, rebuilt.dtype, rebuilt.size, rebuilt.stride,
                        rebuilt.storage_offset)


def read_into(fd: int, stored: StoredTensor, offsets: Any, lengths: Any, target: Any) -> bool:
    """Read the part ``offsets, lengths`` of the stored tensor into ``target`` if that part
    is one contiguous run of the record and ``target`` a contiguous CPU tensor of its dtype
    and shape; False (nothing read) otherwise."""
    import torch

    offsets, lengths = tuple(int(o) for o in offsets), tuple(int(n) for n in lengths)
    if (type(target) is not torch.Tensor or target.device.type != "cpu"
            or target.dtype != stored.dtype or tuple(target.shape) != lengths
            or not target.is_contiguous() or len(offsets) != len(stored.size)):
        return False
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, stored.size,
                                                         strict=True)):
        return False
    # The part is contiguous in the record where it is contiguous as a view of the stored
    # tensor: element (i, j, ...) of the part lies at the stored strides.
    expected = 1
    for n, stride in zip(reversed(lengths), reversed(stored.stride), strict=True):
        if n != 1 and stride != expected:
            return False
        expected *= n
    first = stored.storage_offset + sum(o * s for o, s in zip(offsets, stored.stride,
                                                              strict=True))
    itemsize = stored.dtype.itemsize
    nbytes = target.numel() * itemsize
    begin = first * itemsize
    if begin < 0 or begin + nbytes > stored.nbytes:
        return False
    if nbytes == 0:
        return True
    view = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:done + min(READ_BLOCK, nbytes - done)]],
                        stored.data_offset + begin + done)
        if got <= 0:
            raise EOFError(f"the file ends {nbytes - done} bytes before the tensor does")
        done += got
    # As the copy_ it stands in for would: autograd and anything else watching the
    # tensor for in-place changes sees that it changed.
    torch.autograd.graph.increment_version(target)
    return True
