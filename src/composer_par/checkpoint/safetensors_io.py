"""Safetensors headers, region reads and region writes, without mmap and without pickle.

The format: 8 bytes little-endian header length N, N bytes of JSON (``name -> {dtype,
shape, data_offsets}`` plus an optional ``__metadata__`` string map), then the data, each
tensor contiguous and row-major at ``data_offsets`` relative to the end of the header.

Why not ``safe_open``: it memory-maps the file, and every page a rank touches then
counts in its resident set until the file is closed, so a rank loading its quarter of a
checkpoint peaks at about twice that quarter. Here a rank ``pread``s exactly the bytes of
its region, straight into the destination tensor when dtype and layout allow, else
through a bounded scratch buffer; the page cache is shared and is not the rank's memory.

Writing is the mirror image: the header of every output file is computed up front from
shapes and dtypes alone, the file is sized, and each rank ``pwrite``s the bytes of the
regions it owns at their offsets. No rank ever holds more than one region.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint.errors import CorruptFileError
from composer_par.checkpoint.jsonfile import parse_json_object
from composer_par.checkpoint.paths import open_regular

if TYPE_CHECKING:
    import torch

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
#: The index Hugging Face writes next to split weights (``from_pretrained`` reads it).
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A header larger than this is not a header (safetensors itself refuses above 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Scratch buffer bound for reads that cannot land in the destination directly.
SCRATCH_BYTES = 16 * 1024 * 1024

#: safetensors dtype code -> torch dtype name, and element size in bytes.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_CODES = {name: code for code, (name, _) in DTYPES.items()}


def dtype_code(dtype: torch.dtype | str) -> str:
    """The safetensors code of a torch dtype (``torch.float32`` -> ``"F32"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _CODES:
        raise ValueError(f"dtype {name} cannot be stored in safetensors; "
                         f"supported: {sorted(_CODES)}")
    return _CODES[name]


def torch_dtype(code: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[code][0])  # type: ignore[no-any-return]


def dtype_name(code: str) -> str:
    return DTYPES[code][0]


@attrs.frozen
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    name: str
    dtype: str  # the safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte
    path: str  # the file holding it

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{list(self.shape)} {dtype_name(self.dtype)}"


@attrs.frozen
class Header:
    path: str
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and check the header of one safetensors file, reading only the header.

    Raises CorruptFileError naming the file (and the key) for a short file, a header
    that is not JSON, an unknown dtype, offsets that disagree with shape and dtype,
    overlapping tensors, or data that ends past the end of the file (truncation).
    """
    path = str(path)
    fd = open_regular(path, what="safetensors file")
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CorruptFileError(f"{path}: not a safetensors file ({size} bytes, "
                                   "shorter than the 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CorruptFileError(
                f"{path}: header length {length} does not fit the file ({size} bytes): "
                "truncated or not safetensors")
        raw = os.pread(fd, length, 8)
    except OSError as exc:
        raise CorruptFileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    parsed = parse_json_object(path, raw, what="header")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str)
                                                 for v in metadata.values()):
        raise CorruptFileError(f"{path}: __metadata__ is not a map of strings to strings")
    data_start = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in parsed.items():
        entries[name] = _entry(path, name, info, data_start)
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in itertools.pairwise(spans):
        if begin_b < end_a:
            raise CorruptFileError(f"{path}: tensors {name_a} and {name_b} overlap")
    if spans and spans[-1][1] > size:
        _, end, name = max(spans, key=lambda s: s[1])
        raise CorruptFileError(
            f"{path}: truncated: key {name} ends at byte {end}, the file has {size} bytes")
    return Header(path, entries, dict(metadata), data_start, size)


def _entry(path: str, name: str, info: Any, data_start: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CorruptFileError(f"{path}: key {name}: not a tensor entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise CorruptFileError(f"{path}: key {name}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
        raise CorruptFileError(f"{path}: key {name}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise CorruptFileError(f"{path}: key {name}: bad data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != expected:
        raise CorruptFileError(
            f"{path}: key {name}: data_offsets span {end - begin} bytes, but shape "
            f"{shape} of {dtype} needs {expected}")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end, path)


# -- reading regions -------------------------------------------------------------------


def _runs(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, list[tuple[int, ...]], int]:
    """The region ``offsets``/``lengths`` of a row-major tensor ``shape`` as contiguous
    runs: ``(k, outer index ranges, run elements)``. Tensor dims after ``k`` are fully
    covered, so each run is ``lengths[k] * prod(shape[k+1:])`` consecutive elements."""
    ndim = len(shape)
    k = 0
    for d in range(ndim - 1, -1, -1):
        if lengths[d] != shape[d]:
            k = d
            break
    inner = math.prod(shape[k + 1:]) if ndim else 1
    run = (lengths[k] * inner) if ndim else 1
    return k, [tuple(range(offsets[d], offsets[d] + lengths[d])) for d in range(k)], run


def _run_starts(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
                ) -> tuple[Iterator[int], int, int]:
    """Element offsets (in the stored tensor) of each run, the run count and length."""
    k, outer, run = _runs(shape, offsets, lengths)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    base = offsets[k] * strides[k] if shape else 0
    count = math.prod(len(r) for r in outer)

    def starts() -> Iterator[int]:
        for index in itertools.product(*outer):
            yield base + sum(i * strides[d] for d, i in enumerate(index))

    return starts(), count, run


def _buffer_at(tensor: torch.Tensor, byte_offset: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` of a contiguous CPU tensor's memory (no copy)."""
    address = tensor.data_ptr() + byte_offset
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _pread_into(fd: int, view: memoryview, offset: int, entry: TensorEntry) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CorruptFileError(f"{entry.path}: truncated while reading key {entry.name} "
                                   f"(byte {offset + done})")
        done += got


def read_region(
    fd: int,
    entry: TensorEntry,
    offsets: Sequence[int],
    lengths: Sequence[int],
    out: torch.Tensor,
) -> int:
    """Read the region of ``entry`` at ``offsets``/``lengths`` into ``out`` (CPU, shape
    ``lengths``), converting the dtype if it differs. Returns the bytes read.

    When ``out`` is contiguous and of the file's dtype the bytes land in it directly;
    otherwise at most :data:`SCRATCH_BYTES` of scratch is held at a time.
    """
    import torch

    if tuple(out.shape) != tuple(lengths):
        raise CorruptFileError(f"{entry.path}: key {entry.name}: region {list(lengths)} "
                               f"does not fit the destination {list(out.shape)}")
    if out.device.type != "cpu" or not out.is_contiguous():
        # A strided destination (a narrowed view) or device memory: through one region's
        # worth of host staging.
        staging = torch.empty(tuple(lengths), dtype=out.dtype)
        done = read_region(fd, entry, offsets, lengths, staging)
        out.copy_(staging)
        return done
    starts, count, run = _run_starts(entry.shape, offsets, lengths)
    size = entry.itemsize
    if count == 0 or run == 0:
        return 0
    src_dtype = torch_dtype(entry.dtype)
    flat = out.view(-1)
    if out.dtype == src_dtype:
        for i, start in enumerate(starts):
            _pread_into(fd, _buffer_at(out, i * run * size, run * size),
                        entry.begin + start * size, entry)
        return count * run * size
    # Another dtype: through a bounded scratch buffer, then converted by copy_.
    piece = max(1, min(run, SCRATCH_BYTES // size))
    per_batch = max(1, SCRATCH_BYTES // (run * size)) if piece == run else 1
    scratch = torch.empty(min(count, per_batch) * piece, dtype=src_dtype)
    if piece == run:
        batch: list[int] = []
        position = 0
        pending: list[int | None] = [*starts, None]  # None: flush what is left
        for item in pending:
            if item is not None:
                batch.append(item)
            if batch and (item is None or len(batch) == per_batch):
                for j, s in enumerate(batch):
                    _pread_into(fd, _buffer_at(scratch, j * run * size, run * size),
                                entry.begin + s * size, entry)
                n = len(batch) * run
                flat[position:position + n].copy_(scratch[:n])
                position += n
                batch.clear()
        return count * run * size
    # Runs larger than the scratch buffer: each streamed in pieces.
    for i, start in enumerate(starts):
        for lo in range(0, run, piece):
            n = min(piece, run - lo)
            _pread_into(fd, _buffer_at(scratch, 0, n * size), entry.begin + (start + lo) * size,
                        entry)
            flat[i * run + lo:i * run + lo + n].copy_(scratch[:n])
    return count * run * size


def read_tensor(entry: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor of ``entry`` (one tensor's memory), optionally converted."""
    import torch

    out = torch.empty(entry.shape, dtype=dtype or torch_dtype(entry.dtype))
    fd = open_regular(entry.path, what="safetensors file")
    try:
        read_region(fd, entry, [0] * len(entry.shape), list(entry.shape), out)
    finally:
        os.close(fd)
    return out


# -- writing ---------------------------------------------------------------------------


@attrs.frozen
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


@attrs.frozen
class FileLayout:
    """Where each tensor of a set of output files goes, computed from shapes alone."""

    files: tuple[tuple[str, tuple[PlannedTensor, ...]], ...]  # (file name, tensors)

    @classmethod
    def plan(
        cls, tensors: Sequence[PlannedTensor], max_file_bytes: int | None = None
    ) -> FileLayout:
        """Tensors in order, split into files of at most ``max_file_bytes`` (a tensor
        larger than that gets a file of its own); names as Hugging Face writes them."""
        groups: list[list[PlannedTensor]] = [[]]
        used = 0
        for t in tensors:
            if max_file_bytes and groups[-1] and used + t.nbytes > max_file_bytes:
                groups.append([])
                used = 0
            groups[-1].append(t)
            used += t.nbytes
        if len(groups) == 1:
            return cls(((SINGLE_NAME, tuple(groups[0])),))
        n = len(groups)
        return cls(tuple((f"model-{i:05d}-of-{n:05d}{SUFFIX}", tuple(g))
                         for i, g in enumerate(groups, 1)))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for _, ts in self.files for t in ts)

    def header_bytes(self, tensors: Sequence[PlannedTensor],
                     metadata: Mapping[str, str] | None = None) -> bytes:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # keep the data 8-byte aligned
        return struct.pack("<Q", len(raw)) + raw

    def entries(self, directory: str | os.PathLike[str],
                metadata: Mapping[str, str] | None = None) -> dict[str, TensorEntry]:
        """The TensorEntry each tensor will have once written under ``directory``."""
        out: dict[str, TensorEntry] = {}
        for file_name, tensors in self.files:
            start = len(self.header_bytes(tensors, metadata))
            offset = start
            for t in tensors:
                out[t.name] = TensorEntry(t.name, t.dtype, t.shape, offset, offset + t.nbytes,
                                          str(Path(directory) / file_name))
                offset += t.nbytes
        return out

    def index(self) -> dict[str, Any]:
        return {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {t.name: name for name, ts in self.files for t in ts},
        }

    def create_files(self, directory: str | os.PathLike[str]) -> None:
        """Write every header and size every file (data still holes); add the index json
        when there are several files."""
        for file_name, tensors in self.files:
            header = self.header_bytes(tensors)
            path = Path(directory) / file_name
            with open(path, "wb") as f:
                f.write(header)
                f.truncate(len(header) + sum(t.nbytes for t in tensors))
                f.flush()
                os.fsync(f.fileno())
        if len(self.files) > 1:
            (Path(directory) / INDEX_NAME).write_text(json.dumps(self.index(), indent=2) + "\n")


def write_region(
    fd: int,
    entry: TensorEntry,
    offsets: Sequence[int],
    tensor: torch.Tensor,
) -> int:
    """Write ``tensor`` (a region of ``entry`` starting at ``offsets``) into its place,
    converting to the file's dtype. Returns the bytes written."""
    lengths = list(tensor.shape)
    src = tensor.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    if src.dtype != torch_dtype(entry.dtype):
        src = src.to(torch_dtype(entry.dtype))
    src = src.contiguous()
    starts, count, run = _run_starts(entry.shape, offsets, lengths)
    size = entry.itemsize
    for i, start in enumerate(starts):
        view = _buffer_at(src, i * run * size, run * size)
        done = 0
        while done < len(view):
            done += os.pwritev(fd, [view[done:]], entry.begin + start * size + done)
    return count * run * size


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` as one safetensors file, atomically (a temporary file renamed
    into place). Needs no NumPy, unlike ``safetensors.torch.save_file``."""
    target = Path(path)
    planned = [PlannedTensor(name, dtype_code(t.dtype), tuple(t.shape))
               for name, t in tensors.items()]
    layout = FileLayout(((target.name, tuple(planned)),))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    header = layout.header_bytes(planned, metadata)
    with open(tmp, "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(t.nbytes for t in planned))
    entries = FileLayout(((tmp.name, tuple(planned)),)).entries(tmp.parent, metadata)
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for name, tensor in tensors.items():
            write_region(fd, entries[name], [0] * tensor.dim(), tensor)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
