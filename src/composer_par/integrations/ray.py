"""Run a plan inside Ray Train's ``TorchTrainer`` workers (extra ``composer-par[ray]``).

    from composer_par.integrations.ray import plan_trainer, resume, save_checkpoint, worker_plan

    def train_loop(config):
        plan = worker_plan(config)                  # this worker's plan, allocation checked
        with torch.device("meta"):
            model = build_model()
        model = plan.apply(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        step = resume(model, optimizer)             # Ray's latest checkpoint after a restart
        index, count = plan.data_shard()            # this worker's data shard
        for step in range(step + 1, config["steps"] + 1):
            ...                                     # forward, backward, optimizer step
            if step % 100 == 0:
                save_checkpoint(model, optimizer, plan, step=step, metrics={"loss": loss})

    trainer = plan_trainer(plan, train_loop, config={"lr": 3e-4, "steps": 1000},
                           run_config=RunConfig(storage_path="/shared/runs", name="llama"))
    result = trainer.fit()

The plan decides the scaling: ``ScalingConfig(num_workers=nodes x devices per node)``
from its ``[topology]`` (or its mesh's world size on one node), and the process group's
timeout is the plan's. The plan reaches the workers as its TOML (Ray pickles what it
sends; a plan file is the plan's portable form), and each worker checks, before it
builds anything, the layout Ray placed it in (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``)
against the plan's topology (:mod:`composer_par.allocation`, CP306-CP308).

Checkpoints are the plan's own, registered with Ray's checkpoint API. Every worker writes
its shards with :func:`composer_par.checkpoint.save` into the Ray run's directory (which
must be a filesystem every worker mounts), the step is committed once all have written,
and rank 0 then reports that committed directory to ``ray.train.report`` without an
upload (``CheckpointUploadMode.NO_UPLOAD``). Why both: the plan's format is sharded
(each rank writes and later reads only its own bytes), committed last (a step a failed
save left is never loaded) and reshards onto another layout, which Ray's default upload
would not keep (it copies each worker's local directory into storage and merges them);
Ray's API keeps the bookkeeping: ``result.checkpoint``, ``ray.train.get_checkpoint()``
in workers restarted after a failure (:func:`resume` loads it), and retention by
``CheckpointConfig(num_to_keep=...)``, which deletes whole step directories (so the
plan's own ``keep_last`` is not used here).

This module imports ray only when a function is called; ``import composer_par`` never
imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from composer_par.plan import ParallelPlan

# The key under which the plan's TOML travels in train_loop_config.
PLAN_KEY = "composer_par_plan"
# The plan's checkpoints, under the Ray run's directory.
CHECKPOINT_DIR = "composer_par_checkpoints"


def scaling(plan: ParallelPlan) -> tuple[int, str]:
    """``(workers, what sized them)`` from the plan: its topology's world size, else its
    resolved mesh's on one node. ValueError when neither says."""
    if plan.topology is not None:
        return plan.topology.world_size, f"[topology] {plan.topology.describe()}"
    if plan.mesh.is_resolved:
        return plan.mesh.world_size, f"the mesh {plan.mesh.equation()} on one node"
    raise ValueError(
        f"the plan's mesh {plan.mesh.equation()} has a size of -1 and no [topology]: Ray "
        "needs a number of workers; add [topology] nodes and devices_per_node to the plan")


def plan_trainer(plan: ParallelPlan, train_loop: Callable[[dict[str, Any]], Any], *,
                 config: Mapping[str, Any] | None = None, use_gpu: bool = False,
                 resources_per_worker: Mapping[str, float] | None = None,
                 **trainer_kwargs: Any) -> Any:
    """A ``ray.train.torch.TorchTrainer`` running ``train_loop(config)`` on as many
    workers as the plan has ranks; ``config`` carries the plan for :func:`worker_plan`.
    ``trainer_kwargs`` go to TorchTrainer as given (``run_config``, ``datasets``, ...)."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    workers, _ = scaling(plan)
    for name in ("scaling_config", "torch_config", "train_loop_config"):
        if name in trainer_kwargs:
            raise TypeError(f"plan_trainer sets {name} from the plan; pass config= for the "
                            "loop's own settings, use_gpu= and resources_per_worker= for Ray")
    loop_config = {**(config or {}), PLAN_KEY: plan.to_toml()}
    return TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu,
            resources_per_worker=dict(resources_per_worker) if resources_per_worker else None),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo",
                                 timeout_s=max(1, round(plan.timeout.total_seconds()))),
        **trainer_kwargs,
    )


def worker_plan(config: Mapping[str, Any]) -> ParallelPlan:
    """Inside a worker: the plan :func:`plan_trainer` sent, after checking the layout Ray
    placed the workers in against the plan's topology (PlanError when it breaks the plan)."""
    from composer_par.plan import ParallelPlan

    if PLAN_KEY not in config:
        raise KeyError(f"{PLAN_KEY!r} is not in the loop's config: make the trainer with "
                       "composer_par.integrations.ray.plan_trainer")
    plan = ParallelPlan.from_toml(config[PLAN_KEY])
    plan.check_allocation()
    return plan


def _storage() -> tuple[Path, Any]:
    """The Ray run's directory as a path every worker writes to, and its filesystem."""
    import ray.train
    from pyarrow import fs

    storage = ray.train.get_context().get_storage()
    filesystem = storage.storage_filesystem
    if not isinstance(filesystem, fs.LocalFileSystem):
        raise ValueError(
            f"the run's storage ({type(filesystem).__name__}) is not a filesystem the "
            "workers mount: the plan's checkpoints are written in place by every rank; give "
            "RunConfig(storage_path=...) a directory shared by every node")
    return Path(storage.experiment_fs_path), filesystem


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    plan: ParallelPlan, *, step: int, metrics: Mapping[str, Any] | None = None,
                    extra: Any = None) -> Path:
    """Every worker calls it: the plan's checkpoint of ``step`` written and committed in
    the Ray run's directory, then reported to Ray with ``metrics`` (no upload: it is in
    place). Returns the committed step directory."""
    import ray.train

    from composer_par import checkpoint

    root, filesystem = _storage()
    context = ray.train.get_context()
    # The Ray run is the checkpoints' run: its restarts continue it.
    saved = checkpoint.save(root / CHECKPOINT_DIR, model, optimizer, extra, step=step,
                            plan=plan, run=context.get_experiment_name())
    reported = None
    if context.get_world_rank() == 0:
        reported = ray.train.Checkpoint(path=str(saved), filesystem=filesystem)
    ray.train.report(dict(metrics or {}), checkpoint=reported,
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
    return saved


def resume(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
           strict: bool = True) -> int:
    """Every worker calls it: load Ray's latest reported checkpoint into ``model`` (and
    ``optimizer``) on this plan's layout; the step it holds, or 0 when Ray has none."""
    import ray.train

    from composer_par import checkpoint

    found = ray.train.get_checkpoint()
    if found is None:
        return 0
    return checkpoint.load(found.path, model, optimizer, strict=strict).step


__all__ = ["CHECKPOINT_DIR", "PLAN_KEY", "plan_trainer", "resume", "save_checkpoint",
           "scaling", "worker_plan"]
