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
  ``resume_from_checkpoint`` reads it back, as it reads a directory that
  ``composer_par.checkpoint.save`` wrote in a loop of the user's own (the step, model
  and optimizer state from it; the scheduler set to that step). ``save_model`` exports
  Hugging Face safetensors without gathering the model on one rank.

transformers (and accelerate) are imported when a trainer is made, not with this module:
``PlanTrainer`` lives in a module of its own that imports them, loaded when the class is
first asked for. Training arguments that overlap the plan are refused before anything is
built (CP711-CP720, :func:`trainer_findings`). A plan file on the command line:
:class:`PlanArguments` with ``HfArgumentParser`` (``--plan plan.toml``), see
examples/hf_trainer_plan.py; or no plan file at all: :func:`plan_trainer` with ``None``
builds the plan from the Trainer's own ``--fsdp`` / ``--deepspeed`` arguments.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.findings import Finding
from composer_par.integrations.accelerate import accelerate_findings

if TYPE_CHECKING:
    import torch.nn as nn
    import transformers

    from composer_par.integrations._plan_trainer import PlanTrainer
    from composer_par.plan import ParallelPlan
    from composer_par.plugin import Plugin

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
    splitters = [d.plugin for d in plan.view.declarations() if "sequence_split" in d.provides]
    if splitters:
        add("CP720", f"the plan's {', '.join(splitters)} plugin splits every sequence over "
            "ranks, and the Trainer calls the model on whole sequences: each rank needs its "
            "own part and its tokens' global positions", "train the plan in a loop of your "
            "own that gives them (the plugin's docs show it), or drop the plugin")
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


def plan_trainer_class() -> type[PlanTrainer]:
    """:class:`PlanTrainer`, importing transformers (this module does not)."""
    from composer_par.integrations._plan_trainer import PlanTrainer

    return PlanTrainer


def __getattr__(name: str) -> Any:
    # PlanTrainer subclasses transformers.Trainer, so its module imports transformers:
    # that module is loaded when the class is first asked for.
    if name == "PlanTrainer":
        return plan_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plan_trainer(plan: ParallelPlan | str | os.PathLike[str] | None, model: nn.Module,
                 args: transformers.TrainingArguments, *, materializer: Plugin | None = None,
                 **kwargs: Any) -> PlanTrainer:
    """A :class:`PlanTrainer` from a plan, a plan file's path, an accelerate config or a
    DeepSpeed JSON (imported, the findings printed), or ``None``: the plan the Trainer's
    own ``--fsdp`` / ``--fsdp_config`` / ``--deepspeed`` / ``--bf16`` / ``--fp16`` /
    ``--gradient_checkpointing`` describe, those arguments then turned off
    (:func:`composer_par.integrations.sources.plan_from_training_args`).
    ``materializer`` (``MetaInit()``, a loader) is added to an imported plan, which has
    none, for a model built on meta."""
    from composer_par.integrations.sources import load_plan, plan_from_training_args

    if plan is None:
        plan, args, _ = plan_from_training_args(args)
        imported = True
    else:
        imported = not hasattr(plan, "use") and Path(plan).suffix.lower() != ".toml"
        plan = load_plan(plan)
    if materializer is not None:
        if not imported:
            raise TypeError("materializer= is for a plan imported from another tool's "
                            "settings; add it to your own plan with plan.use(...)")
        plan.use(materializer)
    return plan_trainer_class()(plan, model=model, args=args, **kwargs)


__all__ = ["PlanArguments", "plan_trainer", "plan_trainer_class", "trainer_findings"]
