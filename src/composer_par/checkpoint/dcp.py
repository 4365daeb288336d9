"""Sharded save and load of model and optimizer state with torch.distributed.checkpoint.

``save`` writes every rank's shards with DCP into a fresh step directory, then commits it;
``load`` reads them back into any other mesh or world size (DCP reshards), strictly: keys
of the model or optimizer that the checkpoint lacks, and keys of the checkpoint that they
lack, are errors. State dicts come from torch's helpers (``get_state_dict`` /
``set_state_dict``), so names are the model's own on every layout (no wrapper prefixes).

Only tensors go through DCP. Everything else (the optimizer's param groups, the caller's
``extra``, the plan) is JSON in ``composer_par.json``: DCP would store those objects with
``torch.save`` and read them back with ``torch.load(weights_only=False)``, a pickle.
DCP's own ``.metadata`` file is a pickle: it is read by an unpickler that finds only the
classes DCP metadata holds (:mod:`~composer_par.checkpoint.dcp_metadata`), so it runs no
code from the file.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint import _dist, claims, runs, steps
from composer_par.checkpoint.claims import Job
from composer_par.checkpoint.errors import (
    CheckpointError,
    CorruptFileError,
    KeyMismatchError,
    UncommittedError,
    dcp_errors,
    describe_failure,
    disk_full_message,
    is_disk_full,
)
from composer_par.checkpoint.integrity import (
    FileRecord,
    Manifest,
    digest_file,
    digesting_writer,
    verifying_reader,
)
from composer_par.checkpoint.matching import Spec, convertible
from composer_par.checkpoint.paths import contained, read_bounded
from composer_par.checkpoint.rng import DIRECTORY as RNG_DIRECTORY
from composer_par.checkpoint.rng import SavedRng, rank_file, read_rng, save_rng
from composer_par.checkpoint.strided import for_dcp
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
    run: str | None = None  # the run that saved it (None: saved without a run id)


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
            items = value["__tuple__"]
            if not isinstance(items, list):
                raise ValueError(f"__tuple__ must hold a list; found {items!r}")
            return tuple(_from_json(v) for v in items)
        if "__tensor__" in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {value.get('dtype')!r}")
            number = value["__tensor__"]
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise ValueError(f"__tensor__ must hold a number; found {number!r}")
            return torch.tensor(number, dtype=dtype)
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _saved_extra(path: Path, value: Any) -> Any:
    """The ``extra`` saved in the info file ``path``, rebuilt from JSON: a field that does
    not rebuild is an error naming the file before anything is read into the model."""
    try:
        return _from_json(value)
    except (TypeError, ValueError, AttributeError, RecursionError, OverflowError) as exc:
        raise CorruptFileError(f"{path}: field extra: cannot be read back "
                               f"({type(exc).__name__}: {exc})") from None


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
    run: str | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) sharded into ``path/step-NNNNNNNNN``; every rank
    calls it. Returns the committed step directory.

    ``step`` defaults to one past the highest step directory under ``path``. ``extra`` is
    any JSON value (epoch, samples seen, a data loader's position). ``plan`` (a plan or its
    TOML) is recorded so ``inspect`` shows the layout. ``generators`` are named
    ``torch.Generator`` objects (e.g. the data-order stream) saved per rank with torch's
    global RNG states. ``keep_last`` keeps that many committed steps of this save's run
    and deletes its older ones (never a step of another run, never the one just saved).
    ``run`` names the run (default: see :mod:`~composer_par.checkpoint.runs`: the
    environment's, the one this process resumed, torchrun's, or this process's own); it
    is recorded in the commit.

    Rank 0 first claims the step directory for this job (an existing one is an error
    naming the job that has it, unless that job is provably gone). The directory is
    committed (its ``COMMITTED`` marker written, atomically, by rank 0, with the size and
    digests of every file each rank wrote) only after every rank wrote everything; a save
    that fails is removed, one killed midway leaves an uncommitted directory that
    ``latest`` and ``load`` ignore. A failure names every failing rank's error, on every
    rank.
    """
    root = Path(path)
    if run is not None:
        runs.check_run(run)
    rank, world = _dist.rank(), _dist.world_size()
    plan_toml = plan if isinstance(plan, str) or plan is None else plan.to_toml()
    started = time.perf_counter()
    # Everything that can be refused is refused before a step directory is claimed, on
    # every rank together: ranks holding different parameters (pipeline stages) can
    # fail differently, and a rank that raised alone would leave the others waiting.
    state: dict[str, Any] = {}
    info: dict[str, Any] = {}
    own: tuple[list[Any], dict[str, Any]] | None = None
    refused = ""
    try:
        extra_json = _to_json(extra, "extra")
        msd, osd = _state_dicts(model, optimizer)
        state[MODEL] = msd
        info.update({"format": FORMAT, "world_size": world, "plan": plan_toml,
                     "extra": extra_json})
        if osd is not None:
            tensors, scalars = _split_optim_state(osd["state"])
            state[OPTIM] = {"state": tensors}
            own = (_to_json(osd["param_groups"], "optimizer param_groups"), scalars)
    except CheckpointError as exc:
        refused = str(exc)
    groups = _gather_optimizer_json(own, refused)
    if groups is not None:
        info["optimizer"] = {"param_groups": groups[0], "scalars": groups[1],
                             "class": type(optimizer).__name__}
    chosen: tuple[int, str, str] = (0, "", "")
    job: Job | None = None
    # On every rank (a bad COMPOSER_PAR_RUN_ID is refused everywhere); rank 0's counts.
    save_run = runs.run_for_save(root, run, claims.job_id())
    if rank == 0:
        job = Job.current(world, save_run)
        chosen = _claim_step_dir(root, step, job)
    try:
        return _write_and_commit(root, state, info, chosen, job, keep_last, generators,
                                 started)
    finally:
        if job is not None:
            claims.release(job)


