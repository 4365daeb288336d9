"""The strategy of :mod:`composer_par.integrations.lightning` for Lightning Fabric. This
module imports lightning's Fabric; ``composer_par.integrations.lightning`` imports it when
``FabricStrategy`` is first asked for, so that the adapter's module (and ``import
composer_par``) needs no lightning installed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from composer_par import checkpoint, replicas, training
from composer_par.gradient_sync import DeferredSync
from composer_par.integrations.lightning import (
    FABRIC,
    _given,
    _PlanMixin,
    _refuse_parallelized,
)
from composer_par.training import TrainingStep

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from composer_par.plan import ParallelPlan


def _split_state(state: Mapping[str, Any]) -> tuple[tuple[str, nn.Module], tuple[str, Any] | None,
                                                    dict[str, Any]]:
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    optimizers = [(k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1:
        raise ValueError(f"a plan's checkpoint holds one model; the state has "
                         f"{len(modules)} ({', '.join(k for k, _ in modules) or 'none'}): "
                         "pass {'model': model, 'optimizer': optimizer, ...}")
    if len(optimizers) > 1:
        raise ValueError(f"a plan's checkpoint holds at most one optimizer; the state has "
                         f"{', '.join(k for k, _ in optimizers)}")
    rest = {k: v for k, v in state.items()
            if not isinstance(v, (nn.Module, torch.optim.Optimizer))}
    for key, value in rest.items():
        if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            rest[key] = value.state_dict()
    return modules[0], (optimizers[0] if optimizers else None), rest


class _ScheduledStep(TrainingStep):
    """The plan's training step, with the strategy told that forwards run in it."""

    def __init__(self, strategy: Any, model: nn.Module,
                 loss_fn: Callable[..., torch.Tensor], **options: Any) -> None:
        super().__init__(strategy.plan, model, loss_fn, **options)
        self._strategy = strategy

    def step(self, inputs: Any, targets: Any, **kwargs: Any) -> torch.Tensor:
        self._strategy._in_schedule = True
        try:
            return super().step(inputs, targets, **kwargs)
        finally:
            self._strategy._in_schedule = False


