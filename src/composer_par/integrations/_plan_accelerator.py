"""The accelerator of :mod:`composer_par.integrations.accelerate`: ``accelerate.Accelerator``
running a plan. This module imports accelerate; ``composer_par.integrations.accelerate``
imports it when ``PlanAccelerator`` is first asked for, so that the adapter's module (and
``import composer_par``) needs no accelerate installed."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import accelerate
import accelerate.data_loader
import torch
from accelerate.utils import DistributedType, recursively_apply
from torch import nn
from torch.distributed.tensor import DTensor

from composer_par import checkpoint, replicas, training
from composer_par.findings import Finding
from composer_par.gradient_sync import DeferredSync
from composer_par.integrations.accelerate import (
    TRAINER,
    accelerate_findings,
    parallelism_config,
    plan_findings,
)
from composer_par.integrations.errors import refuse_errors

if TYPE_CHECKING:
    from composer_par.checkpoint import CheckpointInfo
    from composer_par.plan import ParallelPlan


def world_size() -> int:
    """The default process group's size, or ``WORLD_SIZE`` before there is one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def on_cpu(plan: ParallelPlan) -> bool:
    """The plan runs on CPU (gloo): no CUDA here, or its device says cpu."""
    return not torch.cuda.is_available() or str(plan.device or "").startswith("cpu")


def plan_mesh(plan: ParallelPlan, world: int) -> Any:
    """The plan's DeviceMesh, built once here when the plan has none, so that the plan's
    apply, accelerate's config and every collective share one set of process groups."""
    return plan.device_mesh(world, "cpu" if on_cpu(plan) else "cuda")


class PlanAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` running ``plan`` (see the module). ``kwargs`` are the
    Accelerator's own; those that overlap the plan raise
    :class:`~composer_par.integrations.errors.IntegrationError` before anything is
    built. ``cpu`` defaults to True when the plan runs on CPU (gloo). ``gradient_sync``
    is the policy of :mod:`composer_par.gradient_sync` under which the backwards of
    ``no_sync`` defer the plan's reductions. The replica check
    (:mod:`composer_par.replicas`) runs before every ``check_replicas_every``-th step of
    each prepared optimizer (the first included; ``None`` opts out)."""

    def __init__(self, plan: ParallelPlan, *, gradient_sync: str = "last",
                 check_replicas_every: int | None = replicas.EVERY, **kwargs: Any) -> None:
        deferred_sync = DeferredSync(gradient_sync)
        check_every = replicas.check_every(check_replicas_every)
        world = world_size()
        refuse_errors(TRAINER, plan_findings(plan, world, TRAINER)
                      + accelerate_findings(plan, kwargs))
        if "cpu" not in kwargs and on_cpu(plan):
            kwargs["cpu"] = True
        super().__init__(**kwargs)
        self.plan = plan
        self._deferred_sync = deferred_sync
        self._plan_checks(world)
        mesh = plan_mesh(plan, world)
        config = parallelism_config(plan, world, mesh)
        self.state.parallelism_config = config
        self.state.device_mesh = mesh
        self._plan_models: list[nn.Module] = []
        self._check_every = check_every
        self._guarded: list[Any] = []

    def _plan_checks(self, world: int) -> None:
        """What accelerate's state says once built (a launch configuration, an earlier
        Accelerator in this process): refused the same way."""
        findings = []
        if self.num_processes != world:
            findings.append(Finding(
                "CP711", f"accelerate sees {self.num_processes} process(es) and the process "
                f"group has {world} ranks ({self.distributed_type})", plugin=TRAINER,
                fix="on CPU give Accelerator cpu=True (Trainer: use_cpu=True) so accelerate "
                "uses the gloo group; launch with torchrun or accelerate launch"))
        kind = self.distributed_type
        if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                    DistributedType.MEGATRON_LM):
            findings.append(Finding(
                "CP714", f"accelerate's state is {kind}: it would shard or wrap the model "
                "the plan shards", plugin=TRAINER,
                fix="launch without accelerate's FSDP / DeepSpeed / Megatron-LM config"))
        refuse_errors(TRAINER, findings)

    # -- the model -------------------------------------------------------------------------

    def apply(self, model: nn.Module) -> nn.Module:
        """``plan.apply(model)`` on the accelerator's mesh; the model ``prepare`` takes."""
        applied = self.plan.apply(model)
        self._plan_models.append(applied)
        return applied

    def _adopt(self, model: nn.Module) -> None:
        if any(model is m for m in self._plan_models):
            return
        plan_made = bool(self.plan.applied) and (
            any(isinstance(p, DTensor) for p in model.parameters())
            or any(model is m for m in self.plan.data_parallel_modules))
        if not plan_made:
            raise ValueError(
                f"accelerator.prepare got a {type(model).__name__} the plan has not applied: "
                "apply it first (accelerator, model = prepare_accelerator(plan, model), or "
                "model = accelerator.apply(model)), then build the optimizer on "
                "model.parameters()")
        self._plan_models.append(model)

    def _check_optimizer(self, optimizer: Any, models: Iterable[nn.Module]) -> None:
        own = {id(p) for m in models for p in m.parameters()}
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            for param in group["params"]:
                if id(param) not in own:
                    raise ValueError(
                        f"{type(inner).__name__} holds a parameter of shape "
                        f"{tuple(param.shape)} that is no parameter of the plan's model: build "
                        "the optimizer after applying the plan, on model.parameters()")

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """accelerate's ``prepare`` for a plan: models are adopted unchanged, optimizers
        and schedulers wrapped as accelerate wraps them, data loaders sharded by the
        plan. Returns the objects in the same order (one object alone, as accelerate)."""
        if device_placement is None:
            device_placement = [None for _ in args]  # type: ignore[misc]
        elif len(device_placement) != len(args):
            raise ValueError(f"device_placement should be a list with {len(args)} elements "
                             "(the number of objects passed)")
        models = [obj for obj in args if isinstance(obj, nn.Module)]
        for model in models:
            self._adopt(model)
            # accelerate's prepare_model returns a model so marked as it is: no wrapper,
            # no move, no cast.
            model._is_accelerate_prepared = True  # type: ignore[assignment]
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                self._check_optimizer(obj, models or self._plan_models)
                # Plugins refresh what they derive from the parameters (float8's scales).
                training.tell_plugins_after_steps(self.plan, models or self._plan_models, obj)
                self._guard(obj)
        result = tuple(self._prepare_one(obj, first_pass=True, device_placement=d)
                       for obj, d in zip(args, device_placement, strict=True))
        result = tuple(self._prepare_one(obj, device_placement=d)
                       for obj, d in zip(result, device_placement, strict=True))
        for item in result:
            if any(item in container for container in (
                    self._dataloaders, self._models, self._optimizers, self._schedulers)):
                item._is_accelerate_prepared = True
        return result if len(result) > 1 else result[0]

    def _guard(self, optimizer: Any) -> None:
        """The replica check before every ``check_replicas_every``-th step of
        ``optimizer`` (the first included), over the plan's models."""
        if self._check_every is None or any(optimizer is o for o in self._guarded):
            return
        replicas.guard_optimizer(optimizer, self._plan_models, every=self._check_every)
        self._guarded.append(optimizer)

    # -- data --------------------------------------------------------------------------------

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's sharded loader over the plan's data shards (``plan.data_shard()``):
        shard ``index`` of ``count`` gets every ``count``-th batch from the ``index``-th
        on (with ``split_batches``: the ``index``-th slice of each batch)."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        index, count = self.plan.data_shard(self.process_index, self.num_processes)
        prepared = accelerate.data_loader.prepare_data_loader(
            data_loader, self.device, num_processes=count, process_index=index,
            split_batches=self.split_batches, put_on_device=device_placement,
            rng_types=self.rng_types.copy(), dispatch_batches=False,
            even_batches=self.even_batches, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader, torch_device_mesh=None)
        self._dataloaders.append(prepared)
        return prepared

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's ``gather_for_metrics`` over the plan's data shards: each shard's
        samples once, in shard order, the padding of the last batch dropped.

        Ranks that differ only in a model-parallel mesh dim read the same samples (the
        loaders are sharded by ``plan.data_shard()``), so a gather over every process
        would return each sample once per such rank; the first rank of each shard
        stands for it. The last batch's padding is cut as accelerate cuts it, by the
        remainder the shard-wise loader counted."""
        world = self.num_processes
        ranks = self._shard_ranks
        if len(ranks) == world:  # every rank a shard of its own: accelerate's split
            return super().gather_for_metrics(input_data, use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        if use_gather_object or not all_tensors:
            # As accelerate's gather_object: each rank gives a list, the lists joined.
            gathered: list[Any] = [None] * world
            torch.distributed.all_gather_object(gathered, input_data)
            data: Any = [item for rank in ranks for item in gathered[rank]]
            return self._drop_padding(data, objects=True)
        # accelerate's gather: every rank's tensor (one element for a scalar), of one
        # size on every rank, joined along the first tensor dim in rank order.
        whole = self.gather(input_data)

        def shard_copies(tensor: torch.Tensor) -> torch.Tensor:
            size = tensor.shape[0] // world
            return torch.cat([tensor[rank * size:(rank + 1) * size] for rank in ranks])

        data = recursively_apply(shard_copies, whole)
        return self._drop_padding(data, objects=False)

    @functools.cached_property
    def _shard_ranks(self) -> list[int]:
        """The first rank of each data shard, in shard order: worked out once (the
        plan and the process count do not change once the accelerator is made), not
        at every batch an evaluation gathers."""
        world = self.num_processes
        first: dict[int, int] = {}
        for rank in range(world):
            first.setdefault(self.plan.data_shard(rank, world)[0], rank)
        return [first[index] for index in range(len(first))]

    def _drop_padding(self, data: Any, *, objects: bool) -> Any:
        """At the end of a loader, the samples past the dataset's end (padding
        accelerate added to even the last batch out over the shards) are cut."""
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data  # mid-loader, no padding, or a loader without a length
        remainder = state.remainder
        if objects:
            return data[:remainder]
        return recursively_apply(lambda t: t[:remainder], data)

    # -- gradients ---------------------------------------------------------------------------

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """The backwards of a microbatch before the last of an accumulation (what
        ``accumulate()`` and the Hugging Face Trainer enter): the plan's FSDP2 units
        defer their reduce-scatters (and HSDP all-reduces) under ``gradient_sync``.
        accelerate's own would look for DDP's ``no_sync`` and, finding none, reduce."""
        with self._deferred_sync.defer(model):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """One norm over every gradient on any mesh (composer_par.training.clip_grad_norm_)."""
        self.unscale_gradients()
        return training.clip_grad_norm_(list(parameters), max_norm, norm_type)

    # -- checkpoints -------------------------------------------------------------------------

    def _one_model_and_optimizer(self) -> tuple[nn.Module, Any]:
        if len(self._models) != 1 or len(self._optimizers) > 1:
            raise ValueError(
                f"save_state / load_state of a plan keep one model and at most one optimizer; "
                f"this accelerator prepared {len(self._models)} model(s) and "
                f"{len(self._optimizers)} optimizer(s): save each with "
                "composer_par.checkpoint.save(path, model, optimizer)")
        optimizer = self._optimizers[0].optimizer if self._optimizers else None
        return self._models[0], optimizer

    def _checkpoint_root(self, directory: str | os.PathLike[str] | None) -> Path:
        if directory is None:
            raise ValueError(
                "save_state / load_state of a plan need a directory: composer_par numbers "
                "the steps inside it (step-NNNNNNNNN), in place of accelerate's "
                "automatic_checkpoint_naming")
        return Path(directory)

    def save_state(self, output_dir: str | os.PathLike[str] | None = None,
                   safe_serialization: bool = True, **save_model_func_kwargs: Any) -> str:
        """Save the model and optimizer with :func:`composer_par.checkpoint.save` into
        ``output_dir/step-NNNNNNNNN`` (sharded, committed last), with accelerate's step,
        the schedulers' and registered objects' states (JSON) and every rank's RNG
        states. Returns the committed step directory. ``composer_par.checkpoint.load``
        reads it outside accelerate; ``load_state`` reads what ``checkpoint.save`` wrote."""
        model, optimizer = self._one_model_and_optimizer()
        extra = {"accelerate": {
            "step": self.step,
            "schedulers": [s.state_dict() for s in self._schedulers],
            "custom": [o.state_dict() for o in self._custom_objects],
        }}
        path = checkpoint.save(self._checkpoint_root(output_dir), model, optimizer, extra=extra,
                    plan=self.plan)
        self.project_configuration.iteration += 1
        return str(path)

    def load_state(self, input_dir: str | os.PathLike[str] | None = None,
                   load_kwargs: dict[str, Any] | None = None,
                   **load_model_func_kwargs: Any) -> CheckpointInfo:
        """Load a composer_par checkpoint (a step directory, or a root: its latest
        committed step) into the prepared model and optimizer; restore accelerate's step
        and the schedulers' and registered objects' states when it saved them."""
        model, optimizer = self._one_model_and_optimizer()
        info = checkpoint.load(self._checkpoint_root(input_dir), model, optimizer)
        saved = info.extra.get("accelerate") if isinstance(info.extra, dict) else None
        if saved:
            self.step = int(saved.get("step", 0))  # type: ignore[has-type]
            for scheduler, state in zip(self._schedulers, saved.get("schedulers", []),
                                        strict=False):
                scheduler.load_state_dict(state)
            for obj, state in zip(self._custom_objects, saved.get("custom", []),
                                  strict=False):
                obj.load_state_dict(state)
        return info
