"""Loading weights into an already sharded, materialized model: from safetensors (a file,
a directory or an index json) or from the model part of a DCP checkpoint.

Both go through DCP's planner, so every layout reshards, and both are strict by default:
model keys the source lacks and source keys the model lacks are an error naming them and
the source (DCP alone would skip the latter silently). Float dtypes convert on load (a
bf16 file into an fp32 model and back); other dtype or shape differences are errors.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.blocks import clean_name
from composer_par.checkpoint import _dist
from composer_par.checkpoint.adapter import Identity, StateDictAdapter
from composer_par.checkpoint.errors import dcp_errors
from composer_par.checkpoint.matching import Match, Spec, match
from composer_par.checkpoint.safetensors_io import dtype_name
from composer_par.checkpoint.sources import WeightsSource
from composer_par.checkpoint.strided import for_dcp
from composer_par.logging import get_logger
from composer_par.ties import tied_names

if TYPE_CHECKING:
    import torch.nn as nn

log = get_logger(__name__)


@attrs.frozen
class LoadReport:
    """What a weights load did."""

    source: str
    loaded: tuple[str, ...]
    missing: tuple[str, ...]  # left as initialized (only with strict=False)
    unexpected: tuple[str, ...]  # in the source, not in the model (only with strict=False)
    converted: tuple[tuple[str, str, str], ...]  # (name, model dtype, file dtype), lossy
    bytes_read: int
    seconds: float


def _own_tensors(model: nn.Module) -> dict[str, Any]:
    """The model's parameters and buffers by the names its state dict gives them."""
    return {clean_name(n): t for n, t in [*model.named_parameters(remove_duplicate=False),
                                          *model.named_buffers(remove_duplicate=False)]}