def _write_and_commit(root: Path, state: dict[str, Any], info: dict[str, Any],
                      chosen: tuple[int, str, str], job: Job | None, keep_last: int | None,
                      generators: Mapping[str, torch.Generator] | None, started: float
                      ) -> Path:
    """Every rank: write the claimed step, then (rank 0, ``job``) commit it and apply
    the run's retention."""
    import torch.distributed.checkpoint as dcp

    rank = _dist.rank()
    # The job id travels with the step: every rank's errors can name the claim.
    step_value, _, problem = _dist.broadcast(chosen)
    if problem:
        raise CheckpointError(problem)
    directory = root / steps.step_name(step_value)
    info["step"] = step_value
    failure = ""
    records: dict[str, FileRecord] = {}
    writer = digesting_writer(directory, sync_files=True)
    try:
        with dcp_errors(f"saving {directory}", directory):
            dcp.save(for_dcp(state), storage_writer=writer, no_dist=not _dist.active())
    except CheckpointError as exc:  # DCP raises it on every rank alike
        failure = str(exc).removeprefix(f"saving {directory} failed: ")
    if not failure:
        try:
            save_rng(directory, rank, generators)
            records = dict(writer.records)
            rng = rank_file(directory, rank)
            records[rng.relative_to(directory).as_posix()] = digest_file(rng)
            if rank == 0:
                import torch

                info["torch"] = torch.__version__
                info["saved_at"] = time.time()
                steps.write_json_atomic(directory / steps.INFO, info)
                records[steps.INFO] = digest_file(directory / steps.INFO)
                records[steps.DCP_METADATA] = digest_file(directory / steps.DCP_METADATA)
        except Exception as exc:  # every rank must still reach the gathers below
            failure = describe_failure(exc, rank, directory, "writing its files")
    # Every rank learns every rank's failure (not only that one happened somewhere).
    failures = [f for f in _dist.gather(failure) if f]
    if failures:
        unique = list(dict.fromkeys(failures))
        if job is not None:
            _discard_own(directory, job)
        raise CheckpointError(f"saving {directory} failed, nothing committed: "
                              + "; ".join(unique))
    gathered = _dist.gather_to_root(records)
    committed = ""
    if job is not None:
        committed = _commit(root, directory, step_value, job, gathered or [])
        if not committed and keep_last is not None:
            try:
                removed = steps.retain(root, keep_last, step_value, job)
                if removed:
                    log.info("checkpoint retention", removed=[d.name for d in removed])
            except Exception as exc:
                committed = f"committed, then retention failed: {type(exc).__name__}: {exc}"
    committed = _dist.broadcast(committed)
    if committed:
        raise CheckpointError(f"committing {directory} failed: {committed}")
    log.info("checkpoint saved", path=str(directory), step=step_value,
             seconds=round(time.perf_counter() - started, 3))
    return directory


