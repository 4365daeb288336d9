"""The Hugging Face Trainer running a composer_par plan, through the accelerate adapter.

    from composer_par.integrations.hf_trainer import PlanTrainer

    trainer = PlanTrainer(plan, model=model, args=TrainingArguments(...),
                          train_dataset=dataset)
    trainer.train()

The model (built on meta, or on CPU) is given as it is; ``PlanTrainer`` applies the plan
on the plan's mesh before the Trainer sees it, and its accelerator is a
:class:`~composer_par.integrations.accelerate.PlanAccelerator` (accelerate's
``Accelerator`` adopting the plan's model, its loaders sharded by ``plan.data_shard()``).
On top of what that adapter turns off, the Trainer is kept from:

* moving the model to a device (the plan materialized every parameter in place);
* counting tokens over every process: ranks that differ only in a model-parallel mesh
  dim read the same samples, so the ranks per data shard divide the count
  (``get_tp_size``), for any plan, not only accelerate's tp dim;
* clipping with torch's per-mesh norms: ``max_grad_norm`` clips through
  :func:`composer_par.training.clip_grad_norm_`;
* saving checkpoints as full state dicts on rank 0: each ``checkpoint-N`` directory holds
  a :mod:`composer_par.checkpoint` checkpoint (model, optimizer, scheduler in its JSON
  extra) next to the Trainer's ``trainer_state.json`` and RNG files, and
  ``resume_from_checkpoint`` reads it back. ``save_model`` exports Hugging Face
  safetensors without gathering the model on one rank.

transformers (and accelerate) are imported when a trainer is made, not with this module
(``PlanTrainer`` is defined on first use). Training arguments that overlap the plan are
refused before anything is built (CP711-CP719, :func:`trainer_findings`). A plan file on
the command line: :class:`PlanArguments` with ``HfArgumentParser`` (``--plan plan.toml``),
see examples/hf_trainer_plan.py.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from composer_par.findings import Finding
from composer_par.integrations.accelerate import (
    _device_mesh,
    _world_size,
    accelerate_findings,
    plan_accelerator_class,
    plan_findings,
)
from composer_par.integrations.errors import refuse_errors

if TYPE_CHECKING:
    import torch.nn as nn
    import transformers

    from composer_par.plan import ParallelPlan

TRAINER = "Trainer"
CHECKPOINT_EXTRA = "trainer"


def trainer_findings(plan: ParallelPlan, args: transformers.TrainingArguments
                     ) -> list[Finding]:
    """Every training argument (and launch setting) that overlaps the plan."""
    findings: list[Finding] = []

    def add(code: str, message: str, fix: str) -> None:
        findings.append(Finding(code, message, fix=fix, plugin=TRAINER))

    if getattr(args, "gradient_checkpointing", False) or getattr(
            args, "activation_checkpointing", False):
        where = ("the plan checkpoints its blocks already (activation_checkpoint)"
                 if plan.plugin("activation_checkpoint") is not None
                 else "it would wrap blocks after the plan sharded them, outside the apply order")
        add("CP712", "the Trainer's own activation checkpointing is on "
            f"(gradient_checkpointing / activation_checkpointing): {where}",
            "turn it off and add ActivationCheckpoint() (mode full or selective) to the plan")
    if getattr(args, "torch_compile", False):
        add("CP713", "torch_compile is on: the Trainer would compile the whole sharded model, "
            "FSDP's hooks inside the graph", "set torch_compile=False and add Compile() to the "
            "plan: it compiles each block after checkpointing and before sharding")
    fsdp = getattr(args, "fsdp", None)
    if fsdp or getattr(args, "deepspeed", None):
        what = "fsdp" if fsdp else "deepspeed"
        add("CP714", f"{what} is set: the Trainer would shard or wrap the model the plan "
            "already shards", f"remove {what} (and fsdp_config): the plan's FSDP2, HSDP and "
            "TP plugins shard")
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if str(fsdp_config.get("cpu_ram_efficient_loading", "false")).lower() == "true":
        add("CP715", "fsdp_config cpu_ram_efficient_loading is on: rank 0 loads the full "
            "weights and broadcasts them into FSDP shards, which gives tensor-parallel ranks "
            "the wrong parts and skips the plan's materialization",
            "turn it off; build the model on meta and load with LoadSafetensors or initialize "
            "with MetaInit")
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        fsdp2 = plan.plugin("fsdp2")
        where = ("the plan's FSDP2 sets its own mixed precision"
                 if getattr(fsdp2, "mixed_precision", None) is not None
                 else "autocast would wrap a model the plan already built")
        add("CP717", f"{'bf16' if args.bf16 else 'fp16'} is on: {where}",
            "set bf16 and fp16 off and give FSDP2 mixed_precision={param_dtype = 'bfloat16', "
            "reduce_dtype = 'float32'} in the plan")
    if getattr(args, "train_sampling_strategy", "") == "batch_rebalance":
        add("CP719", "train_sampling_strategy='batch_rebalance' balances batches over every "
            "process, not over the plan's data shards: tensor-parallel ranks would read "
            "different samples", "use 'random', 'sequential' or 'group_by_length'")
    accelerator_config = getattr(args, "accelerator_config", None)
    settings = {"parallelism_config": getattr(args, "parallelism_config", None),
                "dataloader_config": accelerator_config}
    found = {f.code for f in findings}
    # The launch environment (accelerate launch's config), and what only accelerate's
    # settings say; a code already found from the arguments is not repeated.
    findings += [f for f in accelerate_findings(plan, settings, TRAINER) if f.code not in found]
    return findings


@dataclasses.dataclass
class PlanArguments:
    """The plan file of a Trainer script, for ``HfArgumentParser``:
    ``HfArgumentParser((PlanArguments, TrainingArguments))`` reads ``--plan plan.toml``."""

    plan: str = dataclasses.field(metadata={
        "help": "a composer_par plan file (TOML): the mesh and the parallelism the Trainer "
        "runs the model with"})

    def load(self) -> ParallelPlan:
        from composer_par.plan import ParallelPlan

        return ParallelPlan.from_toml(Path(self.plan))


@functools.cache
def plan_trainer_class() -> type:
    """:class:`PlanTrainer`, defined on first use: transformers is imported then, not
    when this module is."""
    import transformers

    class PlanTrainer(transformers.Trainer):  # type: ignore[misc,name-defined]
        """``transformers.Trainer`` running ``plan`` (see the module). ``model`` is built as
        for ``plan.apply`` (ideally on meta); the other arguments are the Trainer's own
        (``args`` is required). ``optimizers`` must be built on the applied model's
        parameters; ``optimizer_cls_and_kwargs`` or ``args.optim`` need no model."""

        def __init__(self, plan: ParallelPlan, model: nn.Module | None = None,
                     args: transformers.TrainingArguments | None = None, **kwargs: Any) -> None:
            if model is None or args is None:
                raise TypeError("PlanTrainer needs model= (the plan applies it; model_init is not "
                                "supported) and args= (TrainingArguments)")
            world = _world_size()
            refuse_errors(TRAINER, plan_findings(plan, world, TRAINER)
                          + trainer_findings(plan, args))
            self.plan = plan
            if not plan.applied:
                _device_mesh(plan, world)
                model = plan.apply(model)
            self._plan_model = model
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
            self.accelerator = plan_accelerator_class()(self.plan, **self._plan_accelerator_args)
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
                from composer_par.training import total_grad_norm

                grad_norm = total_grad_norm(model.parameters())
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
            from composer_par import checkpoint

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
            """The composer_par checkpoint of ``checkpoint-N``: model, optimizer, scheduler."""
            if checkpoint_dir is None:
                return
            from composer_par import checkpoint

            info = checkpoint.load(checkpoint_dir, cast("nn.Module", self.model),
                                   self._optimizer_to_save())
            saved = info.extra.get(CHECKPOINT_EXTRA) if isinstance(info.extra, dict) else None
            state = (saved or {}).get("scheduler")
            if state is not None and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(state)

    return PlanTrainer


def __getattr__(name: str) -> Any:
    # PlanTrainer subclasses transformers.Trainer: made when first asked for.
    if name == "PlanTrainer":
        return plan_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plan_trainer(plan: ParallelPlan | str | os.PathLike[str], model: nn.Module,
                 args: transformers.TrainingArguments, **kwargs: Any) -> Any:
    """A :class:`PlanTrainer` from a plan or a plan file's path."""
    if not hasattr(plan, "apply"):
        plan = PlanArguments(str(plan)).load()
    return plan_trainer_class()(plan, model=model, args=args, **kwargs)


__all__ = ["PlanArguments", "plan_trainer", "plan_trainer_class", "trainer_findings"]
