"""Checkpoints written by FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``)
loaded into a model a plan applied, with the optimizer state, to resume training.

    plan.apply(model); optimizer = torch.optim.AdamW(model.parameters(), ...)
    load_fsdp1("ckpt/model", model, optimizer, optimizer_path="ckpt/optim")

FSDP1 writes two kinds, both read here:

* ``FULL_STATE_DICT``: rank 0 ``torch.save``s ``model.state_dict()`` and
  ``FSDP.optim_state_dict(model, optimizer)`` (accelerate: ``pytorch_model_fsdp.bin`` and
  ``optimizer.bin``). Read with ``torch.load(weights_only=True)`` (memory-mapped) on every
  rank, each rank keeping only its own shards of each tensor.
* ``SHARDED_STATE_DICT``: ``torch.distributed.checkpoint.save`` of
  ``{"model": model.state_dict()}`` and the optimizer's state dict under ``"optim"`` or
  ``"optimizer"`` (accelerate: the directories ``pytorch_model_fsdp_0`` and
  ``optimizer_0``), in one directory or two. DCP reshards to this plan's layout, each rank
  reading only the chunks that overlap its shards; only tensors are read (the pickled
  ``param_groups`` DCP stores as bytes never are), through the reader that checks sizes
  and unpickles ``.metadata`` with DCP's classes only.

Keys are FSDP1's original parameter names (it strips its wrapper prefixes), which are
the plan's names: ``set_state_dict`` places each full or sharded tensor into the plan's
DTensors. The optimizer's hyperparameters (``param_groups``) stay the ones it was built
with; its per-parameter state (``step``, ``exp_avg``, ...) is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint.errors import CheckpointError, KeyMismatchError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

#: Top-level keys FSDP1 users and accelerate save the optimizer's state under in DCP.
OPTIMIZER_KEYS = ("optim", "optimizer")
MODEL_KEY = "model"


@attrs.frozen
class Fsdp1Load:
    """What :func:`load_fsdp1` read: the kind (``"full"`` or ``"sharded"``), and the
    model and optimizer tensors it loaded."""

    kind: str
    model_keys: int
    optimizer_keys: int


def load_fsdp1(path: str | os.PathLike[str], model: nn.Module,
               optimizer: torch.optim.Optimizer | None = None, *,
               optimizer_path: str | os.PathLike[str] | None = None) -> Fsdp1Load:
    """Load an FSDP1 checkpoint into ``model`` (a plan applied it) and ``optimizer``.

    ``path`` is a ``torch.save``d full state dict (a file) or a DCP directory (sharded);
    ``optimizer_path`` the optimizer's file or directory when it is not beside the model
    in ``path`` (a DCP directory may hold both). Every rank calls it. Strict: a key the
    model or the optimizer has and the checkpoint lacks, or the reverse, is a
    :class:`~composer_par.checkpoint.KeyMismatchError`."""
    path = Path(path)
    if path.is_dir():
        return _load_sharded(path, model, optimizer,
                             Path(optimizer_path) if optimizer_path else path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such FSDP1 checkpoint (a torch.save file of a "
                              "full state dict, or a DCP directory of a sharded one)")
    if optimizer is not None and optimizer_path is None:
        raise CheckpointError(f"{path} is a full model state dict; give optimizer_path= "
                              "(the file of FSDP.optim_state_dict) to load the optimizer")
    return _load_full(path, model, optimizer, Path(optimizer_path) if optimizer_path else None)


# -- FULL_STATE_DICT ---------------------------------------------------------------------


def _torch_load(path: Path) -> Any:
    from composer_par.checkpoint.torchfile import load_tensors_file

    # weights_only: tensors and plain containers, nothing that runs code.
    return load_tensors_file(path, what="a torch.save file of tensors")


def _check(source: str, expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise KeyMismatchError(source, missing, unexpected)


def _load_full(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               optimizer_path: Path | None) -> Fsdp1Load:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # The plan's own state dicts (DTensors, its names), each filled from the full tensors
    # in place: every rank keeps only its own shards. Then set as a sharded load is.
    states: Any = get_state_dict(model, optimizer if optimizer is not None else [])
    msd, osd = states
    state = _torch_load(path)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
    _check(str(path), set(msd), set(state))
    for key, target in msd.items():
        _fill(str(path), key, target, state[key])
    loaded = 0
    if optimizer is not None and optimizer_path is not None:
        saved = _torch_load(optimizer_path)
        if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
            raise CheckpointError(f"{optimizer_path}: not an optimizer state dict (FSDP."
                                  "optim_state_dict gives 'state' and 'param_groups')")
        _check(str(optimizer_path), _optimizer_keys(osd["state"]),
               _optimizer_keys(saved["state"]))
        _check_groups(osd, saved)
        for fqn, entry in osd["state"].items():
            for key, target in entry.items():
                _fill(str(optimizer_path), f"{fqn}.{key}", target, saved["state"][fqn][key])
        loaded = len(_optimizer_keys(saved["state"]))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, msd)
    return Fsdp1Load("full", len(state), loaded)


def _fill(source: str, key: str, target: Any, full: Any) -> None:
    """Copy this rank's part of the full tensor ``full`` into ``target`` (a DTensor: its
    local shard; a plain tensor: all of it)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(full, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise CheckpointError(f"{source}: {key} is a {type(full).__name__}, not a tensor")
    if tuple(full.shape) != tuple(target.shape):
        raise KeyMismatchError(source, mismatched=[(key, str(tuple(target.shape)),
                                                    str(tuple(full.shape)))])
    full = full.to(target.dtype)
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank holds the full tensor; each slices its own part.
        part = distribute_tensor(full, target.device_mesh, target.placements,
                                 src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(full)


def _optimizer_keys(state: Mapping[str, Mapping[str, Any]]) -> set[str]:
    return {f"{fqn}.{key}" for fqn, entry in state.items() for key in entry}


def _check_groups(own: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """The saved optimizer groups the same parameters (by name) as this one; its own
    hyperparameters stay."""
    mine = [list(g["params"]) for g in own["param_groups"]]
    theirs = [list(g.get("params", ())) for g in saved["param_groups"]]
    if mine != theirs:
        raise CheckpointError(f"the checkpoint's optimizer groups the parameters as "
                              f"{len(theirs)} group(s) of {[len(g) for g in theirs]}, this "
                              f"one as {len(mine)} of {[len(g) for g in mine]}: build the "
                              "optimizer with the same parameter groups")


# -- SHARDED_STATE_DICT ------------------------------------------------------------------


def _load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  optimizer_path: Path) -> Fsdp1Load:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from composer_par.checkpoint.dcp import read_metadata, stored_specs
    from composer_par.checkpoint.errors import dcp_errors
    from composer_par.checkpoint.integrity import verifying_reader

    collective = dist.is_available() and dist.is_initialized()
    states: Any = get_state_dict(model, optimizer) if optimizer is not None else (
        get_state_dict(model, [])[0], None)
    msd, osd = states

    def read(directory: Path, state: dict[str, Any], prefix: str) -> None:
        metadata = read_metadata(directory, None)  # not a composer_par step: no commit
        _check(str(directory), _flat(state),
               {k for k in stored_specs(metadata) if k.startswith(prefix)})
        with verifying_reader(directory, metadata, None, collective=collective) as reader, \
                dcp_errors(f"loading {directory}"):
            dcp.load(state, storage_reader=reader, no_dist=not collective)

    read(path, {MODEL_KEY: msd}, f"{MODEL_KEY}.")
    loaded = 0
    if optimizer is not None and osd is not None:
        key = _optimizer_key(optimizer_path, read_metadata(optimizer_path, None))
        tensors = {fqn: {k: v for k, v in entry.items() if hasattr(v, "shape")}
                   for fqn, entry in osd["state"].items()}
        read(optimizer_path, {key: {"state": tensors}}, f"{key}.state.")
        for fqn, entry in tensors.items():
            osd["state"][fqn].update(entry)
        loaded = len(_optimizer_keys(tensors))
    if osd is not None:
        set_state_dict(model, optimizer, model_state_dict=msd,  # type: ignore[arg-type]
                       optim_state_dict=osd)
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, msd)
    return Fsdp1Load("sharded", len(msd), loaded)


def _flat(tree: Mapping[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _flat(value, name + ".")
        else:
            out.add(name)
    return out


def _optimizer_key(directory: Path, metadata: Any) -> str:
    tops = {k.split(".", 1)[0] for k in metadata.state_dict_metadata}
    found = [k for k in OPTIMIZER_KEYS if k in tops]
    if not found:
        raise CheckpointError(f"{directory}: holds no optimizer state (no key under "
                              f"{' or '.join(map(repr, OPTIMIZER_KEYS))}; it has "
                              f"{sorted(tops)})")
    return found[0]


# -- convert -----------------------------------------------------------------------------

#: Suffixes of ``torch.save`` files of a full state dict (accelerate: ``.bin``).
TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def is_fsdp1_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is what FSDP1 saves of a model: a ``torch.save`` file (a full
    state dict), or a DCP directory that composer_par did not write (a sharded one)."""
    from composer_par.checkpoint import steps

    p = Path(path)
    if p.is_file():
        return p.suffix in TORCH_SUFFIXES
    return p.is_dir() and (p / steps.DCP_METADATA).is_file() and not any(
        (p / name).exists() for name in (steps.INFO, steps.MARKER))


def model_tensors(path: Path) -> tuple[dict[str, Any], Any]:
    """The model's tensors of an FSDP1 checkpoint: their specs, and a reader of one."""
    import torch

    from composer_par.checkpoint.convert import TensorSpec

    if path.is_file():
        state = _torch_load(path)
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{path}: {key} is a {type(value).__name__}, not a "
                                      "tensor (an optimizer state dict? convert the model's)")
        specs = {k: TensorSpec(tuple(v.shape), str(v.dtype).removeprefix("torch."))
                 for k, v in state.items()}
        return specs, lambda key, dtype: state[key].to(dtype)

    import torch.distributed.checkpoint as dcp

    from composer_par.checkpoint.dcp import read_metadata, stored_specs
    from composer_par.checkpoint.errors import dcp_errors
    from composer_par.checkpoint.integrity import verifying_reader

    metadata = read_metadata(path, None)  # not a composer_par step: no commit record
    prefix = f"{MODEL_KEY}."
    specs = {k[len(prefix):]: TensorSpec(s.shape, s.dtype)
             for k, s in stored_specs(metadata).items() if k.startswith(prefix)}
    if not specs:
        raise CheckpointError(f"{path}: no tensors under {MODEL_KEY!r} (FSDP1 saves the "
                              "model's sharded state dict as {'model': model.state_dict()})")

    def read(key: str, dtype: torch.dtype) -> torch.Tensor:
        spec = specs[key]
        tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        # One tensor per load: DCP reads only the chunks of this one.
        with verifying_reader(path, metadata, None) as reader, \
                dcp_errors(f"reading {path}"):
            dcp.load({MODEL_KEY: {key: tensor}}, storage_reader=reader, no_dist=True)
        return tensor.to(dtype)

    return specs, read


def fsdp1_to_safetensors(source: str | os.PathLike[str],
                         destination: str | os.PathLike[str], *,
                         dtype: torch.dtype | str | None = None,
                         max_file_bytes: int | None = None, progress: Any = None) -> Any:
    """An FSDP1 model checkpoint (a full state dict file, or a sharded DCP directory) as
    consolidated safetensors, one tensor at a time."""
    from composer_par.checkpoint.convert import tensors_to_safetensors

    specs, read = model_tensors(Path(source))
    return tensors_to_safetensors(str(source), specs, read, destination, dtype=dtype,
                                  max_file_bytes=max_file_bytes, progress=progress)


def fsdp1_to_dcp(source: str | os.PathLike[str], destination: str | os.PathLike[str], *,
                 dtype: torch.dtype | str | None = None, progress: Any = None) -> Any:
    """An FSDP1 model checkpoint as a committed DCP checkpoint of composer_par's (the
    optimizer's state is not converted: :func:`load_fsdp1` reads it into a plan)."""
    from composer_par.checkpoint.convert import tensors_to_dcp

    specs, read = model_tensors(Path(source))
    return tensors_to_dcp(str(source), specs, read, destination, dtype=dtype,
                          progress=progress)


__all__ = ["Fsdp1Load", "fsdp1_to_dcp", "fsdp1_to_safetensors", "is_fsdp1_checkpoint",
           "load_fsdp1"]