def _gather_optimizer_json(own: tuple[list[Any], dict[str, Any]] | None, refused: str
                           ) -> tuple[list[Any], dict[str, Any]] | None:
    """Every rank's optimizer parameter groups and non-tensor state as one, on rank 0
    (None elsewhere, and without an optimizer); raises on every rank if any refused.

    Ranks that hold different parameters (pipeline stages) have groups over different
    parameter names, so rank 0's alone would leave the other stages' parameters without
    their hyperparameters. A rank sends its groups only if no lower rank has the same
    (data-parallel peers do), so rank 0 receives one copy per distinct layout.
    """
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(own, sort_keys=True).encode()).hexdigest() \
        if own is not None else ""
    answers = _dist.gather((refused, digest))
    problems = list(dict.fromkeys(p for p, _ in answers if p))
    if problems:
        raise CheckpointError("; ".join(problems))
    first = [d for _, d in answers].index(digest)
    gathered = _dist.gather_to_root(own if first == _dist.rank() else None)
    if gathered is None or own is None:
        return None
    return (merge_param_groups([g[0] for g in gathered if g is not None]),
            {k: v for g in gathered if g is not None for k, v in g[1].items()})


def merge_param_groups(everyone: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The parameter groups of several ranks' optimizers as one list (state-dict form:
    ``params`` are parameter names). Groups at the same index with equal hyperparameters
    are one group over the union of their parameters; each name is listed once, in the
    first group that has it. Loading matches a rank's groups to these by parameter name,
    so any layout finds its parameters' hyperparameters."""
    import json

    merged: list[dict[str, Any]] = []
    by_key: dict[tuple[int, str], dict[str, Any]] = {}
    seen: set[str] = set()
    for groups in everyone:
        for index, group in enumerate(groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            key = (index, json.dumps(hyper, sort_keys=True))
            new = [p for p in group.get("params", []) if p not in seen]
            seen.update(new)
            target = by_key.get(key)
            if target is None and (new or not group.get("params")):
                target = by_key[key] = {**hyper, "params": []}
                merged.append(target)
            if target is not None:
                target["params"].extend(new)
    return merged


def _claim_step_dir(root: Path, step: int | None, job: Job) -> tuple[int, str, str]:
    """Rank 0: ``(step, job id, problem)``; the step directory is claimed for ``job``
    unless ``problem`` says why not."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if step is None:
            existing = steps.step_dirs(root)
            step = existing[-1][0] + 1 if existing else 0
        claims.claim_step(root / steps.step_name(step), job)
        return step, job.id, ""
    except CheckpointError as exc:
        return step or 0, "", str(exc)
    except (OSError, ValueError) as exc:
        if is_disk_full(exc):
            return step or 0, "", disk_full_message(root, f"claiming a step under {root}")
        return step or 0, "", f"cannot create the step directory under {root}: {exc}"


def _commit(root: Path, directory: Path, step: int, job: Job,
            gathered: list[dict[str, FileRecord]]) -> str:
    """Rank 0: write the commit marker with every rank's digest records, if the step
    directory is still this job's. Returns a problem, or ''."""
    files: dict[str, FileRecord] = {}
    for records in gathered:
        for name, record in records.items():
            if name in files and files[name] != record:
                return f"two ranks wrote {directory / name}"
            files[name] = record
    try:
        with claims.root_lock(root):
            problem = claims.still_ours(directory, job)
            if problem:
                return problem
            steps.commit(directory, step, Manifest(directory, files), job=job.id, run=job.run)
    except Exception as exc:
        if is_disk_full(exc):
            return disk_full_message(directory, f"committing {directory}")
        return f"{type(exc).__name__}: {exc}"
    return ""


def _discard_own(directory: Path, job: Job) -> None:
    """Rank 0, after a failed save that every rank has given up on: remove the step
    directory if it is still this job's claim (it can never be committed), so a full disk
    gets its space back."""
    try:
        with claims.root_lock(directory.parent):
            if directory.is_dir() and not claims.still_ours(directory, job) \
                    and not steps.is_committed(directory):
                claims.discard(directory)
    except Exception as exc:  # the save's own error is the one to report
        log.warning("could not remove the failed save's directory", path=str(directory),
                    error=str(exc))


# -- load ---------------------------------------------------------------------------------


# DCP's metadata grows with the number of stored chunks; anything this large is not it.
METADATA_LIMIT = 1 << 34
_UNREAD = object()


def read_metadata(directory: Path, manifest: Any = _UNREAD) -> Any:
    """DCP's metadata of a checkpoint directory, checked against the commit record's
    digest before it is unpickled (only the classes DCP metadata holds: see
    :mod:`~composer_par.checkpoint.dcp_metadata`) (``manifest``: the record,
    None for none; default: the directory's own), with every file it names inside the
    directory."""
    path = Path(directory) / steps.DCP_METADATA
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory}: not a DCP checkpoint (no .metadata)")
    if manifest is _UNREAD:
        manifest = steps.read_manifest(directory)
    raw = read_bounded(path, METADATA_LIMIT, what="DCP metadata file")
    if manifest is not None:
        manifest.check_bytes(steps.DCP_METADATA, raw)
    from torch.distributed.checkpoint.metadata import Metadata

    from composer_par.checkpoint import dcp_metadata

    metadata = dcp_metadata.loads(raw, path)
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise dcp_metadata.UnreadableMetadataError(
            f"{path}: not DCP metadata (a {type(metadata).__name__})")
    names = {getattr(info, "relative_path", None) for info in metadata.storage_data.values()}
    for name in sorted(names, key=str):
        contained(directory, name, what=str(path))  # type: ignore[arg-type]
    return metadata


