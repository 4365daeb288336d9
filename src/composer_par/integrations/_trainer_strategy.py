"""The strategy of :mod:`composer_par.integrations.lightning` for the Lightning Trainer.
This module imports lightning's Trainer; ``composer_par.integrations.lightning`` imports
it when ``TrainerStrategy`` is first asked for, so that the adapter's module (and
``import composer_par``) needs no lightning installed."""

from __future__ import annotations

import shutil
import types
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.data import DataLoader

# Lightning's save_checkpoint names its argument ``checkpoint``: the module goes by ckpt.
from composer_par import checkpoint as ckpt
from composer_par import replicas, training
from composer_par.data import ResumableLoader
from composer_par.findings import Finding
from composer_par.gradient_sync import DeferredSync
from composer_par.integrations.errors import refuse_errors
from composer_par.integrations.lightning import (
    TRAINER,
    _given,
    _PlanMixin,
    _refuse_parallelized,
)
from composer_par.plugin import Stage

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from composer_par.plan import ParallelPlan


def _clip_across_meshes(precision: Any) -> None:
    """``gradient_clip_val`` through composer_par's clip: the precision plugin's own calls
    torch's ``clip_grad_norm_``, which fails for DTensors on different meshes."""

    def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float | int) -> None:
        training.clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val))

    precision.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, precision)


class TrainerStrategy(_PlanMixin, ModelParallelStrategy):
    """The Lightning Trainer's strategy for ``plan``: ``Trainer(strategy=TrainerStrategy(
    plan))``. No ``configure_model`` to write: at setup the plan is applied to the
    LightningModule's submodule named ``module`` (default ``"model"``; ``""`` for the
    LightningModule itself), which it replaces. ``configure_model``, if overridden, runs
    under ``torch.device("meta")`` when the plan materializes (MetaInit or a loader), so
    the model it builds costs no memory. Checkpoints (``trainer.save_checkpoint``,
    ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are composer_par checkpoints of that
    submodule and the one optimizer, with Lightning's loop and callback state as JSON.

    The replica check (:mod:`composer_par.replicas`) runs before every
    ``check_replicas_every``-th step of each optimizer (the first included; ``None`` opts
    out), raising on every rank with the parameter, the mesh dim and the ranks.

    With ``accumulate_grad_batches=k``, the backwards of the first ``k - 1`` batches defer
    the plan's FSDP2 reduce-scatters (and HSDP all-reduces) under ``gradient_sync``, a
    policy of :mod:`composer_par.gradient_sync` (``"last"``: one reduction per optimizer
    step; ``"reduce_scatter"``; ``"every"``: as Lightning without deferral).
    """

    def __init__(self, plan: ParallelPlan, *, module: str = "model",
                 data_parallel_size: int | str | None = None,
                 tensor_parallel_size: int | str | None = None,
                 save_distributed_checkpoint: bool | None = None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | float | None = None,
                 gradient_sync: str = "last",
                 check_replicas_every: int | None = replicas.EVERY) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=plan.timeout)
        self.plan = plan
        self._check_every = replicas.check_every(check_replicas_every)
        self._guarded: list[Any] = []
        self.module_name = module
        self._deferred_sync = DeferredSync(gradient_sync)
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

    def process_dataloader(self, dataloader: object) -> object:
        """The training loader with its position in the epoch (a ResumableLoader):
        Lightning saves the state of a loader that has one, so a checkpoint taken
        mid-epoch resumes at the next batch instead of the epoch's first."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (trainer is None or not trainer.training or not isinstance(dataloader, DataLoader)
                or hasattr(dataloader, "state_dict")):  # a loader with a state of its own
            return dataloader
        try:
            len(dataloader)
        except TypeError:  # an iterable dataset: no position to restore
            return dataloader
        return ResumableLoader(dataloader)

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
            # Plugins refresh what they derive from the parameters (float8's scales).
            for optimizer in self.optimizers:
                training.tell_plugins_after_steps(self.plan, [self._applied], optimizer)
            self._guard_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _guard_optimizers(self) -> None:
        """The replica check before every ``check_replicas_every``-th step of each
        optimizer (the first included), installed once per optimizer."""
        if self._check_every is None or self._applied is None:
            return
        for optimizer in self.optimizers:
            if not any(optimizer is o for o in self._guarded):
                replicas.guard_optimizer(optimizer, self._applied, every=self._check_every)
                self._guarded.append(optimizer)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's context of a batch whose optimizer step comes later (gradient
        accumulation): the plan's units defer their reduction under ``gradient_sync``.
        ParallelStrategy's own blocks only DDP's."""
        if self._applied is None:
            yield
            return
        with self._deferred_sync.defer(self._applied):
            yield

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
        ckpt.save(Path(self.broadcast(str(filepath))), target,
                  self._optimizer() if with_optimizer else None, extra=state, plan=self.plan)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        assert self.lightning_module is not None
        _, _, target = self._target()
        info = ckpt.load(Path(self.broadcast(str(checkpoint_path))), target,
                         self._optimizer(), strict=self.lightning_module.strict_loading)
        extra = dict(info.extra) if isinstance(info.extra, Mapping) else {}
        extra.setdefault("state_dict", {})
        return extra

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            shutil.rmtree(str(filepath), ignore_errors=True)
