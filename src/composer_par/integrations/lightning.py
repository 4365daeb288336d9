"""Run a plan inside Lightning: Fabric and the Trainer (extra ``composer-par[lightning]``).

    from composer_par.integrations.lightning import FabricStrategy, TrainerStrategy

    fabric = Fabric(strategy=FabricStrategy(plan), devices=4, accelerator="cpu")
    fabric.launch()
    model = fabric.setup_module(model)                    # plan.apply(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))

    trainer = Trainer(strategy=TrainerStrategy(plan), devices=4, accelerator="cpu")
    trainer.fit(lit_module)                                # the plan applies to lit_module.model

Both strategies subclass Lightning's ``ModelParallelStrategy`` and replace what it fixes:
the mesh is the plan's (any mesh dims, in the plan's order, built by ``MeshSpec.build``
with the plan's timeout) instead of ``data_parallel`` x ``tensor_parallel``; the
parallelize function is ``plan.apply``; the distributed sampler reads
``plan.data_shard()``; checkpoints are :mod:`composer_par.checkpoint` step directories, so
what ``fabric.save`` / ``trainer.save_checkpoint`` write, ``composer_par.checkpoint.load``
reads, and the other way round.

Settings of Lightning that would do part of the plan's job a second time are refused when
Lightning builds the strategy's launcher (inside ``Fabric(...)`` / ``Trainer(...)``), before
a process group, a mesh or a model is touched: findings CP701-CP707, raised as
:class:`~composer_par.integrations.errors.IntegrationError`. A pipeline plan runs in Fabric
through ``fabric.strategy.training_step(model, loss_fn)``; the Trainer refuses it (CP705).

This module imports no lightning: each strategy lives in a module of its own that does,
loaded when the strategy is first asked for, so ``import composer_par`` and this module
need no lightning installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer_par.findings import Finding
from composer_par.integrations.errors import refuse_errors
from composer_par.logging import get_logger
from composer_par.plugin import Stage

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from composer_par.integrations._fabric_strategy import FabricStrategy
    from composer_par.integrations._trainer_strategy import TrainerStrategy
    from composer_par.plan import ParallelPlan

log = get_logger(__name__)

FABRIC = "Lightning Fabric"
TRAINER = "Lightning Trainer"


# -- the checks, before anything is built -------------------------------------------------


def _mixed_precision_plugins(plan: ParallelPlan) -> list[str]:
    return [name for name, settings in plan.hooks.estimate_settings()
            if settings is not None and (settings.param_dtype or settings.reduce_dtype)]


def _data_parallel_size(plan: ParallelPlan, world: int) -> int:
    mesh = plan.mesh.resolve(world)
    return math.prod(mesh.size(name) for name in plan.data_parallel_dims())


def setup_findings(plan: ParallelPlan, *, precision: str, processes: int, nodes: int,
                   settings: Mapping[str, Any], trainer: str = FABRIC) -> list[Finding]:
    """Every reason ``trainer`` cannot run ``plan`` as set up: the Lightning settings the
    user gave (``settings``: strategy arguments, by name, only those given), the precision
    setting, and ``processes`` per node on ``nodes`` nodes. Pure: builds nothing."""
    findings: list[Finding] = []
    world = processes * nodes
    mixed = _mixed_precision_plugins(plan)
    if mixed and precision not in ("32-true", "32"):
        findings.append(Finding(
            "CP701", f"{trainer}'s precision={precision!r} overlaps the mixed precision "
            f"{' and '.join(mixed)} already applies (its param_dtype / reduce_dtype): the "
            "parameters would be cast twice", plugin=mixed[0],
            fix="keep one: precision=\"32-true\" in Lightning with the plan's "
            "mixed_precision, or drop mixed_precision from the plan"))
    if settings.get("parallelize_fn") is not None:
        findings.append(Finding(
            "CP702", f"{trainer} was given a parallelize_fn, but plan.apply is the "
            "parallelize function of a plan's strategy: the model would be parallelized "
            "twice", fix="drop parallelize_fn; put what it does into the plan's plugins"))
    if plan.mesh.check_world_size(world) is not None:
        findings.append(Finding(
            "CP704", f"{trainer} starts {processes} process(es) per node x {nodes} node(s) "
            f"= {world}, but the plan's mesh needs {plan.mesh.equation()}",
            fix="set devices and num_nodes so that devices x num_nodes is the plan's world "
            "size, or change the plan's mesh sizes"))
    else:
        dp = _data_parallel_size(plan, world)
        dims = " x ".join(plan.data_parallel_dims()) or "no mesh dim"
        for key, expected in (("data_parallel_size", dp), ("tensor_parallel_size", world // dp)):
            given = settings.get(key)
            if given is not None and given != "auto" and given != expected:
                findings.append(Finding(
                    "CP703", f"{trainer} was given {key}={given!r}, but the plan's mesh "
                    f"({plan.mesh.resolve(world).equation()}) makes it {expected} (data "
                    f"parallel over {dims})", fix=f"drop {key}: the plan's mesh is the "
                    "strategy's mesh"))
        findings += plan.validate(world_size=world).errors
    splitters = [plan.hooks.name_of(p) for p in plan.hooks.implementers(Stage.PIPELINE_SPLIT)]
    # Fabric leaves the loop to the user, who drives a pipeline through
    # fabric.strategy.training_step; the Trainer's loop is its own.
    if splitters and trainer != FABRIC:
        findings.append(Finding(
            "CP705", f"{' and '.join(splitters)} splits the model into pipeline stages, but "
            f"{trainer}'s loop calls the model's forward and then backward on a loss; a "
            "pipeline schedule must run both itself", plugin=splitters[0],
            fix="train a pipeline plan with Fabric (FabricStrategy(plan), the step through "
            "fabric.strategy.training_step(model, loss_fn)) or with plan.training_step in a "
            "loop of your own"))
    timeout = settings.get("timeout")
    if timeout is not None and _seconds(timeout) != plan.timeout.total_seconds():
        findings.append(Finding(
            "CP706", f"{trainer} was given timeout={timeout!r}, but the plan's timeout "
            f"({plan.timeout.total_seconds():g} s) bounds the process groups of its mesh",
            fix="drop timeout from the strategy and give the plan the timeout: "
            "ParallelPlan(mesh, timeout=...) or timeout in the plan file"))
    if settings.get("save_distributed_checkpoint") is False:
        findings.append(Finding(
            "CP706", f"{trainer} was given save_distributed_checkpoint=False (one full file "
            "gathered on rank 0), but a plan's strategy saves composer_par checkpoints: "
            "sharded step directories, committed, resharded on load",
            fix="drop save_distributed_checkpoint; export full weights with "
            "composer_par.checkpoint.export_safetensors if one file is wanted"))
    return findings


def _seconds(value: Any) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _parallelized(module: nn.Module) -> list[str]:
    """Names of the parts of ``module`` someone already parallelized."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    found = [name or "(root)" for name, sub in module.named_modules()
             if isinstance(sub, (FSDPModule, FullyShardedDataParallel))]
    found += [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    return found[:5]


def _refuse_parallelized(module: nn.Module, trainer: str, where: str) -> None:
    done = _parallelized(module)
    if done:
        refuse_errors(trainer, [Finding(
            "CP702", f"the model reached {trainer} already parallelized {where} "
            f"({', '.join(done)}): the plan would shard it a second time",
            fix="build the model plainly (under torch.device('meta') with MetaInit or a "
            "loader in the plan) and let the strategy apply the plan")])


# -- what both strategies share -----------------------------------------------------------


class _PlanMixin:
    """The plan's mesh, sampler and checks, over either Lightning base."""

    plan: ParallelPlan
    _given: dict[str, Any]
    _trainer_name: str
    _device_mesh: DeviceMesh | None

    def _check_settings(self, precision: Any) -> None:
        parallel_devices = getattr(self, "parallel_devices", None) or []
        findings = setup_findings(
            self.plan, precision=str(getattr(precision, "precision", "32-true")),
            processes=len(parallel_devices) or 1, nodes=int(getattr(self, "num_nodes", 1)),
            settings=self._given, trainer=self._trainer_name)
        report = refuse_errors(self._trainer_name, findings)
        for finding in report.warnings:
            log.warning("plan warning", code=finding.code, message=finding.message,
                        fix=finding.fix, plugin=finding.plugin)

    def _build_mesh(self, world: int, device: torch.device) -> DeviceMesh:
        """The plan's mesh on the live process group: the plan keeps it, so that apply
        shards over the very groups the strategy reports (no second set of groups)."""
        from composer_par.mesh import MeshError

        try:
            return self.plan.device_mesh(world, device.type)
        except MeshError as exc:
            refuse_errors(self._trainer_name, [Finding(
                "CP704", f"{exc} (the process group has {world})", fix="build the plan's "
                "mesh on the process group Lightning runs, or give the plan a MeshSpec")])
            raise  # refuse_errors raised already; this keeps type checkers informed

    def _sampler_kwargs(self, rank: int, world: int) -> dict[str, Any]:
        index, count = self.plan.data_shard(rank=rank, world_size=world)
        return {"num_replicas": count, "rank": index}


def _given(**settings: Any) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if v is not None}


# -- the strategies, in modules of their own ---------------------------------------------


def __getattr__(name: str) -> Any:
    # The strategies subclass Lightning's, so their modules import lightning (which imports
    # transformers): each module is loaded when its strategy is first asked for.
    if name == "FabricStrategy":
        from composer_par.integrations._fabric_strategy import FabricStrategy

        return FabricStrategy
    if name == "TrainerStrategy":
        from composer_par.integrations._trainer_strategy import TrainerStrategy

        return TrainerStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FabricStrategy", "TrainerStrategy", "setup_findings"]
