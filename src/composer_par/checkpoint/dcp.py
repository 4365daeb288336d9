"""Sharded save and load of model and optimizer state with torch.distributed.checkpoint.

``save`` writes every rank's shards with DCP into a fresh step directory, then commits it;
``load`` reads them back into any other mesh or world size (DCP reshards), strictly: keys
of the model or optimizer that the checkpoint lacks, and keys of the checkpoint that they
lack, are errors. State dicts come from torch's helpers (``get_state_dict`` /
``set_state_dict``), so names are the model's own on every layout (no wrapper prefixes).

Only tensors go through DCP. Everything else (the optimizer's param groups, the caller's
``extra``, the plan) is JSON in ``composer_par.json``: DCP would store those objects with
``torch.save`` and read them back with ``torch.load(weights_only=False)``, a pickle.
DCP's own ``.metadata`` file is still a pickle: load checkpoints from trusted sources only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint import _dist, steps
from composer_par.checkpoint.errors import CheckpointError, KeyMismatchError, dcp_errors
from composer_par.checkpoint.matching import Spec, convertible
from composer_par.checkpoint.rng import rank_file, restore_rng, save_rng
from composer_par.logging import get_logger

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plan import ParallelPlan

log = get_logger(__name__)

FORMAT = 1
MODEL = "model"
OPTIM = "optim"


@attrs.frozen
class CheckpointInfo:
    """What ``load`` read besides the tensors."""

    path: Path
    step: int
    extra: Any
    plan: str | None  # the plan's TOML at save time
    world_size: int
    rng_restored: bool


# -- state dicts --------------------------------------------------------------------------


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None
                 ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)  # type: ignore[return-value]


def _split_optim_state(state: Mapping[str, Mapping[str, Any]]
                       ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Tensors of the optimizer state (for DCP) and its other values (for JSON)."""
    import torch

    tensors: dict[str, dict[str, Any]] = {}
    scalars: dict[str, Any] = {}
    for fqn, entry in state.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(fqn, {})[key] = value
            else:
                scalars[f"{fqn}\x00{key}"] = _to_json(value, f"optimizer state {fqn}.{key}")
    return tensors, scalars


def _to_json(value: Any, what: str) -> Any:
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, what) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v, what) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise CheckpointError(f"{what}: cannot store a {type(value).__name__} in the checkpoint "
                          "(only numbers, strings, lists and one-element tensors)")


def _from_json(value: Any) -> Any:
    import torch

    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _flat_specs(tree: Mapping[str, Any], prefix: str) -> dict[str, Spec]:
    """DCP's flattened keys (``a.b.c``) of the tensors in a nested dict."""
    out: dict[str, Spec] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            out.update(_flat_specs(value, name))
        elif hasattr(value, "shape"):
            out[name] = Spec(tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return out


# -- save ---------------------------------------------------------------------------------


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    step: int | None = None,
    plan: ParallelPlan | str | None = None,
    keep_last: int | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) sharded into ``path/step-NNNNNNNNN``; every rank
    calls it. Returns the committed step directory.

    ``step`` defaults to one past the highest step directory under ``path``. ``extra`` is
    any JSON value (epoch, samples seen, a data loader's position). ``plan`` (a plan or its
    TOML) is recorded so ``inspect`` shows the layout. ``generators`` are named
    ``torch.Generator`` objects (e.g. the data-order stream) saved per rank with torch's
    global RNG states. ``keep_last`` keeps that many committed steps and deletes the rest.

    The directory is committed (its ``COMMITTED`` marker written, atomically, by rank 0)
    only after every rank wrote everything; a save that fails or is killed midway leaves
    an uncommitted directory that ``latest`` and ``load`` ignore.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(path)
    rank, world = _dist.rank(), _dist.world_size()
    extra_json = _to_json(extra, "extra")
    plan_toml = plan if isinstance(plan, str) or plan is None else plan.to_toml()
    chosen: tuple[int, str] = (0, "")
    if rank == 0:
        chosen = _prepare_step_dir(root, step)
    step_value, problem = _dist.broadcast(chosen)
    if problem:
        raise CheckpointError(problem)
    directory = root / steps.step_name(step_value)
    started = time.perf_counter()

    msd, osd = _state_dicts(model, optimizer)
    state: dict[str, Any] = {MODEL: msd}
    info: dict[str, Any] = {"format": FORMAT, "step": step_value, "world_size": world,
                            "plan": plan_toml, "extra": extra_json}
    if osd is not None:
        tensors, scalars = _split_optim_state(osd["state"])
        state[OPTIM] = {"state": tensors}
        info["optimizer"] = {
            "param_groups": _to_json(osd["param_groups"], "optimizer param_groups"),
            "scalars": scalars,
            "class": type(optimizer).__name__,
        }
    with dcp_errors(f"saving {directory}"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
                 no_dist=not _dist.active())
    failure = ""
    try:
        save_rng(directory, rank, generators)
        if rank == 0:
            import torch

            info["torch"] = torch.__version__
            info["saved_at"] = time.time()
            steps.write_json_atomic(directory / steps.INFO, info)
    except Exception as exc:  # every rank must still reach agree() below
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    if not _dist.agree(not failure):
        raise CheckpointError(f"saving {directory} failed, left uncommitted"
                              + (f": {failure}" if failure else " on another rank"))
    committed = ""
    if rank == 0:
        try:
            steps.commit(directory, step_value)
            if keep_last is not None:
                removed = steps.retain(root, keep_last, step_value)
                if removed:
                    log.info("checkpoint retention", removed=[d.name for d in removed])
        except Exception as exc:
            committed = f"{type(exc).__name__}: {exc}"
    if not _dist.agree(not committed):
        raise CheckpointError(f"committing {directory} failed: {committed or 'on rank 0'}")
    log.info("checkpoint saved", path=str(directory), step=step_value,
             seconds=round(time.perf_counter() - started, 3))
    return directory


