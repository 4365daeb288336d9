"""The trainer of :mod:`composer_par.integrations.hf_trainer`: ``transformers.Trainer``
running a plan. This module imports transformers (and accelerate);
``composer_par.integrations.hf_trainer`` imports it when ``PlanTrainer`` is first asked
for, so that the adapter's module (and ``import composer_par``) needs neither installed."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from torch import nn
from transformers.trainer import TRAINER_STATE_NAME

from composer_par import checkpoint, replicas, training
from composer_par.checkpoint import steps
from composer_par.checkpoint.dcp import resolve_for_all
from composer_par.gradient_sync import check_sync_policy
from composer_par.integrations._plan_accelerator import PlanAccelerator, plan_mesh, world_size
from composer_par.integrations.accelerate import plan_findings
from composer_par.integrations.errors import refuse_errors
from composer_par.integrations.hf_trainer import CHECKPOINT_EXTRA, TRAINER, trainer_findings

if TYPE_CHECKING:
    from composer_par.plan import ParallelPlan


class PlanTrainer(transformers.Trainer):
    """``transformers.Trainer`` running ``plan`` (see the module). ``model`` is built as
    for ``plan.apply`` (ideally on meta); the other arguments are the Trainer's own
    (``args`` is required). ``optimizers`` must be built on the applied model's
    parameters; ``optimizer_cls_and_kwargs`` or ``args.optim`` need no model. With
    ``gradient_accumulation_steps=k`` the first ``k - 1`` microbatches of each step defer
    the plan's FSDP2 / HSDP reductions under ``gradient_sync`` (a policy of
    :mod:`composer_par.gradient_sync`: ``"last"``, ``"reduce_scatter"``, ``"every"``).
    The replica check (:mod:`composer_par.replicas`) runs before every
    ``check_replicas_every``-th optimizer step (the first included; ``None`` opts out)."""

    def __init__(self, plan: ParallelPlan, model: nn.Module | None = None,
                 args: transformers.TrainingArguments | None = None, *,
                 gradient_sync: str = "last",
                 check_replicas_every: int | None = replicas.EVERY, **kwargs: Any) -> None:
        if model is None or args is None:
            raise TypeError("PlanTrainer needs model= (the plan applies it; model_init is not "
                            "supported) and args= (TrainingArguments)")
        self._gradient_sync = check_sync_policy(gradient_sync)
        self._check_every = replicas.check_every(check_replicas_every)
        world = world_size()
        refuse_errors(TRAINER, plan_findings(plan, world, TRAINER)
                      + trainer_findings(plan, args))
        self.plan = plan
        if not plan.applied:
            plan_mesh(plan, world)
            model = plan.apply(model)
        self._plan_model = model
        self._resume_from_plan_checkpoint: str | None = None
        super().__init__(model=model, args=args, **kwargs)

    # -- the accelerator -----------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        # The plan has no DDP to configure; everything else is checked by the adapter.
        args.pop("kwargs_handlers", None)
        self._plan_accelerator_args = args
        return args

    def create_accelerator_and_postprocess(self) -> None:
        # The Trainer builds accelerate's own Accelerator from its arguments (it is never
        # given the model); the plan's replaces it with the same arguments.
        super().create_accelerator_and_postprocess()
        self.accelerator = PlanAccelerator(self.plan, gradient_sync=self._gradient_sync,
                                           check_replicas_every=self._check_every,
                                           **self._plan_accelerator_args)
        self.accelerator._plan_models.append(self._plan_model)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object)
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    def _move_model_to_device(self, model: nn.Module, device: Any) -> None:
        """The plan materialized every parameter on its device: nothing to move."""

    def get_tp_size(self) -> int:
        """Ranks that read the same samples (those differing only in model-parallel mesh
        dims): the Trainer divides its token count over all processes by it."""
        _, count = self.plan.data_shard(self.accelerator.process_index,
                                        self.accelerator.num_processes)
        return self.accelerator.num_processes // count

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: Any) -> Any:
        """The tokens the loss is normalized by: the Trainer divides its count by
        get_tp_size() whether or not it gathered it over the processes; a count it did
        not gather is this rank's own data shard's, so the division is undone."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        if (count is not None and not self.args.average_tokens_across_devices
                and hasattr(count, "dim")):
            count = count * self.get_tp_size()
        return count

    # -- gradients ---------------------------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = training.total_grad_norm(model.parameters())
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    # -- checkpoints -------------------------------------------------------------------------

    def _optimizer_to_save(self) -> Any:
        if self.args.save_only_model or self.optimizer is None:
            return None
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Inside ``checkpoint-N`` (the Trainer's checkpoints): the model, optimizer and
        scheduler as a composer_par checkpoint. Otherwise (``trainer.save_model()``):
        Hugging Face safetensors, each rank writing its own parts, and the config."""
        directory = Path(output_dir or self.args.output_dir or ".")
        model = cast("nn.Module", self.model)
        if _internal_call:
            scheduler = (self.lr_scheduler.state_dict()
                         if self.lr_scheduler is not None else None)
            checkpoint.save(directory, model, self._optimizer_to_save(),
                            extra={CHECKPOINT_EXTRA: {"scheduler": scheduler}},
                            step=self.state.global_step, plan=self.plan)
            return
        checkpoint.export_safetensors(model, directory, plan=self.plan)
        config = getattr(model, "config", None)
        if config is not None and self.args.should_save:
            config.save_pretrained(directory)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Saved with the model by save_model, in one composer_par checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Loaded with the optimizer once it exists (_load_optimizer_and_scheduler)."""
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"no checkpoint directory at {resume_from_checkpoint}")

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """The composer_par checkpoint of ``checkpoint-N``: model, optimizer, scheduler.
        A checkpoint the Trainer did not write (``composer_par.checkpoint.save``) has no
        scheduler state, and its optimizer's parameter groups need not be the Trainer's:
        the per-parameter state is loaded, the groups keep the Trainer's settings and the
        scheduler continues from the checkpoint's step."""
        if checkpoint_dir is None:
            return
        optimizer = self._optimizer_to_save()
        settings = ([{k: v for k, v in group.items() if k != "params"}
                     for group in optimizer.param_groups] if optimizer is not None else [])
        info = checkpoint.load(checkpoint_dir, cast("nn.Module", self.model), optimizer)
        saved = info.extra.get(CHECKPOINT_EXTRA) if isinstance(info.extra, dict) else None
        if saved is None:
            if optimizer is not None:
                for group, own in zip(optimizer.param_groups, settings, strict=True):
                    group.update(own)
            if self.lr_scheduler is not None and info.step > 0:
                self._continue_schedule(info.step)
            return
        state = saved.get("scheduler")
        if state is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state)

    def _continue_schedule(self, step: int) -> None:
        """The scheduler, and the learning rates it sets, as the Trainer's would be after
        ``step`` steps. The Trainer's schedules are functions of the step (LambdaLR);
        another scheduler continues from the optimizer's current rates."""
        scheduler = cast("Any", self.lr_scheduler)
        optimizer = self._optimizer_to_save()
        if not hasattr(scheduler, "last_epoch") or optimizer is None:
            return  # no step count to set (ReduceLROnPlateau)
        groups = optimizer.param_groups
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                           strict=True):
                group["lr"] = base * factor(step)
        state = scheduler.state_dict()
        state.update(last_epoch=step, _step_count=step + 1,
                     _last_lr=[group["lr"] for group in groups])
        scheduler.load_state_dict(state)

    # -- resuming from a directory composer_par.checkpoint.save wrote -----------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """The Trainer's ``train``; ``resume_from_checkpoint`` may also be a directory
        written by ``composer_par.checkpoint.save`` (a root or a step directory) without
        the Trainer's ``trainer_state.json``: training continues at the checkpoint's step
        (model, optimizer, global step, the data position of that step)."""
        self._resume_from_plan_checkpoint = None
        if (isinstance(resume_from_checkpoint, (str, os.PathLike))
                and _plan_checkpoint_alone(resume_from_checkpoint)):
            # The Trainer's train() reads trainer_state.json from the directory it
            # resumes; the loop gets the directory past it (_inner_training_loop).
            self._resume_from_plan_checkpoint = str(resolve_for_all(resume_from_checkpoint))
            resume_from_checkpoint = None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _inner_training_loop(self, batch_size: int | None = None,
                             args: transformers.TrainingArguments | None = None,
                             resume_from_checkpoint: str | None = None, trial: Any = None,
                             ignore_keys_for_eval: list[str] | None = None) -> Any:
        if self._resume_from_plan_checkpoint is not None:
            resume_from_checkpoint = self._resume_from_plan_checkpoint
        return super()._inner_training_loop(batch_size=batch_size, args=args,
                                            resume_from_checkpoint=resume_from_checkpoint,
                                            trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int,
                             num_train_epochs: int, resume_from_checkpoint: str | None,
                             trial: Any) -> tuple[int, int]:
        """The Trainer's state, at the step of a composer_par checkpoint it resumes; the
        epochs and batches to skip computed as the Trainer computes them from its own."""
        trained = super()._init_training_state(max_steps, num_update_steps_per_epoch,
                                               num_train_epochs, resume_from_checkpoint, trial)
        directory = self._resume_from_plan_checkpoint
        if directory is None or resume_from_checkpoint != directory:
            return trained
        info = steps.read_info(directory)
        step = int(info.get("step", steps.step_of(directory)) or 0)
        self.state.global_step = step
        in_epoch = 0
        if not self.args.ignore_data_skip:
            in_epoch = (step % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps
        return step // num_update_steps_per_epoch, in_epoch


def _plan_checkpoint_alone(path: str | os.PathLike[str]) -> bool:
    """``path`` holds a composer_par checkpoint (a step directory or a root of them) and
    not the Trainer's state."""
    directory = Path(path)
    if not directory.is_dir() or (directory / TRAINER_STATE_NAME).is_file():
        return False
    return steps.is_checkpoint_dir(directory) or bool(steps.step_dirs(directory))
