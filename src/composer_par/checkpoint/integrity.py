"""Digests of every file of a step, recorded in its commit marker, and their checks.

Plain DCP stores no checksum: a flipped byte in a shard file, or two storage entries
swapped in ``.metadata``, load as wrong weights without a word. composer_par's commit
marker (``COMMITTED``) records, for every file of the step, its size and the CRC-32 of
each *segment*: for a DCP shard file, each stored chunk (the byte range DCP reads as one
unit), so that a rank loading a checkpoint checks exactly the bytes it reads; for the
other files (``.metadata``, ``composer_par.json``, the RNG files) the whole file.
Segments tile their file, so checking every segment of a file checks every byte.

Each rank digests the shard files it writes as the bytes go out (no byte is read back;
the CRC-32 that ``torch.save`` already computes for each tensor's bytes is taken from the
zip it writes rather than computed twice), and its other files right after writing
them; rank 0 gathers the records and writes them into the marker, last. ``load`` checks
``.metadata`` and ``composer_par.json`` before using them, and each stored chunk before
DCP reads it, so corrupt bytes never reach the model; ``inspect --verify`` checks every
byte of every file.

Why CRC-32 (zlib's function): it is the digest torch.save already writes for each
tensor's bytes, so a save need not compute it again; computed by zlib-ng (a dependency)
with the CPU's carry-less multiply it is several times faster than the standard
library's zlib and than the cryptographic digests, close to xxHash's xxh3 (not worth a
digest torch.save does not write), and it releases the GIL; docs/checkpoints.md has the
measurements. Both compute the same values, so digests recorded by either are read by
the other (without zlib-ng, zlib is used). It is made to catch accidents (bit rot, torn
or truncated writes, a file of another step or copy): every burst of up to 32 flipped
bits is caught, any other damage with probability 1 - 2**-32 per chunk. It is no defence
against someone who edits files on purpose (they can recompute it); what protects against
such files is that nothing read runs code (DCP's ``.metadata`` pickle is read by an
unpickler that finds only the classes DCP metadata holds) and every name read stays
inside its directory.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint.errors import CheckpointError, CorruptFileError
from composer_par.checkpoint.paths import check_regular, contained, open_regular

if TYPE_CHECKING:
    from composer_par.checkpoint.dcp_reader import VerifyingReader

try:
    # zlib's CRC-32 (the same values), computed with the CPU's carry-less multiply.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # zlib's own: the same digests, computed more slowly
    from zlib import crc32

DIGEST = "crc32"
BLOCK = 16 * 1024 * 1024  # bytes hashed per read: bounds the scratch memory
SHARD_SUFFIX = ".distcp"  # DCP's shard files; everything else of a step is small


@attrs.frozen
class FileRecord:
    """A file's size and the ``(offset, length, crc32)`` of each segment (tiling it)."""

    size: int
    segments: tuple[tuple[int, int, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_json(cls, name: str, data: Any, where: str) -> FileRecord:
        try:
            size = int(data["size"])
            segments = tuple((int(o), int(n), int(c)) for o, n, c in data["segments"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFileError(f"{where}: the record of {name} is malformed ({exc})") \
                from None
        position = 0
        for offset, length, _ in segments:
            if offset != position or length < 0:
                raise CorruptFileError(f"{where}: the segments of {name} do not tile it")
            position += length
        if position != size:
            raise CorruptFileError(f"{where}: the segments of {name} do not cover its "
                                   f"{size} bytes")
        return cls(size, segments)


def crc_range(fd: int, offset: int, length: int, scratch: memoryview | None = None) -> int:
    """The CRC-32 of ``length`` bytes of ``fd`` at ``offset`` (a short file reads short).

    Large ranges are hashed through a window of the file mapped into memory, read where
    the page cache holds it: no copy into a buffer first. A mapping holds at most
    :data:`BLOCK` bytes at a time, so the resident set grows by no more than that. Where
    the file cannot be mapped, it is read with ``pread`` into ``scratch``."""
    if length >= _MAP_AT_LEAST:
        with contextlib.suppress(OSError, ValueError):
            return _crc_mapped(fd, offset, length)
    view = scratch if scratch is not None else memoryview(bytearray(min(BLOCK, max(length, 1))))
    crc = 0
    done = 0
    while done < length:
        n = min(len(view), length - done)
        got = os.preadv(fd, [view[:n]], offset + done)
        if got <= 0:
            break
        crc = crc32(view[:got], crc)
        done += got
    return crc


_MAP_AT_LEAST = 1 << 20


def _crc_mapped(fd: int, offset: int, length: int) -> int:
    import mmap

    end = min(offset + length, os.fstat(fd).st_size)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    crc = 0
    position = offset
    while position < end:
        base = position - position % mmap.ALLOCATIONGRANULARITY
        size = min(BLOCK, end - base)
        window = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ, offset=base)
        try:
            with memoryview(window) as view:
                crc = crc32(view[position - base:size], crc)
        finally:
            window.close()
        position = base + size
    return crc


def digest_file(path: str | os.PathLike[str]) -> FileRecord:
    """One segment over the whole file."""
    return digest_ranges(path, [])


def digest_ranges(path: str | os.PathLike[str], ranges: Iterable[tuple[int, int]]
                  ) -> FileRecord:
    """Segments for ``ranges`` (the chunks written at ``offset, length``) and for any gap
    between them, so that the segments tile the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        cuts: list[tuple[int, int]] = []
        position = 0
        for offset, length in sorted(set(ranges)):
            if offset < position or offset + length > size:
                raise CheckpointError(f"{path}: chunks at {offset}+{length} overlap or end past "
                                      f"the {size} bytes written")
            if offset > position:
                cuts.append((position, offset - position))
            if length:
                cuts.append((offset, length))
            position = offset + length
        if position < size or not cuts:
            cuts.append((position, size - position))
        scratch = memoryview(bytearray(min(BLOCK, max(size, 1))))
        return FileRecord(size, tuple((o, n, crc_range(fd, o, n, scratch)) for o, n in cuts))
    finally:
        os.close(fd)


class Manifest:
    """The digest records of one committed step directory, by file name (relative)."""

    def __init__(self, directory: Path, files: Mapping[str, FileRecord]) -> None:
        self.directory = directory
        self.files = dict(files)
        self._verified: set[tuple[str, int]] = set()

    @classmethod
    def from_commit(cls, directory: Path, data: Mapping[str, Any]) -> Manifest | None:
        """The manifest of a commit marker's content (None: it predates digests)."""
        files = data.get("files")
        if files is None:
            return None
        where = str(directory / "COMMITTED")
        if data.get("digest") != DIGEST or not isinstance(files, dict):
            raise CorruptFileError(f"{where}: unknown digest {data.get('digest')!r} or no file "
                                   "table")
        records = {}
        for name, record in files.items():
            contained(directory, name, what=where)
            records[name] = FileRecord.from_json(name, record, where)
        return cls(directory, records)

    def to_json(self) -> dict[str, Any]:
        return {"digest": DIGEST,
                "files": {name: r.to_json() for name, r in sorted(self.files.items())}}

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    # -- checks ----------------------------------------------------------------------------

    def _record(self, name: str) -> FileRecord:
        record = self.files.get(name)
        if record is None:
            raise CorruptFileError(f"{self.directory / name}: not part of the commit record "
                                   "of this step (was it added afterwards?)")
        return record

    def check_size(self, name: str) -> None:
        record = self._record(name)
        path = self.directory / name
        try:
            size = check_regular(path, what="checkpoint file").st_size
        except FileNotFoundError:
            raise CorruptFileError(f"{path}: missing (the commit recorded {record.size} "
                                   "bytes)") from None
        if size != record.size:
            what = "truncated" if size < record.size else "longer than committed"
            raise CorruptFileError(f"{path}: {what}: {size} bytes, the commit recorded "
                                   f"{record.size}")

    def check_bytes(self, name: str, data: bytes) -> None:
        """``data`` is the whole file ``name`` as read: its size and every segment."""
        record = self._record(name)
        path = self.directory / name
        if len(data) != record.size:
            what = "truncated" if len(data) < record.size else "longer than committed"
            raise CorruptFileError(f"{path}: {what}: {len(data)} bytes, the commit recorded "
                                   f"{record.size}")
        view = memoryview(data)
        for offset, length, crc in record.segments:
            got = crc32(view[offset:offset + length])
            if got != crc:
                raise _differs(path, offset, length, crc, got)

    def check_range(self, name: str, offset: int, length: int, fd: int,
                    scratch: memoryview | None = None, key: str = "") -> int:
        """Check every segment of ``name`` that overlaps ``offset, offset + length`` (each
        once per manifest). Returns the bytes hashed."""
        record = self._record(name)
        path = self.directory / name
        hashed = 0
        for seg_offset, seg_length, crc in record.segments:
            if seg_offset + seg_length <= offset or seg_offset >= offset + length:
                continue
            if (name, seg_offset) in self._verified:
                continue
            got = crc_range(fd, seg_offset, seg_length, scratch)
            if got != crc:
                raise _differs(path, seg_offset, seg_length, crc, got, key)
            self._verified.add((name, seg_offset))
            hashed += seg_length
        return hashed

    def verify_file(self, name: str, chunks: Iterable[tuple[int, int, str]] = ()) -> None:
        """Every byte of ``name``; ``chunks``: the ``(offset, length, key)`` of the stored
        chunks in it, so that a damaged one is named by its key."""
        self.check_size(name)
        path = self.directory / name
        fd = open_regular(path, what="checkpoint file")
        try:
            for offset, length, key in sorted(chunks):
                self.check_range(name, offset, length, fd, key=key)
            self.check_range(name, 0, self.files[name].size, fd)  # what no chunk covers
        finally:
            os.close(fd)

    def verify_all(self, chunks: Mapping[str, list[tuple[int, int, str]]] | None = None
                   ) -> list[str]:
        """Every file, every byte: the problems found (empty: all verified). ``chunks``:
        :func:`stored_chunks` of the step's metadata, to name the key of a damaged
        chunk."""
        problems = []
        for name in sorted(self.files):
            try:
                self.verify_file(name, (chunks or {}).get(name, ()))
            except CheckpointError as exc:
                problems.append(str(exc))
        return problems

    def quick_check(self) -> list[str]:
        """Every recorded file exists with its recorded size, and the files that are not
        shards (``.metadata``, the info, the RNG states: small) match their digests."""
        problems = []
        for name in sorted(self.files):
            try:
                if name.endswith(SHARD_SUFFIX):
                    self.check_size(name)
                else:
                    self.verify_file(name)
            except CheckpointError as exc:
                problems.append(str(exc))
        return problems


def stored_chunks(metadata: Any) -> dict[str, list[tuple[int, int, str]]]:
    """The ``(offset, length, key)`` of every stored chunk of DCP ``metadata``, by file."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        out.setdefault(info.relative_path, []).append(
            (int(info.offset), int(info.length), str(index.fqn)))
    return out


def _differs(path: Path, offset: int, length: int, expected: int, got: int,
             key: str = "") -> CorruptFileError:
    what = f" ({key})" if key else ""
    return CorruptFileError(
        f"{path}: bytes {offset}-{offset + length - 1}{what} differ from what was committed "
        f"({DIGEST} {got:08x}, recorded {expected:08x}): the file changed after the save; "
        "load another step")


# -- DCP storage ------------------------------------------------------------------------------


# A write at least this large is a tensor's data: its CRC-32 is taken from the zip data
# descriptor torch.save writes right after it (see _DigestingStream).
_LARGE_WRITE = 64 * 1024


def _descriptor_crc(chunk: memoryview, length: int) -> int | None:
    """The CRC-32 a zip data descriptor (``PK\\x07\\x08``) gives for the ``length`` bytes
    before it, or None if ``chunk`` is not the descriptor of exactly those bytes."""
    if len(chunk) == 16 and bytes(chunk[:4]) == b"PK\x07\x08":
        _, crc, packed, size = struct.unpack("<IIII", chunk)
    elif len(chunk) == 24 and bytes(chunk[:4]) == b"PK\x07\x08":
        _, crc, packed, size = struct.unpack("<IIQQ", chunk)
    else:
        return None
    return int(crc) if packed == size == length else None


class _DigestingStream:
    """A shard file being written, digested as it is written, without reading it back.

    Segments end wherever the writer asks for its position (DCP asks at the start and end
    of every stored chunk). Within a chunk (a ``torch.save`` zip) the small writes are
    hashed here, and the data of each tensor (one large write) takes the CRC-32 torch
    computed for it and wrote in the zip data descriptor that follows it: zip's CRC-32 is
    zlib's, over the same bytes, so the tensor bytes are not hashed a second time. A large
    write not followed by its descriptor is left for :meth:`record`'s caller to hash from
    the file (``None`` in its segment)."""

    def __init__(self, raw: Any, zip_crcs: bool) -> None:
        self.raw = raw
        self.zip_crcs = zip_crcs  # torch.save writes a CRC-32 per record
        self.position = 0
        self.run_start = 0
        self.run_crc = 0
        self.pending: tuple[int, int] | None = None
        self.segments: list[tuple[int, int, int | None]] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        chunk = view[:written]
        if self.zip_crcs and written >= _LARGE_WRITE:
            self._close_run()
            if self.pending is not None and sum(self.pending) == self.position:
                self.pending = (self.pending[0], self.pending[1] + written)
            else:
                self._settle(None)
                self.pending = (self.position, written)
            self.position += written
            self.run_start = self.position
            return written
        if self.pending is not None:
            self._settle(_descriptor_crc(chunk, self.pending[1]))
        self.run_crc = crc32(chunk, self.run_crc)
        self.position += written
        return written

    def _settle(self, crc: int | None) -> None:
        if self.pending is not None:
            self.segments.append((*self.pending, crc))
            self.pending = None

    def _close_run(self) -> None:
        if self.position > self.run_start:
            self.segments.append((self.run_start, self.position - self.run_start, self.run_crc))
        self.run_start, self.run_crc = self.position, 0

    def tell(self) -> int:
        self._settle(None)
        self._close_run()
        return self.position

    def record(self, path: Path) -> FileRecord:
        """The record of the whole file (now closed); segments whose CRC is unknown are
        hashed from ``path``."""
        self.tell()
        segments = []
        fd = os.open(path, os.O_RDONLY) if any(c is None for *_, c in self.segments) else -1
        try:
            for offset, length, crc in self.segments:
                segments.append((offset, length, crc if crc is not None
                                 else crc_range(fd, offset, length)))
        finally:
            if fd >= 0:
                os.close(fd)
        return FileRecord(self.position, tuple(segments))

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, ...: the file's own
        return getattr(self.raw, name)


def _aligned(record: FileRecord, spans: list[tuple[int, int]]) -> bool:
    """Whether every chunk written starts and ends on a segment boundary."""
    cuts = {0, record.size} | {o for o, _, _ in record.segments} | {
        o + n for o, n, _ in record.segments}
    return all(o in cuts and o + n in cuts and o + n <= record.size for o, n in spans)


def digesting_writer(path: Path, **kwargs: Any) -> Any:
    """A DCP ``FileSystemWriter`` that digests every shard file it writes, by stored
    chunk, as the bytes go out (``writer.records``: file name -> FileRecord). Should a
    chunk not fall on a segment boundary (a writer that asks for its position elsewhere),
    that file is digested again from the page cache, by chunk."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.serialization import get_crc32_options

    streams: dict[str, _DigestingStream] = {}

    class DigestingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            with super().create_stream(path, mode) as raw:
                if mode != "wb" or not str(path).endswith(SHARD_SUFFIX):
                    yield raw
                    return
                stream = _DigestingStream(raw, zip_crcs=bool(get_crc32_options()))
                streams[Path(path).name] = stream
                yield stream

    class DigestingWriter(FileSystemWriter):
        records: dict[str, FileRecord]

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            spans: dict[str, list[tuple[int, int]]] = {}
            for result in future.wait():
                info = result.storage_data
                spans.setdefault(info.relative_path, []).append((info.offset, info.length))
            self.records = {}
            for name, chunks in spans.items():
                stream = streams.get(Path(name).name)
                record = stream.record(Path(self.path) / name) if stream is not None else None
                if record is None or not _aligned(record, chunks) or \
                        record.size != os.path.getsize(Path(self.path) / name):
                    record = digest_ranges(Path(self.path) / name, chunks)
                self.records[name] = record
            return future

    writer = DigestingWriter(path, **kwargs)
    writer.fs = DigestingFileSystem()
    writer.records = {}
    return writer


class _ChunkChecker:
    """Checks stored chunks against the manifest in one thread, in file order, starting
    as soon as a rank knows which chunks it will read: DCP then exchanges the ranks' plans,
    a wait the hashing fills. :meth:`wait` blocks until a chunk's check has passed (or
    raises its error); nothing of a chunk is read into the model before that."""

    def __init__(self, manifest: Manifest, directory: Path, storage_data: Mapping[Any, Any],
                 items: Iterable[Any]) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self.manifest = manifest
        self.directory = directory
        self.storage_data = storage_data
        self._fds: dict[str, int] = {}
        # The checking thread's alone; larger ranges are hashed through a memory map.
        self._scratch = memoryview(bytearray(_MAP_AT_LEAST))
        self._checks: dict[Any, Future[int]] = {}
        order = sorted(items, key=lambda i: (storage_data[i.storage_index].relative_path,
                                             storage_data[i.storage_index].offset))
        pool = ThreadPoolExecutor(1, thread_name_prefix="composer-par-verify")
        for item in order:
            if item.storage_index not in self._checks:
                self._checks[item.storage_index] = pool.submit(self._check, item, True)
        # Queued last and never cancelled: the thread closes its files, then ends by
        # itself, even if the load fails before read_data (another rank's plan, say).
        self._finished = pool.submit(self._close)
        pool.shutdown(wait=False)

    def _check(self, item: Any, in_thread: bool) -> int:
        info = self.storage_data[item.storage_index]
        name = info.relative_path
        try:
            return self._check_chunk(name, info.offset, info.length, item.storage_index.fqn,
                                     in_thread)
        except OSError as exc:
            raise CorruptFileError(f"{self.directory / name}: unreadable: {exc}") from exc

    def _check_chunk(self, name: str, offset: int, length: int, key: str,
                     in_thread: bool) -> int:
        if in_thread:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = open_regular(self.directory / name,
                                                    what="checkpoint file")
            return self.manifest.check_range(name, offset, length, fd, self._scratch, key)
        fd = open_regular(self.directory / name, what="checkpoint file")
        try:
            return self.manifest.check_range(name, offset, length, fd, key=key)
        finally:
            os.close(fd)

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def covers(self, items: Iterable[Any]) -> bool:
        return all(item.storage_index in self._checks for item in items)

    def wait(self, item: Any) -> int:
        """The bytes hashed for ``item`` (0 where an earlier chunk shared its segments)."""
        check = self._checks.get(item.storage_index)
        if check is None:  # not in the plan the checks started from: checked here
            return self._check(item, False)
        return check.result()

    def close(self) -> None:
        """Stop the checks not started yet, and wait for the thread to end."""
        for check in self._checks.values():
            check.cancel()
        self._finished.result()


def verifying_reader(directory: Path, metadata: Any, manifest: Manifest | None, *,
                     collective: bool = False) -> VerifyingReader:
    """A :class:`~composer_par.checkpoint.dcp_reader.VerifyingReader` of ``directory``:
    DCP's reader that checks sizes and digests before the bytes reach the model. Its
    module imports torch's DCP, this one does not: it is imported here, when a load
    needs it."""
    from composer_par.checkpoint.dcp_reader import VerifyingReader

    return VerifyingReader(directory, metadata, manifest, collective=collective)


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Read every byte of every file of a committed checkpoint (a step directory, or a
    root: its latest committed step) against its commit record. Returns the problems,
    each naming the file (empty: verified). CheckpointError when it cannot be verified:
    uncommitted, or committed before digests were recorded."""
    from composer_par.checkpoint import steps
    from composer_par.checkpoint.dcp import read_metadata

    directory = steps.resolve(path)
    manifest = steps.read_manifest(directory)
    if manifest is None:
        raise CheckpointError(f"{directory}: no digests recorded (saved by an older version): "
                              "it cannot be verified")
    try:
        chunks = stored_chunks(read_metadata(directory, manifest))
    except CheckpointError:
        chunks = {}  # the check of .metadata itself reports it
    return manifest.verify_all(chunks)
