"""The DCP storage reader of a committed step that checks what it reads.

:class:`VerifyingReader` is DCP's ``FileSystemReader`` given the step's (already checked)
``.metadata`` and its commit record. This module imports torch's DCP; the rest of
:mod:`composer_par.checkpoint` imports it only when a checkpoint is loaded
(:func:`composer_par.checkpoint.integrity.verifying_reader`), so that importing the
package does not import torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from composer_par.checkpoint import _dist, direct_read
from composer_par.checkpoint.errors import CheckpointError, CorruptFileError
from composer_par.checkpoint.integrity import Manifest, _ChunkChecker
from composer_par.checkpoint.paths import check_regular, contained, open_regular


class VerifyingReader(FileSystemReader):
    """A DCP ``FileSystemReader`` of ``directory`` that takes the (already checked)
    ``metadata``; before it reads anything it checks that every file this rank will read
    has its committed size (with ``collective``, every rank of the default process group
    loads, and the ranks agree on that first), and with a ``manifest`` it checks each
    stored chunk's digest before DCP reads that chunk into the model. The digests are
    checked in a thread (CRC-32 and ``pread`` release the GIL) that starts once this
    rank's plan is made, before DCP exchanges the plans between the ranks, and runs ahead
    of the reading, so it costs little time where a core is free. Errors name the file
    (and the key). ``bytes_verified`` counts the bytes whose digests it checked.

    Each stored chunk is read straight into the tensor that receives it where
    :mod:`~composer_par.checkpoint.direct_read` can (a contiguous part into a contiguous
    CPU tensor of its dtype: the usual case when a job resumes on the layout it saved),
    which halves the bytes copied and holds no second copy of the chunk; DCP's own reading
    does the rest (resharded parts that are not contiguous, dtypes to convert)."""

    def __init__(self, directory: Path, metadata: Any, manifest: Manifest | None, *,
                 collective: bool = False) -> None:
        super().__init__(str(directory))
        self.directory = directory
        self.metadata = metadata
        self.manifest = manifest
        self.collective = collective
        self.bytes_verified = 0
        self.checker: _ChunkChecker | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def prepare_local_plan(self, plan: Any) -> Any:
        plan = super().prepare_local_plan(plan)
        if self.manifest is not None:
            self._start(self.manifest, plan.items)
        return plan

    def _start(self, manifest: Manifest, items: list[Any]) -> _ChunkChecker:
        if self.checker is not None:
            self.checker.close()
        self.checker = _ChunkChecker(manifest, self.directory, self.storage_data, items)
        return self.checker

    def close(self) -> None:
        """Stop the digest checks not started yet and wait for the checking thread to
        end. The loads use the reader as a context manager, which calls it when
        ``dcp.load`` returns or raises (an error on another rank, Ctrl-C), so that no
        thread of the load outlives it."""
        if self.checker is not None:
            self.checker.close()
            self.checker = None

    def __enter__(self) -> VerifyingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                # DCP would hand these bytes to torch.load(weights_only=False): a pickle.
                raise CorruptFileError(
                    f"{self.directory / '.metadata'}: key {item.storage_index.fqn} is stored "
                    "as pickled bytes, which are never read (they could run code); only "
                    "tensors are loaded")
        try:
            return self._read_data(plan, planner)
        finally:
            self.close()

    def _read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        problem: CheckpointError | None = None
        try:
            for name, items in per_file.items():
                self._check_size(name, items)
        except CheckpointError as exc:
            problem = exc
        if self.collective:
            messages = _dist.gather(str(problem) if problem is not None else "")
            failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m]
            if problem is None and failed:
                raise CorruptFileError("; ".join(failed))
        if problem is not None:
            raise problem
        checker = self.checker
        if self.manifest is not None and (checker is None or not checker.covers(plan.items)):
            checker = self._start(self.manifest, plan.items)
        for name, items in per_file.items():
            items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
            self._read_file(plan, planner, name, items, checker)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _check_size(self, name: str, items: list[Any]) -> None:
        path = contained(self.directory, name, what=str(self.directory / ".metadata"))
        if self.manifest is not None:
            self.manifest.check_size(name)
            return
        try:
            size = check_regular(path, what="checkpoint file").st_size
        except FileNotFoundError:
            raise CorruptFileError(f"{path}: missing (.metadata names it)") from None
        end = max(self.storage_data[i.storage_index].offset
                  + self.storage_data[i.storage_index].length for i in items)
        if size < end:
            raise CorruptFileError(f"{path}: truncated: {size} bytes, .metadata places "
                                   f"data up to byte {end}")

    def _read_file(self, plan: Any, planner: Any, name: str, items: list[Any],
                   checker: _ChunkChecker | None) -> None:
        """Read ``items`` of file ``name``, in file order: each straight into the
        tensor that receives it where :mod:`direct_read` can (one copy, no second
        copy of the chunk held), the others by DCP; with digests, each once its
        chunk has been checked."""
        left: list[Any] = []
        layouts: dict[int, Any] = {}
        fd = open_regular(self.directory / name, what="checkpoint file")
        try:
            for item in items:
                if checker is not None:
                    self.bytes_verified += checker.wait(item)
                if self._read_direct(fd, name, item, planner, layouts):
                    continue
                if checker is not None:
                    self._read_by_dcp(plan, planner, name, [item])
                else:
                    left.append(item)
        finally:
            os.close(fd)
        if left:
            self._read_by_dcp(plan, planner, name, left)

    def _read_by_dcp(self, plan: Any, planner: Any, name: str, items: list[Any]) -> None:
        """DCP's own reading of ``items`` (of file ``name``)."""
        try:
            super().read_data(dataclasses.replace(plan, items=items), planner).wait()
        except CheckpointError:
            raise
        except (EOFError, OSError, RuntimeError, ValueError) as exc:
            raise CorruptFileError(f"{self.directory / name}: unreadable: "
                                   f"{type(exc).__name__}: {exc}") from exc

    def _read_direct(self, fd: int, name: str, item: Any, planner: Any,
                     layouts: dict[int, Any]) -> bool:
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        if info.offset not in layouts:
            layouts[info.offset] = direct_read.stored_tensor(fd, info.offset, info.length)
        stored = layouts[info.offset]
        if stored is None:
            return False
        target = planner.resolve_tensor(item).detach()
        try:
            if not direct_read.read_into(fd, stored, item.storage_offsets, item.lengths,
                                         target):
                return False
        except (EOFError, OSError) as exc:
            raise CorruptFileError(f"{self.directory / name}: unreadable: "
                                   f"{type(exc).__name__}: {exc}") from exc
        planner.commit_tensor(item, target)
        return True