def stored_specs(metadata: Any) -> dict[str, Spec]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: Spec(tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def held_nowhere(keys: list[str], held: Collection[str]) -> set[str]:
    """Those of ``keys`` (the same list on every rank) that no rank holds (``held``: this
    rank's): one all-reduce of a flag per key, however many ranks hold which parts."""
    if not _dist.active():
        return {k for k in keys if k not in held}
    import torch
    import torch.distributed as dist

    flags = torch.tensor([1 if k in held else 0 for k in keys], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {k for k, flag in zip(keys, flags.tolist(), strict=True) if not flag}


def check_keys(source: str, expected: Mapping[str, Spec], found: Mapping[str, Spec],
               prefixes: tuple[str, ...], *, strict: bool,
               unheld: Collection[str] | None = None) -> None:
    """Raise KeyMismatchError unless ``found`` (the checkpoint's keys under ``prefixes``)
    holds every ``expected`` key with a loadable shape and dtype (strict: and no others).
    ``unheld``: the found keys no rank's model has (default: those not ``expected``); the
    others belong to a part of the model another rank holds, and are not unexpected."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k.startswith(prefixes) and k not in expected
                  and (unheld is None or k in unheld)]
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
    missing_rng: str = "error",
    run: str | None = None,
) -> CheckpointInfo:
    """Load a committed checkpoint into ``model`` (and ``optimizer``) on any mesh and
    world size; every rank calls it. ``path`` is a step directory or a root: the newest
    committed step of ``run``, or of the run being resumed (see
    :mod:`~composer_par.checkpoint.runs`; a root holding several runs, none of them named,
    is refused naming each). Raises CheckpointError naming the directory and keys on
    mismatch. Later saves of this process into the same root continue the loaded run.

    ``strict=False`` tolerates checkpoint keys the model lacks (they are skipped and
    logged); keys the model needs are always required. RNG states (and ``generators``)
    are restored when the world size equals the saved one: then this rank's RNG file
    must be there and intact (checked, like everything else, before anything is read into
    the model). ``missing_rng="warn"`` loads without a missing or damaged one instead,
    with a warning that the resumed run will not be bit-exact (``rng_restored`` is
    False); the default, ``"error"``, raises naming the file.

    Gradients the model's parameters hold are dropped first: a load replaces the weights
    and training state they belong to.

    A step that retention (another job of the run saving with ``keep_last``) removes
    while it is being loaded from a root is reported as such and the newest remaining
    step is loaded instead.
    """
    if missing_rng not in ("error", "warn"):
        raise ValueError(f"missing_rng must be 'error' or 'warn'; got {missing_rng!r}")
    if run is not None:
        runs.check_run(run)
    removed: list[str] = []
    while True:
        directory, saved_by = resolve_run_for_all(path, run)
        try:
            with steps.reading(directory):
                info = _load_step(directory, model, optimizer, strict=strict,
                                  restore_random=restore_random, generators=generators,
                                  missing_rng=missing_rng)
        except CheckpointError as exc:  # load raises on every rank alike
            if not _removed_meanwhile(directory):
                raise
            if directory == Path(path):
                raise CheckpointError(
                    f"{directory} was removed by retention (a save of the run that wrote it, "
                    "with keep_last) while it was being loaded; load a newer step") from exc
            removed.append(directory.name)
            if len(removed) > _REMOVED_RETRIES:
                raise CheckpointError(
                    f"{path}: each step chosen was removed by retention while it was being "
                    f"loaded ({', '.join(removed)}): a job saving here with a small keep_last "
                    "deletes steps faster than they load; load a step directory, or keep "
                    "more steps") from exc
            log.warning("checkpoint step removed by retention while it was being loaded; "
                        "loading the newest remaining step", path=str(directory))
            continue
        if _dist.rank() == 0:
            runs.adopt(directory.parent, saved_by)
        return attrs.evolve(info, run=saved_by)


# How many steps removed by retention while being loaded one load moves past.
_REMOVED_RETRIES = 8


def _removed_meanwhile(directory: Path) -> bool:
    """Whether ``directory``, committed when it was chosen, is gone or being removed
    (retention deletes the marker first), decided by rank 0 for every rank."""
    gone = False
    if _dist.rank() == 0:
        gone = not directory.exists() or (steps.step_of(directory) is not None
                                          and not steps.is_committed(directory))
    return bool(_dist.broadcast(gone))


def _load_step(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               *, strict: bool, restore_random: bool,
               generators: Mapping[str, torch.Generator] | None,
               missing_rng: str) -> CheckpointInfo:
    """Every rank: load the committed step ``directory`` (see :func:`load`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank = _dist.rank()
    _drop_stale_gradients(model)
    msd, osd = _state_dicts(model, optimizer)
    state: dict[str, Any] = {MODEL: msd}
    saved_rng: SavedRng | None = None
    saved_optim: dict[str, Any] = {}
    has_rng = False
    unexpected: list[str] = []
    failure: CheckpointError | None = None
    expected: dict[str, Spec] = {}
    found: dict[str, Spec] = {}
    prefixes = (f"{MODEL}.",) + ((f"{OPTIM}.",) if osd is not None else ())
    # Everything that can be wrong with the files is found here, on every rank, before
    # anything is read into the model.
    try:
        manifest = steps.read_manifest(directory)
        info = steps.read_info(directory, manifest)
        extra = _saved_extra(directory / steps.INFO, info.get("extra"))
        metadata = read_metadata(directory, manifest)
        if osd is not None:
            tensors, _ = _split_optim_state(osd["state"])
            state[OPTIM] = {"state": tensors}
            if "optimizer" not in info:
                raise KeyMismatchError(str(directory), ["optimizer state (saved without one)"])
            saved_optim = _saved_optimizer(directory / steps.INFO, info["optimizer"], osd)
        expected = _flat_specs(msd, MODEL)
        if OPTIM in state:
            expected.update(_flat_specs(state[OPTIM]["state"], f"{OPTIM}.state"))
        found = stored_specs(metadata)
    except CheckpointError as exc:
        failure = exc
    _agree_or_raise(failure, f"loading {directory}")
    # A rank that holds part of the model (a pipeline stage) lacks the keys of the
    # others: a key is unexpected only when no rank's model has it.
    unheld = held_nowhere(sorted(k for k in found if k.startswith(prefixes)), expected)
    try:
        unexpected = [k for k in found if k in unheld]
        check_keys(str(directory), expected, found, prefixes, strict=strict, unheld=unheld)
        saved_world = int(info.get("world_size", 0) or 0)
        has_rng = os.path.lexists(rank_file(directory, rank))
        if restore_random and saved_world == _dist.world_size() \
                and _saved_rng(info, manifest):
            saved_rng = _read_rng(directory, rank, manifest, generators, missing_rng)
    except CheckpointError as exc:
        failure = exc
    _agree_or_raise(failure, f"loading {directory}")
    if unexpected:
        log.warning("checkpoint keys not loaded", path=str(directory), count=len(unexpected),
                    first=unexpected[:5])
    with verifying_reader(directory, metadata, manifest, collective=_dist.active()) as reader, \
            dcp_errors(f"loading {directory}"):
        # Strided (packed) tensors are described as their boxes (see checkpoint.strided).
        dcp.load(for_dcp(state), storage_reader=reader, no_dist=not _dist.active())
    optim_state = None
    if osd is not None:
        full_state: dict[str, dict[str, Any]] = {
            fqn: dict(entry) for fqn, entry in state[OPTIM]["state"].items()}
        for fqn, values in saved_optim["state"].items():
            full_state.setdefault(fqn, {}).update(values)
        optim_state = {"state": full_state, "param_groups": saved_optim["param_groups"]}
    with dcp_errors(f"setting the state loaded from {directory}"):
        if optimizer is not None and optim_state is not None:
            set_state_dict(model, optimizer, model_state_dict=msd,
                           optim_state_dict=optim_state)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, msd)
    if saved_rng is not None:
        saved_rng.restore()
    elif restore_random and has_rng and saved_world != _dist.world_size():
        log.warning("random state not restored: saved on another world size",
                    saved_world_size=saved_world, world_size=_dist.world_size())
    step = info.get("step", steps.step_of(directory))
    return CheckpointInfo(directory, int(step or 0), extra, info.get("plan"), saved_world,
                          saved_rng is not None)


def _drop_stale_gradients(model: nn.Module) -> None:
    """Before a load: drop the gradients the model's parameters hold. They belong to the
    weights the load replaces (a step that failed midway leaves them), so a backward
    after the load must not add to them; and torch's ``get_state_dict`` builds a fresh
    optimizer's state (one step with zero gradients) only when no parameter has a
    gradient: with them left, every saved optimizer key would be reported unexpected."""
    for param in model.parameters():
        param.grad = None


def _saved_optimizer(path: Path, saved: Mapping[str, Any], osd: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """The optimizer's parameter groups and non-tensor state as saved in the info file
    ``path``, rebuilt from JSON and checked against this rank's optimizer (every group
    lists its parameters by name, and each of this rank's parameters is in one), so that
    a bad field is an error naming the file before anything is read into the model."""
    where = f"{path}: field optimizer"
    try:
        groups = _from_json(saved["param_groups"])
        scalars: dict[str, dict[str, Any]] = {}
        for joined, value in saved.get("scalars", {}).items():
            fqn, _, key = str(joined).partition("\x00")
            scalars.setdefault(fqn, {})[key] = _from_json(value)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError,
            OverflowError) as exc:
        raise CorruptFileError(f"{where}: cannot be read back ({type(exc).__name__}: {exc})") \
            from None
    for index, group in enumerate(groups):
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise CorruptFileError(f"{where}: param_groups[{index}].params must be a list of "
                                   f"parameter names; found {type(params).__name__}")
    group_of = {p: group for group in groups for p in group["params"]}
    for index, own in enumerate(osd.get("param_groups", [])):
        absent = [p for p in own.get("params", []) if p not in group_of]
        if absent:
            # The model has parameters the saved optimizer never held (a deeper model, a
            # pipeline stage with more blocks): a key mismatch, not a damaged file.
            raise KeyMismatchError(where, [f"{OPTIM}.param_groups: {p}" for p in absent])
        # torch gives a group the settings of one saved group: a group whose parameters
        # were saved in several would silently take one group's lr and weight decay.
        first_in_group: dict[str, str] = {}
        for param in own.get("params", []):
            settings = {k: v for k, v in group_of[param].items() if k != "params"}
            first_in_group.setdefault(repr(sorted(settings.items())), param)
        if len(first_in_group) > 1:
            one, other = list(first_in_group.values())[:2]
            raise KeyMismatchError(where, mismatched=[(
                f"{OPTIM}.param_groups[{index}]",
                "its parameters in one group",
                f"them in {len(first_in_group)} groups with their own settings ({one} in "
                f"one, {other} in another): build the optimizer with the parameter groups "
                "it was saved with")])
        for param in own.get("params", [])[:1]:
            _check_hyperparameters(where, own, group_of[param])
    return {"param_groups": groups, "state": scalars}


def _check_hyperparameters(where: str, own: Mapping[str, Any], saved: Mapping[str, Any]
                           ) -> None:
    """A saved group's number and flag hyperparameters are numbers and flags, as the
    optimizer's own are (a string learning rate would fail only at the next step)."""
    import torch

    def number(v: Any) -> bool:
        return isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool)

    for key, mine in own.items():
        if key == "params" or key not in saved:
            continue
        value = saved[key]
        if (isinstance(mine, bool) and not isinstance(value, bool)) or \
                (number(mine) and not number(value)):
            raise CorruptFileError(f"{where}: hyperparameter {key} must be a "
                                   f"{'flag' if isinstance(mine, bool) else 'number'}, as "
                                   f"the optimizer's is; found {value!r}")


def _saved_rng(info: Mapping[str, Any], manifest: Manifest | None) -> bool:
    """Whether the save wrote random states (every save does; a conversion from
    safetensors does not): the commit record lists them, or without one, the info says
    it was saved, not converted."""
    if manifest is not None:
        return any(name.startswith(f"{RNG_DIRECTORY}/") for name in manifest.files)
    return bool(info) and "converted_from" not in info


def _read_rng(directory: Path, rank: int, manifest: Manifest | None,
              generators: Mapping[str, torch.Generator] | None, missing_rng: str
              ) -> SavedRng | None:
    """This rank's saved random states, checked against the commit record; a missing or
    damaged file raises (``missing_rng="error"``) or warns and gives None."""
    try:
        if manifest is not None:
            manifest.verify_file(rank_file(directory, rank).relative_to(directory).as_posix())
        return read_rng(directory, rank, generators)
    except CheckpointError as exc:
        if missing_rng == "error":
            raise CheckpointError(f"{exc}; the random state cannot be restored (load with "
                                  "missing_rng='warn' to resume without it, not bit-exact)") \
                from exc
        message = (f"random state NOT restored: {exc}; the resumed run will not be "
                   "bit-exact (its random streams start afresh)")
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return None


_ERRORS: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (CheckpointError, CorruptFileError, UncommittedError)}


