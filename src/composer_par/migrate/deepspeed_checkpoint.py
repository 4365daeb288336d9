"""Checkpoints written by DeepSpeed ZeRO (stages 1, 2 and 3): the fp32 model weights and
the optimizer's per-parameter state, rebuilt from the data-parallel partitions, without
DeepSpeed.

    ckpt = read_zero_checkpoint("ckpt")         # a save_checkpoint root (its `latest`) or a tag
    ckpt.tensor("layers.0.attn.wq.weight")      # the full fp32 weight
    ckpt.optimizer_state("layers.0.attn.wq.weight")   # exp_avg, exp_avg_sq, step

The layout, as ``engine.save_checkpoint(dir, tag)`` writes it::

    dir/latest                                          the tag, e.g. "global_step100"
    dir/<tag>/mp_rank_00_model_states.pt                stages 1-2: the module's state dict
    dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: one per rank
    dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   one per data-parallel rank
                                                        (bf16 training: bf16_zero_pp_...)

A model-states file holds ``module`` (stage 3: empty placeholders for the parameters;
the buffers are real), ``param_shapes`` (per parameter group, name -> shape, in the
order the parameters were flattened), ``buffer_names``, ``shared_params`` (tied names)
and the frozen parameters (``frozen_param_shapes`` / ``frozen_param_fragments``: they have
no fp32 master copy, so they are read in the dtype DeepSpeed trained in). An
optim-states file holds ``optimizer_state_dict`` with ``zero_stage``,
``partition_count``, this rank's fp32 master weights and the base optimizer's state:

* stages 1-2, ``single_partition_of_fp32_groups``: per parameter group, the group's
  parameters flattened one after another (with ``param_alignment_paddings`` between
  them), padded to a multiple of the world size and cut into equal partitions; a rank
  holds its partition with the padding at the group's end removed. The base optimizer's
  state (``base_optimizer_state``) is per group, each tensor the rank's whole partition
  (padding included); an elastic checkpoint keeps a list of per-group states without
  the padding and the step apart (``base_optimizer_state_step``).
* stage 3, ``fp32_flat_groups``: per sub-group, every parameter cut into world-size
  partitions of ``ceil(numel / world_size)`` elements (the last padded), a rank's part of
  each parameter laid one after another; ``optimizer_state_dict`` is the base
  optimizer's state per sub-group, each tensor as long as the rank's flat sub-group.

The files are pickles. They are read with ``torch.load(weights_only=True)``
(memory-mapped: a tensor is read when it is sliced), which runs no code from the file;
the few DeepSpeed objects they hold (the stage enum, the loss scaler, fragment
addresses) are read into plain stand-ins of ours, named one by one in
:data:`DEEPSPEED_GLOBALS`, so DeepSpeed need not be installed. A file whose layout is
not the one above is a :class:`~composer_par.checkpoint.CheckpointError` naming the file
and the key.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

LATEST = "latest"
OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


class _ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` (an IntEnum, pickled as a call with its number):
    read as the number."""


class _Unused:
    """A DeepSpeed object whose fields the reader never uses (the loss scaler, a
    fragment address): its pickled fields are set on a plain object and left there."""


#: The only non-torch globals a ZeRO checkpoint may name, each read into a stand-in.
DEEPSPEED_GLOBALS: dict[str, type] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _ZeroStage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _Unused,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _Unused,
    "deepspeed.utils.tensor_fragment.fragment_address": _Unused,
}


def _load(path: Path) -> Mapping[str, Any]:
    from composer_par.checkpoint.torchfile import load_tensors_file

    data = load_tensors_file(path, what="a DeepSpeed checkpoint file",
                             allowed=DEEPSPEED_GLOBALS)
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a dict")
    return data


def _get(data: Mapping[str, Any], key: str, path: Path, kind: type | tuple[type, ...],
         within: str = "") -> Any:
    where = f"{within}[{key!r}]" if within else repr(key)
    if key not in data:
        raise CheckpointError(f"{path}: no key {where} (a DeepSpeed ZeRO checkpoint has "
                              "one; is this file from another tool or a damaged save?)")
    value = data[key]
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(
            k.__name__ for k in kind)
        raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, expected a "
                              f"{expected}")
    return value


