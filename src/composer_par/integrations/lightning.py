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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer_par import checkpoint
from composer_par.findings import Finding
from composer_par.integrations.errors import refuse_errors
from composer_par.logging import get_logger
from composer_par.plugin import Stage
from composer_par.training import TrainingStep

if TYPE_CHECKING:
    from collections.abc import Generator

    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

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


# -- Fabric ---------------------------------------------------------------------------------


def _fabric_class() -> type:
    """FabricStrategy, defined on first use: importing lightning (which imports
    transformers) waits until a strategy is made."""
    from lightning.fabric.strategies.model_parallel import (
        ModelParallelStrategy as _FabricModelParallel,
    )
    from lightning.fabric.strategies.parallel import ParallelStrategy as _FabricParallel

    class FabricStrategy(_PlanMixin, _FabricModelParallel):
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

        The other arguments are ``ModelParallelStrategy``'s; given, they are checked against
        the plan (CP702, CP703, CP706): the plan decides them.
        """

        def __init__(self, plan: ParallelPlan, *,
                     parallelize_fn: Callable[..., nn.Module] | None = None,
                     data_parallel_size: int | str | None = None,
                     tensor_parallel_size: int | str | None = None,
                     save_distributed_checkpoint: bool | None = None,
                     process_group_backend: str | None = None,
                     timeout: timedelta | float | None = None) -> None:
            super().__init__(parallelize_fn=self._apply_plan,
                             process_group_backend=process_group_backend, timeout=plan.timeout)
            self.plan = plan
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
            _FabricParallel.setup_environment(self)
            self._setup_distributed()
            self._device_mesh = self._build_mesh(self.world_size, self.root_device)

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return self._sampler_kwargs(self.global_rank, self.world_size)

        def _apply_plan(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            _refuse_parallelized(module, FABRIC, "before fabric.setup_module")
            applied = self.plan.apply(module)
            if self.plan.pipeline is not None:
                self._in_schedule = False
                applied.register_forward_pre_hook(self._outside_schedule)
            return applied

        def _outside_schedule(self, module: nn.Module, args: Any) -> None:
            # A stage's forward alone returns hidden states, not the model's outputs: a loss
            # on them would train nonsense without an error.
            if not self._in_schedule:
                raise RuntimeError(
                    "this model is one pipeline stage of the plan: its forward runs inside the "
                    "pipeline schedule. Instead of model(inputs) and fabric.backward(loss), "
                    "call step = fabric.strategy.training_step(model, loss_fn) once and "
                    "loss = step.step(inputs, targets) every step")

        def training_step(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]
                          ) -> TrainingStep:
            """``plan.training_step`` on the model ``fabric.setup_module`` returned: forward,
            loss and backward of a step (through the pipeline schedule when the plan has
            one), returning the global-batch mean loss. The loop of a pipeline plan; any
            other plan may use it too."""
            module = getattr(model, "_forward_module", model)
            return _ScheduledStep(self, module, loss_fn)

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
            from composer_par.training import clip_grad_norm_

            self.precision.unscale_gradients(optimizer)
            params = list(self.precision.main_params(optimizer))
            stages = self.plan.pipeline.size if self.plan.pipeline is not None else 1
            norm = clip_grad_norm_(params, float(max_norm), float(norm_type),
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

    return FabricStrategy


def _clip_across_meshes(precision: Any) -> None:
    """``gradient_clip_val`` through composer_par's clip: the precision plugin's own calls
    torch's ``clip_grad_norm_``, which fails for DTensors on different meshes."""
    import types

    from composer_par.training import clip_grad_norm_

    def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float | int) -> None:
        clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val))

    precision.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, precision)