def resolve_for_all(path: str | os.PathLike[str]) -> Path:
    """The step directory ``path`` means, decided by rank 0 for every rank (a save
    committing meanwhile must not make ranks load different steps)."""
    return resolve_run_for_all(path)[0]


def resolve_run_for_all(path: str | os.PathLike[str], run: str | None = None
                        ) -> tuple[Path, str | None]:
    """``(step directory, the run that saved it)`` ``path`` means (see
    :func:`steps.resolve`), decided by rank 0 for every rank."""
    answer: tuple[str, str | None, str, str] = ("", None, "", "")
    if _dist.rank() == 0:
        try:
            directory = steps.resolve(path, run)
            saved_by = runs.run_of(directory)[1] if steps.is_committed(directory) else None
            answer = (str(directory), saved_by, "", "")
        except (CheckpointError, ValueError) as exc:  # ValueError: a bad run id
            answer = ("", None, type(exc).__name__, str(exc))
    directory_text, saved_by, kind, message = _dist.broadcast(answer)
    if message:
        raise _ERRORS.get(kind, CheckpointError)(message)
    return Path(directory_text), saved_by


def _agree_or_raise(failure: CheckpointError | None, what: str) -> None:
    """Raise on every rank if the checks failed on any: a rank whose checks failed raises
    its own error, the others an error quoting every failing rank's."""
    messages = _dist.gather(str(failure) if failure is not None else "")
    if failure is not None:
        raise failure
    failed = [(r, m) for r, m in enumerate(messages) if m]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(f"rank {r}: {m}" for r, m in failed))
