"""Offline conversion DCP <-> safetensors, one tensor at a time, in one process.

* DCP -> safetensors: the output files are laid out from DCP's metadata, then DCP reads
  each stored chunk (a rank's shard) and a planner writes it straight to its place in the
  output file and drops it. Memory: about two stored chunks.
* safetensors -> DCP: DCP plans the save from shapes and dtypes alone (meta tensors), and
  a planner reads each tensor from the safetensors file only when DCP writes it. Memory:
  about one tensor. The result is a committed checkpoint directory that ``load`` and
  ``LoadCheckpoint`` accept.

Both write into a temporary directory renamed into place at the end, so a failure leaves
nothing at the destination. ``progress(done_bytes, total_bytes)`` is called as they go.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint import steps
from composer_par.checkpoint.adapter import Identity, StateDictAdapter, file_names
from composer_par.checkpoint.dcp import FORMAT, MODEL
from composer_par.checkpoint.errors import CheckpointError, dcp_errors
from composer_par.checkpoint.safetensors_io import (
    FileLayout,
    PlannedTensor,
    TensorEntry,
    dtype_code,
    read_tensor,
    torch_dtype,
    write_region,
)
from composer_par.checkpoint.sources import WeightsSource

if TYPE_CHECKING:
    import torch

Progress = Callable[[int, int], None]


@attrs.frozen
class ConvertResult:
    source: str
    destination: str
    tensors: int
    bytes: int
    files: tuple[str, ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _staging(target: Path) -> Path:
    if target.exists():
        raise CheckpointError(f"{target} already exists; convert writes a new directory")
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, target: Path) -> None:
    os.replace(staging, target)
    steps.fsync_dir(target.parent)


def dcp_to_safetensors(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    adapter: StateDictAdapter | None = None,
    dtype: torch.dtype | str | None = None,
    max_file_bytes: int | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """The model weights of a committed DCP checkpoint (a step directory, or a root: its
    latest) as consolidated safetensors in ``destination``. Reads DCP's pickled metadata:
    trusted sources only."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from composer_par.checkpoint.weights import checkpoint_model_specs

    started = time.perf_counter()
    directory = steps.resolve(source)
    specs, prefix = checkpoint_model_specs(directory)
    if not specs:
        raise CheckpointError(f"{directory}: no model tensors to convert")
    names = file_names(list(specs), adapter or Identity())
    code = dtype_code(dtype) if dtype is not None else None
    planned = [PlannedTensor(names[k], code or dtype_code(s.dtype), s.shape)
               for k, s in specs.items()]
    layout = FileLayout.plan(planned, max_file_bytes)
    target = Path(destination)
    staging = _staging(target)
    total = layout.total_bytes
    try:
        layout.create_files(staging)
        entries = layout.entries(staging)
        by_key = {prefix + k: entries[names[k]] for k in specs}
        writer = _ChunkWriter(by_key, total, progress)

        class Planner(DefaultLoadPlanner):
            """Each chunk DCP reads lands in a fresh tensor that is written and dropped.

            The state dict holds meta tensors (shapes only); DCP's default set-up would
            allocate every one of them on the process group's device, the whole model.
            """

            def set_up_planner(self, state_dict: Any, metadata: Any = None,
                               is_coordinator: bool = False) -> None:
                self.original_state_dict = self.state_dict = state_dict
                self.mappings = {}
                self.metadata = metadata
                self.is_coordinator = is_coordinator

            def resolve_tensor(self, read_item: Any) -> torch.Tensor:
                stored = specs[read_item.dest_index.fqn[len(prefix):]]
                return torch.empty(tuple(read_item.lengths), dtype=getattr(torch, stored.dtype))

            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                writer.write(read_item.dest_index.fqn, read_item.dest_offsets, tensor)

        state = {prefix + k: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta")
                 for k, s in specs.items()}
        try:
            with dcp_errors(f"reading {directory}"):
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)),
                         planner=Planner(flatten_state_dict=False), no_dist=True)
        finally:
            writer.close()
        writer.check(specs, prefix)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = tuple(str(target / name) for name, _ in layout.files)
    return ConvertResult(str(directory), str(target), len(specs), total, files,
                         time.perf_counter() - started)


class _ChunkWriter:
    def __init__(self, entries: dict[str, TensorEntry], total: int,
                 progress: Progress | None) -> None:
        self.entries = entries
        self.total = total
        self.progress = progress
        self.done = 0
        self.elements: dict[str, int] = {}
        self.fds: dict[str, int] = {}

    def write(self, key: str, offsets: Any, tensor: torch.Tensor) -> None:
        entry = self.entries[key]
        if entry.path not in self.fds:
            self.fds[entry.path] = os.open(entry.path, os.O_WRONLY)
        self.done += write_region(self.fds[entry.path], entry, list(offsets), tensor)
        self.elements[key] = self.elements.get(key, 0) + tensor.numel()
        if self.progress is not None:
            self.progress(self.done, self.total)

    def close(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        self.fds.clear()

    def check(self, specs: dict[str, Any], prefix: str) -> None:
        import math

        for key, spec in specs.items():
            got = self.elements.get(prefix + key, 0)
            if got != math.prod(spec.shape):
                raise CheckpointError(f"{key}: the checkpoint's chunks hold {got} of "
                                      f"{math.prod(spec.shape)} elements")


def safetensors_to_dcp(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Safetensors weights (a file, a directory or an index json) as a committed DCP
    checkpoint directory ``destination``, keys unchanged, under the ``model.`` prefix as
    ``save`` writes them (load it with an adapter if the names are not the model's)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    started = time.perf_counter()
    weights = WeightsSource.open(source)
    if not weights.entries:
        raise CheckpointError(f"{source}: no tensors to convert")
    target_dtype = torch_dtype(dtype_code(dtype)) if dtype is not None else None
    total = sum((e.numel * (target_dtype.itemsize if target_dtype else e.itemsize))
                for e in weights.entries.values())
    done = 0

    class Planner(DefaultSavePlanner):
        """Reads each tensor from the safetensors file only when DCP writes it."""

        def resolve_data(self, write_item: Any) -> Any:
            nonlocal done
            key = write_item.index.fqn[len(MODEL) + 1:]
            tensor = read_tensor(weights.entries[key], target_dtype)
            done += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress(done, total)
            return tensor

    state = {MODEL: {k: torch.empty(e.shape, device="meta",
                                    dtype=target_dtype or torch_dtype(e.dtype))
                     for k, e in weights.entries.items()}}
    target = Path(destination)
    staging = _staging(target)
    try:
        with dcp_errors(f"writing {staging}"):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging), sync_files=True),
                     planner=Planner(), no_dist=True)
        steps.write_json_atomic(staging / steps.INFO, {
            "format": FORMAT, "step": 0, "world_size": 1, "plan": None, "extra": None,
            "converted_from": str(source), "saved_at": time.time(),
            "torch": torch.__version__})
        steps.commit(staging, 0)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = tuple(str(p) for p in sorted(target.iterdir()))
    return ConvertResult(str(source), str(target), len(weights.entries), total, files,
                         time.perf_counter() - started)