def _same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are views of the same elements (a DTensor: of its local
    tensor), so copying one onto the other changes nothing."""
    import torch
    from torch.distributed.tensor import DTensor

    if b is None or isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if isinstance(a, DTensor):
        from composer_par.plugin import torch_private

        a, b = torch_private.local_tensor(a), torch_private.local_tensor(b)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (a.data_ptr() == b.data_ptr() and a.device == b.device and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def _storage(tensor: Any) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.data_ptr(), local.numel()


def _fill_aliases(state_dict: dict[str, Any], tied: dict[str, list[str]],
                  loaded: set[str]) -> list[str]:
    """Copy each loaded tensor into its aliases that are no longer the same tensor (tied
    weights that could not be re-tied). Returns the alias names filled or shared."""
    import torch

    filled = []
    for first, names in tied.items():
        if first not in loaded or first not in state_dict:
            continue
        for name in names:
            if name not in state_dict:
                continue
            if _storage(state_dict[name]) != _storage(state_dict[first]):
                with torch.no_grad():
                    state_dict[name].copy_(state_dict[first])
            filled.append(name)
    return filled


def expected_specs(state_dict: dict[str, Any], tied: dict[str, list[str]]) -> dict[str, Spec]:
    """One spec per tensor (aliases dropped), shapes global (a DTensor's full shape)."""
    others = {n for names in tied.values() for n in names}
    return {k: Spec(tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in state_dict.items() if k not in others and hasattr(v, "shape")}


def source_specs(source: WeightsSource) -> dict[str, Spec]:
    return {k: Spec(e.shape, dtype_name(e.dtype)) for k, e in source.entries.items()}


def _finish(model: nn.Module, state_dict: dict[str, Any], m: Match, *, strict: bool,
            started: float, bytes_read: int, tied: dict[str, list[str]]) -> LoadReport:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    names = [*m.keys, *_fill_aliases(state_dict, tied, set(m.keys))]
    # DCP read into the tensors get_model_state_dict returned, which for FSDP2 and TP are
    # the model's own (local) memory: setting those again would copy each onto itself,
    # a second pass over every byte loaded. Only what is not the model's memory is set
    # (a state dict torch had to build anew).
    own = _own_tensors(model)
    loaded = {name: state_dict[name] for name in names
              if not _same_memory(state_dict[name], own.get(name))}
    if loaded:
        with dcp_errors(f"setting the weights loaded from {m.source}"):
            set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    if not strict and (m.missing or m.unexpected):
        log.warning("weights loaded non-strictly", source=m.source, missing=list(m.missing[:5]),
                    unexpected=list(m.unexpected[:5]))
    return LoadReport(m.source, tuple(m.keys), m.missing, m.unexpected, m.lossy, bytes_read,
                      time.perf_counter() - started)


def load_safetensors(
    model: nn.Module,
    path: str | os.PathLike[str] | WeightsSource,
    *,
    adapter: StateDictAdapter | None = None,
    strict: bool = True,
    tied: dict[str, list[str]] | None = None,
) -> LoadReport:
    """Load safetensors weights into ``model`` (sharded or not, already materialized);
    every rank calls it and reads only the bytes of its own shards. ``tied`` gives the
    tied-weight groups (first name -> other names) when ``to_empty`` untied them (see
    :func:`~composer_par.ties.tied_names`, taken before materializing); default: the
    model's current ties."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from composer_par.checkpoint.hf_reader import SafetensorsReader

    started = time.perf_counter()
    source = path if isinstance(path, WeightsSource) else WeightsSource.open(path)
    state_dict = get_model_state_dict(model)
    tied = tied_names(model) if tied is None else tied
    m = match(source.path, expected_specs(state_dict, tied), source_specs(source),
              adapter or Identity(), tied)
    error = m.error(strict=strict)
    if error is not None:
        raise error
    to_load = {m.keys[name]: state_dict[name] for name in m.keys}
    reader = SafetensorsReader(source, keys=to_load)
    with dcp_errors(f"loading {source.path}"):
        dcp.load(for_dcp(to_load), storage_reader=reader, no_dist=not _dist.active())
    return _finish(model, state_dict, m, strict=strict, started=started,
                   bytes_read=reader.bytes_read, tied=tied)


def checkpoint_model_specs(directory: str | os.PathLike[str], metadata: Any = None
                           ) -> tuple[dict[str, Spec], str]:
    """The model tensors of a DCP checkpoint by model name, and the key prefix they have
    in it (``"model."`` for composer_par checkpoints, ``""`` for a bare model state dict).
    Reads DCP's pickled metadata (checked against the commit record's digest, unpickled
    finding only the classes DCP metadata holds) unless given."""
    from pathlib import Path

    from composer_par.checkpoint.dcp import MODEL, read_metadata, stored_specs

    found = stored_specs(read_metadata(Path(directory)) if metadata is None else metadata)
    prefix = f"{MODEL}."
    if any(k.startswith(prefix) for k in found):
        return {k[len(prefix):]: v for k, v in found.items() if k.startswith(prefix)}, prefix
    return found, ""


def load_checkpoint_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    adapter: StateDictAdapter | None = None,
    strict: bool = True,
    tied: dict[str, list[str]] | None = None,
) -> LoadReport:
    """Load the model part of a committed DCP checkpoint (a step directory or a root: its
    latest) into ``model``, resharding to its layout. Optimizer state is not touched (use
    :func:`composer_par.checkpoint.load` to resume training). Every stored chunk read is
    checked against the commit record's digest first; an error names the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from composer_par.checkpoint import steps
    from composer_par.checkpoint.dcp import read_metadata, resolve_for_all
    from composer_par.checkpoint.integrity import verifying_reader

    started = time.perf_counter()
    directory = resolve_for_all(path)
    manifest = steps.read_manifest(directory)
    metadata = read_metadata(directory, manifest)
    specs, prefix = checkpoint_model_specs(directory, metadata)
    state_dict = get_model_state_dict(model)
    tied = tied_names(model) if tied is None else tied
    m = match(str(directory), expected_specs(state_dict, tied), specs, adapter or Identity(),
              tied)
    error = m.error(strict=strict)
    if error is not None:
        raise error
    to_load = {prefix + m.keys[name]: state_dict[name] for name in m.keys}
    with verifying_reader(directory, metadata, manifest, collective=_dist.active()) as reader, \
            dcp_errors(f"loading {directory}"):
        dcp.load(for_dcp(to_load), storage_reader=reader, no_dist=not _dist.active())
    return _finish(model, state_dict, m, strict=strict, started=started,
                   bytes_read=reader.bytes_verified, tied=tied)