def resolve(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The tag directory of a DeepSpeed checkpoint: ``path/tag``, ``path/<latest>``, or
    ``path`` itself when it holds the optim-states files."""
    root = Path(path)
    source = "given"
    if tag is None and os.path.lexists(root / LATEST):
        from composer_par.checkpoint.paths import read_bounded

        raw = read_bounded(root / LATEST, 4096, what="DeepSpeed 'latest' file")
        tag = raw.decode("utf-8", "replace").strip()
        source = f"{root / LATEST} names"
    if tag is not None and (not tag or tag in (".", "..") or "/" in tag or "\\" in tag):
        # A tag is a directory beside `latest`: it never leads out of the checkpoint.
        raise CheckpointError(f"{source} the tag {tag!r}, which is not the name of a "
                              f"directory inside {root}")
    directory = root / tag if tag is not None else root
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such DeepSpeed checkpoint directory")
    if not any(OPTIM_STATES.match(p.name) for p in directory.iterdir()):
        raise CheckpointError(f"{directory}: no zero_pp_rank_*_mp_rank_*_optim_states.pt "
                              "files: not a DeepSpeed ZeRO checkpoint (give the directory "
                              "save_checkpoint wrote, or its tag directory)")
    return directory


def is_deepspeed_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed ZeRO checkpoint (a root with ``latest``, or a tag
    directory with optim-states files)."""
    root = Path(path)
    if not root.is_dir():
        return False
    if (root / LATEST).is_file():
        return True
    return any(OPTIM_STATES.match(p.name) for p in root.iterdir())


@attrs.frozen
class _Stage2Place:
    """A parameter of a stage 1-2 group: ``numel`` elements at ``offset`` of the group's
    flat vector, whose partitions the ranks hold in rank order."""

    group: int
    offset: int
    numel: int

    def gather(self, flat: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        return _cat(_slice([rank[self.group] for rank in flat], self.offset, self.numel))


@attrs.frozen
class _Stage3Place:
    """A stage 3 parameter: each rank holds ``part`` elements of it at ``offset`` of its
    own flat vector (its sub-groups one after another); rank order, padding cut."""

    offset: int
    numel: int
    part: int

    def gather(self, flat: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        pieces = [p for rank in flat for p in _slice(rank, self.offset, self.part)]
        return _cat(pieces)[:self.numel]


def _slice(tensors: Sequence[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
    """``length`` elements from ``start`` of the 1-D tensors laid end to end."""
    out, base = [], 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start - base, 0), min(start + length - base, n)
        if lo < hi:
            # detach: the master weights are saved as the optimizer's parameters, which
            # require grad, and a slice of one would not be a leaf.
            out.append(t.detach()[lo:hi])
        base += n
    return out


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)


@attrs.frozen
class ZeroCheckpoint:
    """A DeepSpeed ZeRO checkpoint, read: every tensor's name and shape, and each one
    rebuilt on demand (the files are memory-mapped)."""

    directory: Path
    stage: int
    world_size: int
    ds_version: str | None
    global_steps: int | None
    shapes: dict[str, tuple[int, ...]]
    _places: dict[str, _Stage2Place | _Stage3Place]
    _fp32: list[list[torch.Tensor]]  # per rank, per group: the fp32 master weights
    _state: list[list[dict[str, torch.Tensor]]]  # per rank, per group: optimizer state
    _whole: dict[str, torch.Tensor]  # buffers and frozen parameters, full already
    _aliases: dict[str, str]  # tied name -> the name it shares storage with
    #: The base optimizer's parameter groups: its hyperparameters, and under ``params``
    #: the names of the parameters it trained (None: an elastic stage 1-2 checkpoint,
    #: which does not keep them).
    param_groups: list[dict[str, Any]] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    @property
    def optimized(self) -> list[str]:
        """The parameters the optimizer held, each once (a tied one by its first name)."""
        return list(self._places)

    @property
    def trainable(self) -> list[str]:
        """The names the optimizer trained (those with optimizer state)."""
        return [n for n in self.shapes if self._aliases.get(n, n) in self._places]

    def tensor(self, name: str) -> torch.Tensor:
        """The full fp32 tensor ``name`` (a parameter: its master weights)."""
        name_ = self._aliases.get(name, name)
        if name_ in self._whole:
            return self._whole[name_].detach()
        if name_ not in self._places:
            raise KeyError(name)
        return self._places[name_].gather(self._fp32).view(self.shapes[name])

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """The base optimizer's state of parameter ``name``, full: each per-element
        tensor (AdamW: ``exp_avg``, ``exp_avg_sq``) in the parameter's shape, and the
        scalars (``step``) as saved."""
        place = self._places[self._aliases.get(name, name)]
        group = place.group if isinstance(place, _Stage2Place) else 0
        out: dict[str, torch.Tensor] = {}
        for key, first in self._state[0][group].items():
            if first.dim() == 0:
                out[key] = first.detach().clone()
            else:
                per_rank = [[g[key] for g in rank] for rank in self._state]
                out[key] = place.gather(per_rank).view(self.shapes[name])
        return out

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.shapes:
            yield name, self.tensor(name)


def read_zero_checkpoint(path: str | os.PathLike[str], tag: str | None = None
                         ) -> ZeroCheckpoint:
    """Read the DeepSpeed ZeRO checkpoint at ``path`` (a ``save_checkpoint`` root, read
    at its ``latest`` tag or at ``tag``; or a tag directory)."""
    directory = resolve(path, tag)
    optim_files = _optim_files(directory)
    optims = [_get(_load(p), "optimizer_state_dict", p, Mapping) for p in optim_files]
    first = optim_files[0]
    stage = int(_get(optims[0], "zero_stage", first, int, "optimizer_state_dict"))
    counts = _get(optims[0], "partition_count", first, (int, list), "optimizer_state_dict")
    world = max(counts) if isinstance(counts, list) else counts
    if world != len(optim_files):
        raise CheckpointError(f"{directory}: partition_count says {world} data-parallel "
                              f"ranks, but there are {len(optim_files)} optim-states files "
                              "(a rank's save is missing, or two saves were mixed)")
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{first}: zero_stage is {stage}; a ZeRO checkpoint of "
                              "stage 1, 2 or 3 was expected")
    if stage == 3:
        model_files = [directory / ZERO3_MODEL_STATES.format(rank=r) for r in range(world)]
    else:
        model_files = [directory / MODEL_STATES]
    for p in model_files:
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the model-states file of a stage {stage} "
                                  "checkpoint)")
    models = [_load(p) for p in model_files]
    model, model_file = models[0], model_files[0]
    module = _get(model, "module", model_file, Mapping)
    groups = _get(model, "param_shapes", model_file, list)
    buffer_names = _get(model, "buffer_names", model_file, list)

    shapes: dict[str, tuple[int, ...]] = {}
    whole: dict[str, torch.Tensor] = {}
    for name in buffer_names:
        if name in module:  # a non-persistent buffer is listed but not saved
            whole[name] = module[name]
            shapes[name] = tuple(module[name].shape)
    _frozen(models, model_files, stage, world, shapes, whole)

    places: dict[str, _Stage2Place | _Stage3Place]
    if stage == 3:
        fp32 = [list(_get(o, "fp32_flat_groups", f, list, "optimizer_state_dict"))
                for o, f in zip(optims, optim_files, strict=True)]
        state = [_stage3_state(o, f, len(g)) for o, f, g in zip(optims, optim_files, fp32,
                                                                strict=True)]
        places = dict(_stage3_places(groups, world, fp32, model_file, optim_files))
    else:
        fp32 = [list(_get(o, "single_partition_of_fp32_groups", f, list,
                          "optimizer_state_dict"))
                for o, f in zip(optims, optim_files, strict=True)]
        state = [_stage2_state(o, f, g) for o, f, g in zip(optims, optim_files, fp32,
                                                          strict=True)]
        places = dict(_stage2_places(groups, fp32, optims[0], model_file, directory))
    for name in places:
        shapes[name] = _shape_of(groups, name)
    aliases = {}
    shared = model.get("shared_params") or {}
    for name, target in shared.items():
        if target in shapes:
            aliases[name] = target
            shapes[name] = shapes[target]
    steps = model.get("global_steps")
    version = model.get("ds_version")
    return ZeroCheckpoint(directory, stage, world, str(version) if version else None,
                          steps if isinstance(steps, int) else None, shapes, places, fp32,
                          state, whole, aliases, _param_groups(optims[0], first, groups))


def _param_groups(optim: Mapping[str, Any], path: Path, groups: list[Any]
                  ) -> list[dict[str, Any]] | None:
    """The base optimizer's groups, their parameters named. The base optimizer holds one
    flat tensor per entry of ``param_shapes`` (stages 1-2: per group; stage 3: per
    sub-group), and its groups list those tensors by index."""
    base = optim.get("base_optimizer_state", optim.get("optimizer_state_dict"))
    if not isinstance(base, Mapping) or not isinstance(base.get("param_groups"), list):
        return None
    out, used = [], []
    for group in base["param_groups"]:
        flats = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(flats, list) or not all(
                isinstance(i, int) and 0 <= i < len(groups) for i in flats):
            raise CheckpointError(f"{path}: a parameter group of the base optimizer lists "
                                  f"{flats!r}, not indices of the {len(groups)} flat "
                                  "group(s) param_shapes describes")
        used += flats
        out.append({**{k: v for k, v in group.items() if k != "params"},
                    "params": [name for i in flats for name in groups[i]]})
    if sorted(used) != list(range(len(groups))):
        raise CheckpointError(f"{path}: the base optimizer's groups hold the flat groups "
                              f"{sorted(used)}, param_shapes describes {len(groups)}")
    return out


def _optim_files(directory: Path) -> list[Path]:
    found: dict[int, Path] = {}
    for p in directory.iterdir():
        m = OPTIM_STATES.match(p.name)
        if not m:
            continue
        if m.group(2) != "00":
            raise CheckpointError(f"{p}: a tensor- or pipeline-parallel ZeRO checkpoint "
                                  "(mp_rank other than 00); only data-parallel ZeRO "
                                  "checkpoints are read")
        found[int(m.group(1))] = p
    if sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))
        raise CheckpointError(f"{directory}: the optim-states files of rank(s) {missing} "
                              "are missing")
    return [found[r] for r in range(len(found))]