class _DeferredBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)`` under the strategy's ``gradient_sync`` policy.
    ModelParallelStrategy's own turns FSDP2's sync off and, with ``enabled=False``, off
    again after the block."""

    def __init__(self, deferred: DeferredSync) -> None:
        self.deferred = deferred

    def no_backward_sync(self, module: nn.Module, enabled: bool
                         ) -> AbstractContextManager[None]:
        return self.deferred.defer(module) if enabled else nullcontext()


class FabricStrategy(_PlanMixin, ModelParallelStrategy):
    """Lightning Fabric's strategy for ``plan``: ``Fabric(strategy=FabricStrategy(plan))``.

    ``fabric.setup_module(model)`` applies the plan (build the optimizer after it, on the
    returned model's parameters, and pass it to ``fabric.setup_optimizers``);
    ``fabric.setup_dataloaders`` shards by ``plan.data_shard()``; ``fabric.save(path,
    state)`` writes a composer_par checkpoint under ``path`` (a new step directory; the
    state's one model and at most one optimizer through DCP, the other values as JSON
    ``extra``) and ``fabric.load(path, state)`` reads the latest committed step (or the
    step directory given); ``fabric.clip_gradients`` clips across every mesh. A plan with
    a pipeline trains through :meth:`training_step` (the schedule runs forward and
    backward); its model's forward called alone is refused.

    Gradient accumulation: backwards inside ``fabric.no_backward_sync(model)`` defer the
    plan's FSDP2 reduce-scatters (and HSDP all-reduces) under ``gradient_sync``, a policy
    of :mod:`composer_par.gradient_sync` (``"last"``: reduced once, by the first backward
    outside the block; ``"reduce_scatter"``; ``"every"``: not deferred); it is also the
    ``sync`` of :meth:`training_step` unless given there.

    The replica check (:mod:`composer_par.replicas`) runs before every
    ``check_replicas_every``-th step of each optimizer set up through the strategy (the
    first included; ``None`` opts out), raising on every rank with the parameter, the
    mesh dim and the ranks.

    The other arguments are ``ModelParallelStrategy``'s; given, they are checked against
    the plan (CP702, CP703, CP706): the plan decides them.
    """

    def __init__(self, plan: ParallelPlan, *,
                 parallelize_fn: Callable[..., nn.Module] | None = None,
                 data_parallel_size: int | str | None = None,
                 tensor_parallel_size: int | str | None = None,
                 save_distributed_checkpoint: bool | None = None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | float | None = None,
                 gradient_sync: str = "last",
                 check_replicas_every: int | None = replicas.EVERY) -> None:
        super().__init__(parallelize_fn=self._apply_plan,
                         process_group_backend=process_group_backend, timeout=plan.timeout)
        self.plan = plan
        self._check_every = replicas.check_every(check_replicas_every)
        self._applied_models: list[nn.Module] = []
        self._guarded: list[Any] = []
        self._deferred_sync = DeferredSync(gradient_sync)
        self._backward_sync_control = _DeferredBackwardSync(self._deferred_sync)
        self._trainer_name = FABRIC
        self._given = _given(parallelize_fn=parallelize_fn,
                             data_parallel_size=data_parallel_size,
                             tensor_parallel_size=tensor_parallel_size,
                             save_distributed_checkpoint=save_distributed_checkpoint,
                             timeout=timeout)

    def _configure_launcher(self) -> None:
        # Lightning calls this once every setting is known and before any process starts.
        self._check_settings(self.precision)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # ModelParallelStrategy's own would build a data_parallel x tensor_parallel mesh:
        # its base's set-up, then the plan's mesh.
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self._device_mesh = self._build_mesh(self.world_size, self.root_device)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._sampler_kwargs(self.global_rank, self.world_size)

    def _apply_plan(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _refuse_parallelized(module, FABRIC, "before fabric.setup_module")
        applied = self.plan.apply(module)
        self._applied_models.append(applied)
        if self.plan.pipeline is not None:
            self._in_schedule = False
            applied.register_forward_pre_hook(self._outside_schedule)
        return applied

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Lightning's set-up of an optimizer; the replica check before every
        ``check_replicas_every``-th step of it (the first included); and after each of
        its steps the plan's plugins are told that the parameters changed (they refresh
        what they derive from them: float8's scales)."""
        optimizer = super().setup_optimizer(optimizer)
        if self._check_every is not None and not any(optimizer is o for o in self._guarded):
            replicas.guard_optimizer(
                optimizer, self._applied_models, every=self._check_every,
                plain_group=None if self.plan.pipeline is not None else "world")
            self._guarded.append(optimizer)
        training.tell_plugins_after_steps(self.plan, self._applied_models, optimizer)
        return optimizer

    def _outside_schedule(self, module: nn.Module, args: Any) -> None:
        # A stage's forward alone returns hidden states, not the model's outputs: a loss
        # on them would train nonsense without an error.
        if not self._in_schedule:
            raise RuntimeError(
                "this model is one pipeline stage of the plan: its forward runs inside the "
                "pipeline schedule. Instead of model(inputs) and fabric.backward(loss), "
                "call step = fabric.strategy.training_step(model, loss_fn) once and "
                "loss = step.step(inputs, targets) every step")

    def training_step(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                      **options: Any) -> TrainingStep:
        """``plan.training_step`` on the model ``fabric.setup_module`` returned: forward,
        loss and backward of a step (through the pipeline schedule when the plan has
        one), returning the global-batch mean loss. The loop of a pipeline plan; any
        other plan may use it too. ``options`` are ``plan.training_step``'s
        (``check_replicas_every``: by default the strategy's, left to the optimizers
        set up through it when there are; ``accumulate``; ``sync``: by default the
        strategy's ``gradient_sync``)."""
        options.setdefault("sync", self._deferred_sync.sync)
        # An optimizer set up through the strategy checks the replicas already.
        options.setdefault("check_replicas_every",
                           None if self._guarded else self._check_every)
        module = getattr(model, "_forward_module", model)
        return _ScheduledStep(self, module, loss_fn, **options)

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._apply_plan(module, self.device_mesh)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any],
                                    scheduler: Any = None) -> Any:
        raise RuntimeError(
            "a plan's strategy cannot set up a model and its optimizer together: the plan "
            "replaces the model's parameters (sharded, materialized), so an optimizer built "
            "before holds the old ones. Call model = fabric.setup_module(model), then build "
            "the optimizer on model.parameters() and call fabric.setup_optimizers(optimizer)")

    def clip_gradients_norm(self, module: nn.Module, optimizer: Any, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True
                            ) -> torch.Tensor:
        # torch's clip_grad_norm_ stacks per-parameter norms, which fails for DTensors on
        # different meshes (an embedding TP leaves whole next to FSDP2 x TP blocks).
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        stages = self.plan.pipeline.size if self.plan.pipeline is not None else 1
        norm = training.clip_grad_norm_(params, float(max_norm), float(norm_type),
                                        pipeline_size=stages)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}; "
                               "pass error_if_nonfinite=False to clip anyway")
        return norm

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("a plan's strategy saves whole composer_par checkpoints: "
                            "storage_options and filter are not supported")
        (_, model), optimizer, rest = _split_state(state)
        checkpoint.save(Path(self.broadcast(str(path))), model,
                        optimizer[1] if optimizer else None, extra=rest, plan=self.plan)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not state:
            raise ValueError("fabric.load with a plan's strategy needs the objects to load "
                             "into: fabric.load(path, {'model': model, 'optimizer': ...})")
        where = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):
            checkpoint.load(where, state, strict=strict)
            return {}
        (_, model), optimizer, rest = _split_state(state)
        info = checkpoint.load(where, model, optimizer[1] if optimizer else None, strict=strict)
        extra = dict(info.extra) if isinstance(info.extra, Mapping) else {}
        missing = [k for k in rest if k not in extra]
        if strict and missing:
            raise KeyError(f"{info.path} holds no {', '.join(map(repr, missing))} (it has "
                           f"{', '.join(map(repr, extra)) or 'no other values'})")
        for key in list(rest):
            if key in extra:
                value = extra.pop(key)
                target = state[key]
                if hasattr(target, "load_state_dict") and not isinstance(
                        target, (nn.Module, torch.optim.Optimizer)):
                    target.load_state_dict(value)
                else:
                    state[key] = value
        return extra

    def module_init_context(self, empty_init: bool | None = None
                            ) -> AbstractContextManager[Any]:
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack
