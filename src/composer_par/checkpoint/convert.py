"""Offline conversion DCP <-> safetensors, one tensor at a time, in one process.

* DCP -> safetensors: the output files are laid out from DCP's metadata, then DCP reads
  each stored chunk (a rank's shard) and a planner writes it straight to its place in the
  output file and drops it. Memory: about two stored chunks.
* safetensors -> DCP: DCP plans the save from shapes and dtypes alone (meta tensors), and
  a planner reads each tensor from the safetensors file only when DCP writes it. Memory:
  about one tensor. The result is a committed checkpoint directory that ``load`` and
  ``LoadCheckpoint`` accept.

Both write into a hidden staging directory beside the destination (in its parent, so the
final rename stays on one file system), renamed into place at the end, so a failure
leaves nothing at the destination. Until then the staging directory is not a checkpoint
anyone could mistake for one: safetensors files keep a zero header (readers refuse them)
until every tensor is written, and a DCP staging directory holds its info file but no
commit marker (``load`` and ``inspect`` call it uncommitted). A failed convert removes its
staging directory; one killed outright leaves it, with a claim naming its process, and
the next convert into the same parent removes every staging directory whose process is
gone. Reading a DCP checkpoint checks every stored chunk read (and
``.metadata``) against the commit record's digests; writing one records them. ``dtype``
converts floating-point tensors to one of :data:`FLOAT_DTYPES`; other tensors keep their
dtype. ``progress(done_bytes, total_bytes)`` is called as they go.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint import claims, steps
from composer_par.checkpoint.adapter import Identity, StateDictAdapter, file_names
from composer_par.checkpoint.dcp import FORMAT, MODEL
from composer_par.checkpoint.errors import CheckpointError, dcp_errors
from composer_par.checkpoint.safetensors_io import (
    INDEX_NAME,
    FileLayout,
    PlannedTensor,
    TensorEntry,
    dtype_code,
    dtype_name,
    read_tensor,
    torch_dtype,
    write_region,
)
from composer_par.checkpoint.sources import WeightsSource
from composer_par.logging import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

Progress = Callable[[int, int], None]

_STAGING = ".convert-"
# A staging directory without a readable claim (killed between creating it and writing
# the claim) is removed once it has been left this long.
_UNCLAIMED_AGE_S = 600.0


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


#: The dtypes ``convert --dtype`` may give floating-point weights. Integer and bool
#: tensors (step counters, masks, quantized weights) keep their own: a cast would
#: truncate them.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2")


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "fp64": "float64", "double": "float64"}
_INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def refusal(name: str) -> str:
    """Why weights do not convert to the dtype ``name`` (not one of FLOAT_DTYPES)."""
    choices = ", ".join(FLOAT_DTYPES)
    if name in _ALIASES:
        why = f"write {_ALIASES[name]} for {name}"
    elif name in _INTEGERS:
        why = "a cast to an integer dtype truncates"
    elif name == "bool":
        why = "a cast to bool keeps only whether each value is zero"
    elif name.startswith("float8"):
        why = "float8 weights need scales that a cast does not compute"
    else:
        why = "weights convert only between these floating-point dtypes"
    return (f"cannot convert weights to {name}: the target dtype must be one of {choices} "
            f"({why})")


def float_dtype(dtype: torch.dtype | str) -> str:
    """The name of ``dtype`` if it is one of :data:`FLOAT_DTYPES`, else ValueError."""
    name = str(dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise ValueError(refusal(name))
    return name


def _target(code: str | None, stored: str) -> str:
    """The safetensors code a tensor stored as ``stored`` is written in: ``code`` for
    floating point, its own for integers and bools."""
    if code is None or dtype_name(stored) not in (*FLOAT_DTYPES, *_FLOAT8):
        return stored
    return code


def _staging(target: Path) -> Path:
    """A fresh staging directory for ``target``, claimed by this process, after removing
    the ones earlier converts into the same parent left when they were killed."""
    if target.exists():
        raise CheckpointError(f"{target} already exists; convert writes a new directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target.parent)
    staging = target.parent / (f".{target.name}{_STAGING}{claims.job_id()}-"
                               f"{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        claims.claim_directory(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def remove_leftovers(parent: Path) -> list[Path]:
    """Remove the staging directories of converts into ``parent`` whose process is gone
    (their claim says so, or they have no claim and are old). Returns them."""
    removed = claims.remove_dead_directories(
        parent, lambda name: name.startswith(".") and _STAGING in name,
        unclaimed_age=_UNCLAIMED_AGE_S)
    if removed:
        log.info("removed the staging directories of interrupted converts",
                 removed=[str(p) for p in removed])
    return removed


def _publish(staging: Path, target: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (staging / claims.CLAIM).unlink()
    os.replace(staging, target)
    steps.fsync_dir(target.parent)


def _create_blank(layout: FileLayout, directory: Path) -> None:
    """Every output file at its final size, its header zeroed: until
    :func:`_write_headers`, a reader refuses the file instead of reading holes."""
    for file_name, tensors in layout.files:
        header = layout.header_bytes(tensors)
        with open(directory / file_name, "wb") as f:
            f.truncate(len(header) + sum(t.nbytes for t in tensors))


def _write_headers(layout: FileLayout, directory: Path) -> None:
    """The headers (and the index json, for several files), once every tensor is written."""
    for file_name, tensors in layout.files:
        with open(directory / file_name, "r+b") as f:
            f.write(layout.header_bytes(tensors))
            f.flush()
            os.fsync(f.fileno())
    if len(layout.files) > 1:
        steps.write_json_atomic(directory / INDEX_NAME, layout.index())


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
    latest) as consolidated safetensors in ``destination``. DCP's pickled metadata is read
    by an unpickler that finds only the classes DCP metadata holds."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from composer_par.checkpoint.dcp import read_metadata
    from composer_par.checkpoint.integrity import verifying_reader
    from composer_par.checkpoint.weights import checkpoint_model_specs

    started = time.perf_counter()
    code = dtype_code(float_dtype(dtype)) if dtype is not None else None
    directory = steps.resolve(source)
    manifest = steps.read_manifest(directory)
    steps.read_info(directory, manifest)
    metadata = read_metadata(directory, manifest)
    specs, prefix = checkpoint_model_specs(directory, metadata)
    if not specs:
        raise CheckpointError(f"{directory}: no model tensors to convert")
    names = file_names(list(specs), adapter or Identity())
    planned = [PlannedTensor(names[k], _target(code, dtype_code(s.dtype)), s.shape)
               for k, s in specs.items()]
    layout = FileLayout.plan(planned, max_file_bytes)
    target = Path(destination)
    staging = _staging(target)
    total = layout.total_bytes
    try:
        _create_blank(layout, staging)
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
            with verifying_reader(directory, metadata, manifest) as reader, \
                    dcp_errors(f"reading {directory}"):
                dcp.load(state, storage_reader=reader,
                         planner=Planner(flatten_state_dict=False), no_dist=True)
        finally:
            writer.close()
        writer.check(specs, prefix)
        _write_headers(layout, staging)
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
    weights = WeightsSource.open(source)
    if not weights.entries:
        raise CheckpointError(f"{source}: no tensors to convert")
    specs = {k: TensorSpec(e.shape, dtype_name(e.dtype)) for k, e in weights.entries.items()}
    return tensors_to_dcp(str(source), specs, lambda key, to: read_tensor(
        weights.entries[key], to), destination, dtype=dtype, progress=progress)


@attrs.frozen
class TensorSpec:
    """A tensor to convert, before it is read: its shape and torch dtype name."""

    shape: tuple[int, ...]
    dtype: str


#: ``read(key, dtype)``: the tensor ``key`` of a source, in ``dtype``.
ReadTensor = Callable[[str, "torch.dtype"], "torch.Tensor"]


@attrs.frozen
class OptimizerTensors:
    """An optimizer's state to convert: ``specs[fqn][key]`` for each tensor,
    ``read(fqn, key)`` to read one (in its own dtype), and the parameter groups (their
    hyperparameters, and the parameters by name under ``params``)."""

    specs: dict[str, dict[str, TensorSpec]]
    read: Callable[[str, str], torch.Tensor]
    param_groups: list[dict[str, Any]]
    class_name: str  # what inspect shows as the optimizer's class


def tensors_to_dcp(
    source: str,
    specs: dict[str, TensorSpec],
    read: ReadTensor,
    destination: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    progress: Progress | None = None,
    step: int = 0,
    optimizer: OptimizerTensors | None = None,
) -> ConvertResult:
    """The tensors ``specs`` names, each read by ``read`` only when DCP writes it, as a
    committed DCP checkpoint directory ``destination`` under the ``model.`` prefix as
    ``save`` writes them (``source`` is what its info file says it was converted from);
    with ``optimizer``, its state and parameter groups as ``save`` writes an optimizer's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from composer_par.checkpoint.dcp import OPTIM, _to_json
    from composer_par.checkpoint.integrity import Manifest, digest_file, digesting_writer

    started = time.perf_counter()
    code = dtype_code(float_dtype(dtype)) if dtype is not None else None
    targets = {k: torch_dtype(_target(code, dtype_code(s.dtype))) for k, s in specs.items()}
    state: dict[str, Any] = {MODEL: {k: torch.empty(s.shape, device="meta", dtype=targets[k])
                                     for k, s in specs.items()}}
    # Every tensor DCP will write, by its flattened name: how to read it.
    reads: dict[str, Callable[[], torch.Tensor]] = {
        f"{MODEL}.{k}": functools.partial(read, k, targets[k]) for k in specs}
    info_optimizer = None
    if optimizer is not None:
        state[OPTIM] = {"state": {
            fqn: {key: torch.empty(s.shape, device="meta", dtype=getattr(torch, s.dtype))
                  for key, s in entry.items()} for fqn, entry in optimizer.specs.items()}}
        for fqn, entry in optimizer.specs.items():
            for key in entry:
                reads[f"{OPTIM}.state.{fqn}.{key}"] = functools.partial(optimizer.read,
                                                                         fqn, key)
        info_optimizer = {"param_groups": _to_json(optimizer.param_groups,
                                                   "optimizer param_groups"),
                          "scalars": {}, "class": optimizer.class_name}
    total = sum(math.prod(t.shape) * t.element_size() for part in state.values()
                for t in _leaves(part))
    done = 0

    class Planner(DefaultSavePlanner):
        """Reads each tensor from the source only when DCP writes it."""

        def resolve_data(self, write_item: Any) -> Any:
            nonlocal done
            tensor = reads[write_item.index.fqn]()
            done += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress(done, total)
            return tensor

    target = Path(destination)
    staging = _staging(target)
    try:
        # The info file first: until the commit, the staging directory is an uncommitted
        # checkpoint of ours, which load and inspect refuse.
        info: dict[str, Any] = {
            "format": FORMAT, "step": step, "world_size": 1, "plan": None, "extra": None,
            "converted_from": source, "saved_at": time.time(), "torch": torch.__version__}
        if info_optimizer is not None:
            info["optimizer"] = info_optimizer
        steps.write_json_atomic(staging / steps.INFO, info)
        writer = digesting_writer(staging, sync_files=True)
        with dcp_errors(f"writing {staging}", staging):
            dcp.save(state, storage_writer=writer, planner=Planner(), no_dist=True)
        records = dict(writer.records)
        for name in (steps.INFO, steps.DCP_METADATA):
            records[name] = digest_file(staging / name)
        steps.commit(staging, step, Manifest(staging, records))
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = tuple(str(p) for p in sorted(target.iterdir()))
    return ConvertResult(source, str(target), len(reads), total, files,
                         time.perf_counter() - started)


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    return [tree]


def tensors_to_safetensors(
    source: str,
    specs: dict[str, TensorSpec],
    read: ReadTensor,
    destination: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    max_file_bytes: int | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """The tensors ``specs`` names as consolidated safetensors in ``destination``, each
    read by ``read``, written into its place and dropped before the next."""
    started = time.perf_counter()
    code = dtype_code(float_dtype(dtype)) if dtype is not None else None
    planned = [PlannedTensor(k, _target(code, dtype_code(s.dtype)), s.shape)
               for k, s in specs.items()]
    layout = FileLayout.plan(planned, max_file_bytes)
    target = Path(destination)
    staging = _staging(target)
    total = layout.total_bytes
    try:
        _create_blank(layout, staging)
        writer = _ChunkWriter(layout.entries(staging), total, progress)
        try:
            for key, spec in specs.items():
                entry = writer.entries[key]
                writer.write(key, [0] * len(spec.shape), read(key, torch_dtype(entry.dtype)))
        finally:
            writer.close()
        writer.check(specs, "")
        _write_headers(layout, staging)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = tuple(str(target / name) for name, _ in layout.files)
    return ConvertResult(source, str(target), len(specs), total, files,
                         time.perf_counter() - started)