def _prepare_step_dir(root: Path, step: int | None) -> tuple[int, str]:
    """Rank 0: the step to save and an error message (empty when fine)."""
    try:
        existing = steps.step_dirs(root)
        if step is None:
            step = existing[-1][0] + 1 if existing else 0
        directory = root / steps.step_name(step)
        if directory.exists():
            if steps.is_committed(directory):
                return step, (f"{directory} is already a committed checkpoint; every save "
                              "goes to a fresh step directory: pass another step")
            # An unfinished save of the same step (a crashed run, restarted): never loadable.
            steps.remove(directory)
        directory.mkdir(parents=True)
        return step, ""
    except (OSError, ValueError) as exc:
        return step or 0, f"cannot create the step directory under {root}: {exc}"


# -- load ---------------------------------------------------------------------------------


def read_metadata(directory: Path) -> Any:
    """DCP's metadata of a checkpoint directory (a pickle: trusted sources only)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(directory)).read_metadata()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory}: not a DCP checkpoint (no .metadata)") from exc
    except Exception as exc:
        raise CheckpointError(f"{directory}/.metadata: unreadable ({exc})") from exc


def stored_specs(metadata: Any) -> dict[str, Spec]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: Spec(tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def check_keys(source: str, expected: Mapping[str, Spec], found: Mapping[str, Spec],
               prefixes: tuple[str, ...], *, strict: bool) -> None:
    """Raise KeyMismatchError unless ``found`` (the checkpoint's keys under ``prefixes``)
    holds every ``expected`` key with a loadable shape and dtype (strict: and no others)."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k.startswith(prefixes) and k not in expected]
    mismatched = [
        (k, spec.describe(), found[k].describe()) for k, spec in expected.items()
        if k in found and (found[k].shape != spec.shape
                           or not convertible(found[k].dtype, spec.dtype))
    ]
    if mismatched or (strict and (missing or unexpected)):
        raise KeyMismatchError(source, missing if strict else (),
                               unexpected if strict else (), mismatched)
    if missing:
        raise KeyMismatchError(source, missing)


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    restore_random: bool = True,
    generators: Mapping[str, torch.Generator] | None = None,
) -> CheckpointInfo:
    """Load a committed checkpoint into ``model`` (and ``optimizer``) on any mesh and
    world size; every rank calls it. ``path`` is a step directory or a root (its latest
    committed step). Raises CheckpointError naming the directory and keys on mismatch.

    ``strict=False`` tolerates checkpoint keys the model lacks (they are skipped and
    logged); keys the model needs are always required. RNG states (and ``generators``)
    are restored when the world size equals the saved one.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    directory = steps.resolve(path)
    info = steps.read_info(directory)
    metadata = read_metadata(directory)
    msd, osd = _state_dicts(model, optimizer)
    state: dict[str, Any] = {MODEL: msd}
    scalars_expected = False
    if osd is not None:
        tensors, _ = _split_optim_state(osd["state"])
        state[OPTIM] = {"state": tensors}
        if "optimizer" not in info:
            raise KeyMismatchError(str(directory), ["optimizer state (saved without one)"])
        scalars_expected = True
    expected = _flat_specs(msd, MODEL)
    if OPTIM in state:
        expected.update(_flat_specs(state[OPTIM]["state"], f"{OPTIM}.state"))
    found = stored_specs(metadata)
    prefixes = (f"{MODEL}.",) + ((f"{OPTIM}.",) if osd is not None else ())
    unexpected = [k for k in found if k.startswith(prefixes) and k not in expected]
    check_keys(str(directory), expected, found, prefixes, strict=strict)
    if unexpected:
        log.warning("checkpoint keys not loaded", path=str(directory), count=len(unexpected),
                    first=unexpected[:5])
    with dcp_errors(f"loading {directory}"):
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)),
                 no_dist=not _dist.active())
    optim_state = None
    if osd is not None and scalars_expected:
        saved = info["optimizer"]
        full_state: dict[str, dict[str, Any]] = {
            fqn: dict(entry) for fqn, entry in state[OPTIM]["state"].items()}
        for joined, value in saved.get("scalars", {}).items():
            fqn, _, key = joined.partition("\x00")
            full_state.setdefault(fqn, {})[key] = _from_json(value)
        optim_state = {"state": full_state, "param_groups": _from_json(saved["param_groups"])}
    with dcp_errors(f"setting the state loaded from {directory}"):
        if optimizer is not None and optim_state is not None:
            set_state_dict(model, optimizer, model_state_dict=msd,
                           optim_state_dict=optim_state)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, msd)
    saved_world = int(info.get("world_size", 0) or 0)
    restored = False
    has_rng = rank_file(directory, _dist.rank()).is_file()
    if restore_random and saved_world == _dist.world_size() and has_rng:
        restore_rng(directory, _dist.rank(), generators)
        restored = True
    elif restore_random and has_rng:
        log.warning("random state not restored: saved on another world size",
                    saved_world_size=saved_world, world_size=_dist.world_size())
    step = info.get("step", steps.step_of(directory))
    return CheckpointInfo(directory, int(step or 0), _from_json(info.get("extra")),
                          info.get("plan"), saved_world, restored)