def _shape_of(groups: list[Any], name: str) -> tuple[int, ...]:
    for g in groups:
        if name in g:
            return tuple(int(d) for d in g[name])
    raise KeyError(name)


def _frozen(models: list[Mapping[str, Any]], files: list[Path], stage: int, world: int,
            shapes: dict[str, tuple[int, ...]], whole: dict[str, torch.Tensor]) -> None:
    """Parameters that do not train: stages 1-2 save them whole, stage 3 as each rank's
    partition (padded like the trained ones)."""
    import torch

    frozen = models[0].get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        fragments = []
        for model, path in zip(models, files, strict=True):
            held = _get(model, "frozen_param_fragments", path, Mapping)
            if name not in held:
                raise CheckpointError(f"{path}: ['frozen_param_fragments'] has no {name!r}, "
                                      "which frozen_param_shapes lists")
            fragments.append(held[name].reshape(-1))
        full = torch.cat(fragments) if stage == 3 else fragments[0]
        if full.numel() < numel:
            raise CheckpointError(f"{files[0]}: frozen parameter {name!r} has "
                                  f"{full.numel()} of its {numel} elements")
        whole[name] = full[:numel].view(shape)
        shapes[name] = shape


def _stage2_places(groups: list[Any], fp32: list[list[torch.Tensor]],
                   optim: Mapping[str, Any], model_file: Path, directory: Path
                   ) -> dict[str, _Stage2Place]:
    if any(len(rank) != len(groups) for rank in fp32):
        raise CheckpointError(f"{directory}: the optim-states files hold "
                              f"{[len(r) for r in fp32]} fp32 group(s), {model_file} lists "
                              f"{len(groups)} parameter group(s) in param_shapes")
    paddings = optim.get("param_alignment_paddings")
    places: dict[str, _Stage2Place] = {}
    for g, shapes in enumerate(groups):
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(int(d) for d in shape)
            places[name] = _Stage2Place(g, offset, numel)
            offset += numel
            if paddings is not None:
                offset += int(paddings[g][i])
        held = sum(rank[g].numel() for rank in fp32)
        if held != offset:
            raise CheckpointError(f"{directory}: parameter group {g} has {offset} elements "
                                  f"by {model_file}'s param_shapes, but the ranks' "
                                  f"single_partition_of_fp32_groups[{g}] hold {held}")
    return places