class _ScheduledStep(TrainingStep):
    """The plan's training step, with the strategy told that forwards run in it."""

    def __init__(self, strategy: Any, model: nn.Module,
                 loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__(strategy.plan, model, loss_fn)
        self._strategy = strategy

    def step(self, inputs: Any, targets: Any, **kwargs: Any) -> torch.Tensor:
        self._strategy._in_schedule = True
        try:
            return super().step(inputs, targets, **kwargs)
        finally:
            self._strategy._in_schedule = False


# -- Trainer --------------------------------------------------------------------------------


def _trainer_class() -> type:
    """TrainerStrategy, defined on first use (see :func:`_fabric_class`)."""
    from lightning.pytorch.strategies.model_parallel import (
        ModelParallelStrategy as _TrainerModelParallel,
    )

    class TrainerStrategy(_PlanMixin, _TrainerModelParallel):
        """The Lightning Trainer's strategy for ``plan``: ``Trainer(strategy=TrainerStrategy(
        plan))``. No ``configure_model`` to write: at setup the plan is applied to the
        LightningModule's submodule named ``module`` (default ``"model"``; ``""`` for the
        LightningModule itself), which it replaces. ``configure_model``, if overridden, runs
        under ``torch.device("meta")`` when the plan materializes (MetaInit or a loader), so
        the model it builds costs no memory. Checkpoints (``trainer.save_checkpoint``,
        ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are composer_par checkpoints of that
        submodule and the one optimizer, with Lightning's loop and callback state as JSON.
        """

        def __init__(self, plan: ParallelPlan, *, module: str = "model",
                     data_parallel_size: int | str | None = None,
                     tensor_parallel_size: int | str | None = None,
                     save_distributed_checkpoint: bool | None = None,
                     process_group_backend: str | None = None,
                     timeout: timedelta | float | None = None) -> None:
            super().__init__(process_group_backend=process_group_backend, timeout=plan.timeout)
            self.plan = plan
            self.module_name = module
            self._applied: nn.Module | None = None
            self._trainer_name = TRAINER
            self._given = _given(data_parallel_size=data_parallel_size,
                                 tensor_parallel_size=tensor_parallel_size,
                                 save_distributed_checkpoint=save_distributed_checkpoint,
                                 timeout=timeout)

        def _configure_launcher(self) -> None:
            self._check_settings(self.precision_plugin)
            super()._configure_launcher()

        def setup_environment(self) -> None:
            self._setup_distributed()  # Lightning's: the accelerator, then the process group
            self._device_mesh = self._build_mesh(self.world_size, self.root_device)
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self._device_mesh

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return self._sampler_kwargs(self.global_rank, self.world_size)

        def _target(self) -> tuple[nn.Module, str, nn.Module]:
            """(parent, attribute, the module the plan applies to)."""
            root = self.lightning_module
            assert root is not None
            if not self.module_name:
                return root, "", root
            *path, last = self.module_name.split(".")
            parent: nn.Module = root
            for name in path:
                parent = getattr(parent, name)
            target = getattr(parent, last, None)
            if not isinstance(target, nn.Module):
                raise TypeError(
                    f"{type(root).__name__}.{self.module_name} is "
                    f"{type(target).__name__ if target is not None else 'missing'}: the plan "
                    f"applies to that submodule; build it in __init__ or configure_model, or "
                    "name another with TrainerStrategy(plan, module=...)")
            return parent, last, target

        def _check_module(self, target: nn.Module) -> None:
            root = self.lightning_module
            assert root is not None
            _refuse_parallelized(target, TRAINER, "by configure_model")
            inside = {id(p) for p in target.parameters()}
            outside = [n for n, p in root.named_parameters() if id(p) not in inside]
            if outside:
                refuse_errors(TRAINER, [Finding(
                    "CP707", f"{type(root).__name__} holds parameters outside "
                    f"{self.module_name!r}, the submodule the plan applies to "
                    f"({', '.join(outside[:5])}): no data-parallel plugin would reduce their "
                    "gradients, so each rank would train its own copy",
                    fix="move them into that submodule, or apply the plan to the whole "
                    "LightningModule: TrainerStrategy(plan, module=\"\")")])

        def setup(self, trainer: pl.Trainer) -> None:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device
            from lightning.pytorch.trainer.states import TrainerFn

            assert self.model is not None and self.accelerator is not None
            self.accelerator.setup(trainer)
            parent, name, target = self._target()
            # Lightning sets the strategy up again for every fit, validate, test and predict
            # call: a module this strategy applied the plan to stays as it is.
            if target is not self._applied:
                self._check_module(target)
                applied = self.plan.apply(target)
                if name:
                    setattr(parent, name, applied)
                elif applied is not target:
                    raise TypeError("the plan replaced the LightningModule itself; apply it to a "
                                    "submodule: TrainerStrategy(plan, module=...)")
                self._applied = applied
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()  # what the plan did not place (buffers outside its module)
            _clip_across_meshes(self.precision_plugin)
            self.barrier()
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                _optimizers_to_device(self.optimizers, self.root_device)

        @contextmanager
        def tensor_init_context(self, empty_init: bool | None = None
                                ) -> Generator[None, None, None]:
            if empty_init is None:
                empty_init = bool(self.plan.hooks.implementers(Stage.MATERIALIZE))
            with (torch.device("meta") if empty_init else nullcontext(),
                  self.precision_plugin.tensor_init_context()):
                yield

        # Model and optimizer state go through composer_par.checkpoint in save_checkpoint;
        # Lightning's own copies of them would be computed and dropped.
        def lightning_module_state_dict(self) -> dict[str, Any]:
            return {}

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            return {}

        def _optimizer(self) -> Any:
            if len(self.optimizers) > 1:
                raise ValueError(f"a plan's checkpoint holds at most one optimizer; "
                                 f"configure_optimizers returned {len(self.optimizers)}")
            return self.optimizers[0] if self.optimizers else None

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                            storage_options: Any = None) -> None:
            if storage_options is not None:
                raise TypeError("a plan's strategy saves composer_par checkpoints: "
                                "storage_options is not supported")
            state = dict(checkpoint)
            state.pop("state_dict", None)
            with_optimizer = state.pop("optimizer_states", None) is not None
            _, _, target = self._target()
            from composer_par import checkpoint as ckpt

            ckpt.save(Path(self.broadcast(str(filepath))), target,
                      self._optimizer() if with_optimizer else None, extra=state, plan=self.plan)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                            ) -> dict[str, Any]:
            assert self.lightning_module is not None
            _, _, target = self._target()
            info = checkpoint.load(Path(self.broadcast(str(checkpoint_path))), target,
                                   self._optimizer(), strict=self.lightning_module.strict_loading)
            extra = dict(info.extra) if isinstance(info.extra, Mapping) else {}
            extra.setdefault("state_dict", {})
            return extra

        def remove_checkpoint(self, filepath: Any) -> None:
            import shutil

            if self.is_global_zero:
                shutil.rmtree(str(filepath), ignore_errors=True)

    return TrainerStrategy


_DEFINE = {"FabricStrategy": _fabric_class, "TrainerStrategy": _trainer_class}


def __getattr__(name: str) -> Any:
    # The strategies subclass Lightning's: made on first access, then kept.
    if name in _DEFINE:
        cls = _DEFINE[name]()
        cls.__qualname__ = name  # the name pickle and reprs find it under
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FabricStrategy", "TrainerStrategy", "setup_findings"]  # noqa: F822
