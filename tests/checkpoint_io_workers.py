"""Rank-side functions of tests/test_checkpoint*.py (module level: ranks import them by name).

(``tests/checkpoint_workers.py`` belongs to the activation checkpointing tests.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

#: name -> (world size, mesh, plugins other than the materializer). The resharding grid
#: saves with each and loads into each other.
LAYOUTS: dict[str, tuple[int, dict[str, int], tuple[str, ...]]] = {
    "fsdp2_4": (4, {"dp_shard": 4}, ("fsdp2",)),
    "hsdp_2x2": (4, {"dp_replicate": 2, "dp_shard": 2}, ("hsdp", "fsdp2")),
    "fsdp2_tp_2x2": (4, {"dp_shard": 2, "tp": 2}, ("tp", "fsdp2")),
    "tp_2": (2, {"tp": 2}, ("tp",)),
    "one_process": (1, {}, ()),
}


def plugin(name: str) -> Any:
    from composer_par.plugin.registry import Registry

    return Registry().get(name)()


def make_plan(layout: str, materializer: Any) -> Any:
    from composer_par import MeshSpec, ParallelPlan

    _, mesh, names = LAYOUTS[layout]
    plan = ParallelPlan(MeshSpec(**mesh))
    for name in names:
        plan.use(plugin(name))
    return plan.use(materializer)


def build(layout: str, materializer: Any, task: Any = None) -> tuple[Any, Any]:
    import torch

    from composer_par.testing.tasks import llama

    task = task or llama
    plan = make_plan(layout, materializer)
    with torch.device("meta"):
        model = task.build()
    return plan, plan.apply(model)


def train(plan: Any, model: Any, optimizer: Any, steps: range, task: Any = None) -> None:
    from composer_par.testing.tasks import llama

    task = task or llama
    index, count = plan.data_shard()
    for step in steps:
        loss = task.loss(model, task.batch(step).chunk(count)[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: Any, optimizer: Any | None) -> dict[str, Any]:
    """Every full tensor of the model and optimizer state, this rank's view (a collective).

    Every rank returns its own: a tensor Replicate over a mesh dim (TP's norms, HSDP's
    dp_replicate) is this rank's copy, which rank 0's view does not hold. (``cpu_offload``
    would keep the full tensors on rank 0 alone.)"""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        msd, osd = get_model_state_dict(model, options=options), None
    else:
        msd, osd = get_state_dict(model, optimizer, options=options)
    out: dict[str, Any] = {f"model.{k}": v.clone() for k, v in msd.items()}
    if osd is not None:
        for fqn, entry in osd["state"].items():
            for key, value in entry.items():
                out[f"optim.{fqn}.{key}"] = value.clone() if isinstance(value, torch.Tensor) \
                    else value
        out["optim.param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                     for g in osd["param_groups"]]
    return out


def _adamw(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


# -- resharding grid ----------------------------------------------------------------------


def save_layouts(layouts: list[str], root: str) -> dict[str, Any]:
    """Train each layout 2 steps from one seed and save it to ``root/<layout>``; every
    rank returns its view of the full state each saved."""
    from composer_par import MetaInit
    from composer_par.checkpoint import save

    saved = {}
    for layout in layouts:
        plan, model = build(layout, MetaInit(seed=11))
        optimizer = _adamw(model)
        train(plan, model, optimizer, range(2))
        save(Path(root) / layout, model, optimizer, extra={"layout": layout}, step=2,
             plan=plan)
        saved[layout] = full_state(model, optimizer)
    return saved


def load_layouts(pairs: list[tuple[str, str]], root: str) -> dict[str, Any]:
    """For each ``(saved layout, load layout)``: a fresh model of the load layout (another
    seed, a fresh optimizer) loads ``root/<saved>``; every rank returns its view of the
    full state."""
    from composer_par import MetaInit
    from composer_par.checkpoint import load

    loaded = {}
    for saved, layout in pairs:
        _, model = build(layout, MetaInit(seed=99))
        optimizer = _adamw(model)
        info = load(Path(root) / saved, model, optimizer)
        state = full_state(model, optimizer)
        state["info.extra"] = info.extra
        state["info.step"] = info.step
        loaded[f"{saved}->{layout}"] = state
    return loaded


# -- resume parity ------------------------------------------------------------------------


def train_save_continue(root: str, layout: str) -> dict[str, Any]:
    """2 steps, save, then one more step: the uninterrupted run (3 steps)."""
    import torch

    from composer_par import MetaInit
    from composer_par.checkpoint import save

    torch.manual_seed(1000 + int(os.environ["RANK"]))  # each rank its own stream
    plan, model = build(layout, MetaInit(seed=5))
    optimizer = _adamw(model)
    data = torch.Generator().manual_seed(1234 + int(os.environ["RANK"]))
    train(plan, model, optimizer, range(2))
    torch.rand(4)  # the stream moves between steps; the checkpoint must keep its place
    save(root, model, optimizer, step=2, plan=plan, generators={"data": data})
    after_save = {"torch": torch.rand(4), "data": torch.rand(4, generator=data)}
    train(plan, model, optimizer, range(2, 3))
    return {"draws": after_save, "state": full_state(model, optimizer)}


def load_continue(root: str, layout: str) -> dict[str, Any]:
    """A fresh process group: build (another seed), load the latest, one step."""
    import torch

    from composer_par import MetaInit
    from composer_par.checkpoint import load

    plan, model = build(layout, MetaInit(seed=77))
    optimizer = _adamw(model)
    data = torch.Generator().manual_seed(0)
    torch.rand(100)  # a different place in the stream until the load restores it
    info = load(root, model, optimizer, generators={"data": data})
    draws = {"torch": torch.rand(4), "data": torch.rand(4, generator=data)}
    train(plan, model, optimizer, range(info.step, info.step + 1))
    return {"draws": draws, "state": full_state(model, optimizer), "step": info.step,
            "rng_restored": info.rng_restored}


# -- crash safety -------------------------------------------------------------------------


def save_then_die(root: str, victim: int) -> None:
    """Save step 1; then, during the save of step 2, SIGKILL rank ``victim`` right after it
    wrote its shard (before DCP's metadata and the commit)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from composer_par import MetaInit
    from composer_par.checkpoint import save

    plan, model = build("fsdp2_4" if dist.get_world_size() == 4 else "tp_2", MetaInit(seed=8))
    optimizer = _adamw(model)
    train(plan, model, optimizer, range(1))
    save(root, model, optimizer, step=1, plan=plan)
    train(plan, model, optimizer, range(1, 2))
    original = FileSystemWriter.write_data

    def write_then_die(self: Any, plan_: Any, planner: Any) -> Any:
        result = original(self, plan_, planner)
        if dist.get_rank() == victim:
            result.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    save(root, model, optimizer, step=2, plan=plan)


def save_one(root: str, layout: str, step: int) -> dict[str, Any]:
    from composer_par import MetaInit
    from composer_par.checkpoint import save

    plan, model = build(layout, MetaInit(seed=8))
    optimizer = _adamw(model)
    train(plan, model, optimizer, range(step))
    save(root, model, optimizer, step=step, plan=plan)
    return full_state(model, optimizer)


def load_latest(root: str, layout: str) -> dict[str, Any]:
    from composer_par import MetaInit
    from composer_par.checkpoint import latest, load

    _, model = build(layout, MetaInit(seed=1))
    optimizer = _adamw(model)
    info = load(root, model, optimizer)
    state = full_state(model, optimizer)
    state["info.step"] = info.step
    state["info.latest"] = str(latest(root))
    return state


# -- Hugging Face safetensors -------------------------------------------------------------


def load_hf(path: str, layouts: list[str], export_root: str | None,
            rename: list[list[str]]) -> dict[str, Any]:
    """Materialize each layout from ``path`` with LoadSafetensors; every rank returns its
    view of the full parameters, and its buffers; with ``export_root``, export each to
    ``export_root/<layout>`` with the plan's names (split into several files)."""
    from composer_par import LoadSafetensors
    from composer_par.checkpoint import export_safetensors

    out = {}
    for layout in layouts:
        plan, model = build(layout, LoadSafetensors(path, rename=rename))
        state = full_state(model, None)
        if export_root is not None:
            export_safetensors(model, Path(export_root) / layout, plan=plan,
                               max_file_bytes=64 * 1024)
        out[layout] = state
        out[f"{layout}.buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    return out


def load_checkpoint_plugin(path: str, layout: str) -> dict[str, Any]:
    from composer_par import LoadCheckpoint

    _, model = build(layout, LoadCheckpoint(path))
    return full_state(model, None)


def export_one(layout: str, directory: str, dtype: str | None) -> dict[str, Any]:
    from composer_par import MetaInit
    from composer_par.checkpoint import export_safetensors

    _, model = build(layout, MetaInit(seed=4))
    export_safetensors(model, directory, dtype=dtype)
    return full_state(model, None)


# -- exclusive saves ----------------------------------------------------------------------


def _wait_for_peer(sync: Path, trial: int, me: str, peer: str, timeout: float = 120.0) -> None:
    """A barrier between two independent jobs (rank 0 of each), through files."""
    import time

    (sync / f"{trial}.{me}").touch()
    deadline = time.monotonic() + timeout
    while not (sync / f"{trial}.{peer}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {peer} never reached trial {trial}")
        time.sleep(0.0005)


def concurrent_saves(root: str, sync: str, me: str, peer: str, trials: int,
                     seed: int) -> dict[str, Any] | None:
    """One job of two that save into one root at the same explicit steps at the same
    moment. Rank 0 returns its job id and, per trial, the outcome ("ok" or the error)
    and the full model state it tried to save."""
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.checkpoint import CheckpointError, claims, save
    from composer_par.testing.tasks import llama

    plan = ParallelPlan(MeshSpec(dp_shard=dist.get_world_size())).use(FSDP2()).use(
        MetaInit(seed=seed))
    with torch.device("meta"):
        model = llama.build()
    model = plan.apply(model)
    outcomes = []
    for trial in range(trials):
        with torch.no_grad():  # each trial's weights differ from every other's
            for p in model.parameters():
                p.add_(0.001 * (trial + 1))
        if dist.get_rank() == 0:
            _wait_for_peer(Path(sync), trial, me, peer)
        dist.barrier()
        try:
            save(root, model, step=trial)
            outcome = "ok"
        except CheckpointError as exc:
            outcome = str(exc)
        outcomes.append((outcome, full_state(model, None)))
    if dist.get_rank() != 0:
        return None
    return {"job": claims.job_id(), "outcomes": outcomes}


def one_rank_fails_saving(root: str, bad_rank: int) -> str:
    """Every rank saves; ``bad_rank`` passes a generator that is not one (its RNG file
    cannot be written). Each rank returns the error it got."""
    import torch.distributed as dist

    from composer_par import MetaInit
    from composer_par.checkpoint import CheckpointError, save

    _, model = build("tp_2", MetaInit(seed=2))
    generators: Any = {"data": object()} if dist.get_rank() == bad_rank else None
    try:
        save(root, model, step=1, generators=generators)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def save_and_load_verified(root: str, layout: str) -> dict[str, Any]:
    """Save ``layout`` (model and optimizer), load it back on the same ranks; every rank
    returns its view of both full states."""
    from composer_par import MetaInit
    from composer_par.checkpoint import load, save

    plan, model = build(layout, MetaInit(seed=8))
    optimizer = _adamw(model)
    train(plan, model, optimizer, range(1))
    save(root, model, optimizer, step=1, plan=plan)
    saved = full_state(model, optimizer)
    _, fresh = build(layout, MetaInit(seed=9))
    fresh_optimizer = _adamw(fresh)
    load(root, fresh, fresh_optimizer)
    return {"saved": saved, "loaded": full_state(fresh, fresh_optimizer)}


def load_expecting_error(path: str, layout: str, checkpoint_plugin: bool) -> str:
    """Load ``path`` (with ``load``, or through the LoadCheckpoint plugin) and return the
    error every rank gets."""
    from composer_par import LoadCheckpoint, MetaInit
    from composer_par.checkpoint import CheckpointError, load
    from composer_par.findings import PlanError

    try:
        if checkpoint_plugin:
            build(layout, LoadCheckpoint(path))
        else:
            _, model = build(layout, MetaInit(seed=9))
            optimizer = _adamw(model)
            load(path, model, optimizer)
    except (CheckpointError, PlanError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def export_expecting_error(directory: str) -> str:
    """Export the TP 2 model into ``directory``; every rank returns the error it got."""
    from composer_par import MetaInit
    from composer_par.checkpoint import CheckpointError, export_safetensors

    _, model = build("tp_2", MetaInit(seed=4))
    try:
        export_safetensors(model, directory)
    except CheckpointError as exc:
        return str(exc)
    return "exported"