def _stage2_state(optim: Mapping[str, Any], path: Path, fp32: list[torch.Tensor]
                  ) -> list[dict[str, torch.Tensor]]:
    """Per group, the base optimizer's state cut to the rank's partition (its padding
    removed, as the fp32 weights are)."""
    import torch

    base = _get(optim, "base_optimizer_state", path, (Mapping, list), "optimizer_state_dict")
    if isinstance(base, list):  # elastic: per group, without padding; the step apart
        per_group = list(base)
        step = optim.get("base_optimizer_state_step")
        if step is not None:
            per_group = [{**s, "step": torch.as_tensor(step, dtype=torch.float32)}
                         for s in per_group]
    else:
        held = _get(base, "state", path, Mapping, "optimizer_state_dict.base_optimizer_state")
        per_group = [held.get(g, {}) for g in range(len(fp32))]
    if len(per_group) != len(fp32):
        raise CheckpointError(f"{path}: base_optimizer_state has {len(per_group)} group(s), "
                              f"single_partition_of_fp32_groups {len(fp32)}")
    return [_cut(dict(s), w.numel(), path, g) for g, (s, w) in enumerate(zip(
        per_group, fp32, strict=True))]


def _cut(state: dict[str, Any], numel: int, path: Path, group: int) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        if not hasattr(value, "dim"):
            continue
        if value.dim() > 0:
            if value.numel() < numel:
                raise CheckpointError(f"{path}: optimizer state {key!r} of group {group} "
                                      f"has {value.numel()} elements, the partition {numel}")
            value = value.reshape(-1)[:numel]
        out[key] = value
    return out


def _stage3_state(optim: Mapping[str, Any], path: Path, groups: int
                  ) -> list[dict[str, torch.Tensor]]:
    base = _get(optim, "optimizer_state_dict", path, Mapping, "optimizer_state_dict")
    held = _get(base, "state", path, Mapping, "optimizer_state_dict.optimizer_state_dict")
    fp32 = _get(optim, "fp32_flat_groups", path, list, "optimizer_state_dict")
    return [_cut(dict(held.get(g, {})), fp32[g].numel(), path, g) for g in range(groups)]


def _stage3_places(groups: list[Any], world: int, fp32: list[list[torch.Tensor]],
                   model_file: Path, optim_files: list[Path]) -> dict[str, _Stage3Place]:
    places: dict[str, _Stage3Place] = {}
    offset = 0
    for shapes in groups:
        for name, shape in shapes.items():
            numel = math.prod(int(d) for d in shape)
            part = math.ceil(numel / world)
            places[name] = _Stage3Place(offset, numel, part)
            offset += part
    for rank, path in zip(fp32, optim_files, strict=True):
        held = sum(t.numel() for t in rank)
        if held != offset:
            raise CheckpointError(f"{path}: fp32_flat_groups hold {held} elements, but "
                                  f"{model_file}'s param_shapes give each rank {offset}")
    return places


# -- convert -----------------------------------------------------------------------------


def convertible(ckpt: ZeroCheckpoint) -> tuple[dict[str, Any], Any]:
    from composer_par.checkpoint.convert import TensorSpec

    if not ckpt.shapes:
        raise CheckpointError(f"{ckpt.directory}: no tensors to convert")
    specs = {name: TensorSpec(shape, str(ckpt.tensor(name).dtype).removeprefix("torch."))
             if name not in ckpt.trainable else TensorSpec(shape, "float32")
             for name, shape in ckpt.shapes.items()}
    return specs, lambda key, dtype: ckpt.tensor(key).to(dtype)


def deepspeed_to_safetensors(source: str | os.PathLike[str],
                             destination: str | os.PathLike[str], *, tag: str | None = None,
                             dtype: torch.dtype | str | None = None,
                             max_file_bytes: int | None = None,
                             progress: Any = None) -> Any:
    """The fp32 weights (and buffers) of a DeepSpeed ZeRO checkpoint as consolidated
    safetensors in ``destination``, one tensor rebuilt and written at a time (see
    :func:`composer_par.checkpoint.convert.tensors_to_safetensors`)."""
    from composer_par.checkpoint.convert import tensors_to_safetensors

    ckpt = read_zero_checkpoint(source, tag)
    specs, read = convertible(ckpt)
    return tensors_to_safetensors(str(ckpt.directory), specs, read, destination, dtype=dtype,
                                  max_file_bytes=max_file_bytes, progress=progress)


