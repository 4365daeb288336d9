"""Export a sharded model to consolidated safetensors without gathering it anywhere.

Every header is computed from global shapes and dtypes alone, so rank 0 can create each
output file at its final size before any data exists. Then each rank writes the bytes of
the shards it holds at their offsets (``pwrite``); a shard replicated on several ranks is
written by the lowest of them. No rank holds more than its own shards (plus one shard
converted, when a dtype is asked for), no tensor crosses the network, and the ranks write
in parallel. The files are written into a temporary directory that is renamed into place
once every rank succeeded, so a failed export leaves nothing at the destination.

The output is what ``save_pretrained`` writes: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` when split,
with ``{"format": "pt"}`` metadata. It loads with ``safetensors.torch.load_file``, with
:class:`~composer_par.LoadSafetensors`, and (with the model's config.json alongside)
with Hugging Face ``from_pretrained``.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.checkpoint import _dist
from composer_par.checkpoint.adapter import Identity, StateDictAdapter, file_names
from composer_par.checkpoint.errors import CheckpointError, describe_failure
from composer_par.checkpoint.safetensors_io import (
    FileLayout,
    PlannedTensor,
    TensorEntry,
    dtype_code,
    write_region,
)
from composer_par.checkpoint.steps import fsync_dir
from composer_par.logging import get_logger

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

log = get_logger(__name__)

#: Hugging Face's default ``max_shard_size`` for ``save_pretrained``.
DEFAULT_MAX_FILE_BYTES = 5 * 10**9


def local_chunk(tensor: Any) -> tuple[Any, tuple[int, ...]] | None:
    """``(local tensor, global offset)`` of this rank's part of ``tensor``, or None when the
    rank holds none of it (not in the DTensor's mesh)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return _plain(tensor), (0,) * tensor.dim()
    from composer_par.plugin import torch_private

    if tensor.device_mesh.get_coordinate() is None:
        return None
    if any(p.is_partial() for p in tensor.placements):
        raise CheckpointError("a tensor with Partial placement (pending reduction) cannot be "
                              "exported; export after the optimizer step")
    local = tensor.to_local()
    shape, offset = torch_private.local_shape_and_offset(
        tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(f"local shard {list(local.shape)} is not the {list(shape)} "
                              "its placements give; cannot place it in the file")
    return _plain(local), offset


def _plain(tensor: Any) -> Any:
    """A plain tensor of ``tensor``'s values: a wrapper subclass (torchao's float8
    all-gather weight, which wraps the high-precision master weight) owns no storage of
    its own to write from; its values are copied out through its own dispatch."""
    import torch

    if type(tensor) is torch.Tensor:
        return tensor
    plain = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    plain.copy_(tensor)
    return plain


def _whole_if_strided(tensor: Any) -> Any:
    """A tensor split by a strided placement (TP's packed projections) is several boxes on
    each rank, which :func:`local_chunk` cannot place: every rank takes it whole (a
    collective, in the same order on every rank) and one of them writes it."""
    from torch.distributed.tensor import DTensor

    from composer_par.checkpoint.strided import strided_alone

    if isinstance(tensor, DTensor) and strided_alone(tensor.placements):
        return tensor.full_tensor()
    return tensor


def export_safetensors(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    adapter: StateDictAdapter | None = None,
    dtype: torch.dtype | str | None = None,
    max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES,
    plan: Any = None,
) -> Path:
    """Write ``model``'s weights (every rank calls this) as consolidated safetensors in
    ``directory``, which must not exist. ``adapter`` names the keys (e.g. Hugging Face
    names), ``dtype`` converts (e.g. ``"bfloat16"``), ``max_file_bytes`` splits into
    several files with an index json. With ``plan`` and no ``adapter``, the names are the
    ones the plan's plugins map to (``composer_par_state_dict_adapter``: e.g. a loader's
    ``rename``), so an export reloads with the same plan. Tied weights are written once,
    under their first name. Returns the directory."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from composer_par.ties import tied_names

    started = time.perf_counter()
    target = Path(directory)
    state_dict = get_model_state_dict(model)
    tied = {n for names in tied_names(model).values() for n in names}
    tensors: dict[str, Any] = {k: v for k, v in state_dict.items()
                               if k not in tied and hasattr(v, "shape")}
    tensors = {k: _whole_if_strided(v) for k, v in tensors.items()}
    if adapter is None and plan is not None:
        from composer_par.checkpoint.adapter import adapter_for

        adapter = adapter_for(plan, model)
    names = file_names(list(tensors), adapter or Identity())
    code = dtype_code(dtype) if dtype is not None else None
    planned = [PlannedTensor(names[k], code or dtype_code(v.dtype), tuple(v.shape))
               for k, v in tensors.items()]
    layout = FileLayout.plan(_every_ranks(planned, _model_order(plan, adapter or Identity())),
                             max_file_bytes)

    problem, staging = "", ""
    if _dist.rank() == 0:
        problem, staging = _create(target, layout)
    problem, staging = _dist.broadcast((problem, staging))
    if problem:
        raise CheckpointError(problem)
    failure = ""
    written = 0
    try:
        written = _write_owned(tensors, names, layout.entries(staging))
    except Exception as exc:  # every rank must still reach the gather
        failure = describe_failure(exc, _dist.rank(), target, "writing its shards")
    # Every rank learns every failing rank's error, not only that one failed somewhere.
    failures = [f for f in _dist.gather(failure) if f]
    if not failures and _dist.rank() == 0:
        try:
            os.replace(staging, target)
            fsync_dir(target.parent)
        except OSError as exc:
            failure = f"cannot move the export into place at {target}: {exc}"
    if not failures:
        failures = [f for f in [_dist.broadcast(failure)] if f]
    if failures:
        if _dist.rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"exporting to {target} failed, nothing written: "
                              + "; ".join(dict.fromkeys(failures)))
    log.info("exported safetensors", path=str(target), files=len(layout.files),
             bytes=layout.total_bytes, written_here=written,
             seconds=round(time.perf_counter() - started, 3))
    return target


def _model_order(plan: Any, adapter: StateDictAdapter) -> dict[str, int]:
    """File name -> position of its tensor in the whole model, where the plan's pipeline
    says the whole model's keys (a rank holds only its stages' tensors)."""
    pipeline = getattr(plan, "pipeline", None)
    keys = getattr(pipeline, "model_keys", ()) or ()
    order: dict[str, int] = {}
    for key in keys:
        order.setdefault(adapter.to_file(key), len(order))
    return order


def _every_ranks(planned: list[PlannedTensor], order: dict[str, int]) -> list[PlannedTensor]:
    """The tensors of every rank, once each, the same list on every rank: ranks that hold
    different parts of the model (pipeline stages) each plan only their own. In the
    whole model's order where known, else in rank order. A name two ranks describe
    differently is an error, raised on every rank alike."""
    import hashlib

    mine = tuple((t.name, t.dtype, t.shape) for t in planned)
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests = _dist.gather(digest)
    # Ranks with the same tensors (data-parallel peers) send them once.
    everyone = _dist.gather(mine if digests.index(digest) == _dist.rank() else None)
    merged: dict[str, PlannedTensor] = {}
    for listed in everyone:
        for name, code, shape in listed or ():
            known = merged.setdefault(name, PlannedTensor(name, code, shape))
            if (known.dtype, known.shape) != (code, shape):
                raise CheckpointError(
                    f"{name}: ranks hold it as {known.dtype} {list(known.shape)} and as "
                    f"{code} {list(shape)}; cannot export one tensor of two shapes")
    ranked = list(merged.values())
    last = len(order)
    return sorted(ranked, key=lambda t: order.get(t.name, last))


def _create(target: Path, layout: FileLayout) -> tuple[str, str]:
    """Rank 0: the staging directory with every file created; or an error message."""
    if target.exists():
        return f"{target} already exists; export writes a new directory", ""
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
        layout.create_files(staging)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return f"cannot create {staging}: {exc}", ""
    return "", str(staging)


def _write_owned(tensors: dict[str, Any], names: dict[str, str],
                 entries: dict[str, TensorEntry]) -> int:
    """Write the shards this rank owns; check together that every element is written
    exactly once. Returns the bytes this rank wrote."""
    chunks: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for key, tensor in tensors.items():
        found = local_chunk(tensor)
        if found is not None and found[0].numel() > 0:
            chunks[key] = found
    mine = [(key, offset, int(local.numel())) for key, (local, offset) in chunks.items()]
    everyone = _dist.gather(mine)
    owner: dict[tuple[str, tuple[int, ...]], int] = {}
    covered: dict[str, int] = {}
    for rank, listed in enumerate(everyone):
        for key, offset, numel in listed:
            if (key, offset) not in owner:
                owner[(key, offset)] = rank
                covered[key] = covered.get(key, 0) + numel
    for key, tensor in tensors.items():
        if covered.get(key, 0) != math.prod(tensor.shape):
            raise CheckpointError(
                f"{key}: the ranks' shards cover {covered.get(key, 0)} of "
                f"{math.prod(tensor.shape)} elements; this layout cannot be exported")
    me = _dist.rank()
    written = 0
    fds: dict[str, int] = {}
    try:
        for key, (local, offset) in chunks.items():
            if owner[(key, offset)] != me:
                continue
            entry = entries[names[key]]
            if entry.path not in fds:
                fds[entry.path] = os.open(entry.path, os.O_WRONLY)
            written += write_region(fds[entry.path], entry, offset, local)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written