def deepspeed_to_dcp(source: str | os.PathLike[str], destination: str | os.PathLike[str], *,
                     tag: str | None = None, dtype: torch.dtype | str | None = None,
                     progress: Any = None) -> Any:
    """A DeepSpeed ZeRO checkpoint as a committed DCP checkpoint ``destination`` at
    DeepSpeed's step: the fp32 weights and buffers, and the base optimizer's state and
    parameter groups, which ``load(path, model, optimizer)`` reads into any plan.
    ``dtype`` converts the weights; the optimizer's state keeps its own."""
    from composer_par.checkpoint.convert import OptimizerTensors, TensorSpec, tensors_to_dcp

    ckpt = read_zero_checkpoint(source, tag)
    specs, read = convertible(ckpt)
    optimizer = None
    if ckpt.param_groups is not None:
        optim_specs = {
            fqn: {k: TensorSpec(tuple(v.shape), str(v.dtype).removeprefix("torch."))
                  for k, v in ckpt.optimizer_state(fqn).items()}
            for fqn in ckpt.optimized}
        optimizer = OptimizerTensors(
            optim_specs, lambda fqn, key: ckpt.optimizer_state(fqn)[key],
            ckpt.param_groups, "DeepSpeed ZeRO's base optimizer")
    return tensors_to_dcp(str(ckpt.directory), specs, read, destination, dtype=dtype,
                          progress=progress, step=ckpt.global_steps or 0, optimizer=optimizer)


# -- into a plan's model -----------------------------------------------------------------


@attrs.frozen
class DeepSpeedLoad:
    """What :func:`load_deepspeed` read: the ZeRO stage, its world size, and the model
    and optimizer tensors loaded."""

    stage: int
    world_size: int
    model_keys: int
    optimizer_keys: int


def load_deepspeed(path: str | os.PathLike[str], model: nn.Module,
                   optimizer: torch.optim.Optimizer | None = None, *,
                   tag: str | None = None) -> DeepSpeedLoad:
    """Load a DeepSpeed ZeRO checkpoint into ``model`` (a plan applied it) and
    ``optimizer``, on any mesh and number of ranks: every rank calls it, rebuilds each
    full tensor from the memory-mapped partitions and keeps only its own shards.

    The weights are DeepSpeed's fp32 master weights. Strict: a key the model or the
    optimizer has and the checkpoint lacks, or the reverse, is a
    :class:`~composer_par.checkpoint.KeyMismatchError`. The optimizer's hyperparameters
    stay its own; its per-parameter state (``step``, ``exp_avg``, ...) is loaded."""
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from composer_par.migrate.fsdp1_checkpoint import _check, _fill, _optimizer_keys

    ckpt = read_zero_checkpoint(path, tag)
    source = str(ckpt.directory)
    states: Any = get_state_dict(model, optimizer if optimizer is not None else [])
    msd, osd = states
    _check(source, set(msd), set(ckpt.names))
    for key, target in msd.items():
        _fill(source, key, target, ckpt.tensor(key))
    if optimizer is None:
        set_model_state_dict(model, msd)
        return DeepSpeedLoad(ckpt.stage, ckpt.world_size, len(msd), 0)
    trained = set(ckpt.trainable)
    saved = {fqn: ckpt.optimizer_state(fqn) for fqn in osd["state"] if fqn in trained}
    _check(f"{source} (optimizer state)", _optimizer_keys(osd["state"]),
           _optimizer_keys(saved))
    for fqn, entry in osd["state"].items():
        for key, target in entry.items():
            _fill(source, f"{fqn}.{key}", target, saved[fqn][key])
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    return DeepSpeedLoad(ckpt.stage, ckpt.world_size, len(msd),
                         len(_optimizer_keys(saved)))


__all__ = ["DEEPSPEED_GLOBALS", "DeepSpeedLoad", "ZeroCheckpoint", "deepspeed_to_dcp",
           "deepspeed_to_safetensors", "is_deepspeed_checkpoint", "load_deepspeed",
           "read_zero_checkpoint", "resolve"]
