"""Rank workers of tests/test_migrate_trainers.py: the Hugging Face Trainer and the
accelerate adapter running a plan built from their own settings."""

from __future__ import annotations

from typing import Any

from tests import accelerate_workers as aw

STEPS = 3
BY_HAND = """
[mesh]
dp_shard = 2

[[plugins]]
name = "fsdp2"
reshard_after_forward = true
blocks = ["LlamaDecoderLayer"]
"""


def _args(directory: str, **sharding: Any) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=directory, use_cpu=True, max_steps=STEPS,
        per_device_train_batch_size=aw.GLOBAL_BATCH // 2, learning_rate=aw.LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=aw.SEED, dataloader_num_workers=0,
        **sharding)


def _train(plan: Any, directory: str) -> tuple[list[float], dict[str, Any]]:
    import torch

    from composer_par.integrations.hf_trainer import plan_trainer

    aw._fresh_accelerate_state()  # before the arguments, which set accelerate's state up
    losses = aw.Losses()
    trainer = plan_trainer(plan, aw.build("hf"), _args(directory),
                           train_dataset=aw.DictRows("hf", STEPS),
                           optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": aw.LR}),
                           callbacks=[losses()])
    trainer.train()
    return losses.losses, aw._full(trainer.model)


def trainer_from_fsdp_arguments(directory: str) -> dict[str, Any]:
    """A Trainer given --fsdp (no plan file) against the same plan written by hand."""
    import torch

    from composer_par import MetaInit, ParallelPlan
    from composer_par.integrations import hf_trainer

    # The Trainer's own FSDP arguments: the plan comes from them.
    aw._fresh_accelerate_state()
    args = _args(directory + "/fsdp", fsdp="full_shard auto_wrap",
                 fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    losses = aw.Losses()
    trainer = hf_trainer.plan_trainer(
        None, aw.build("hf"), args, materializer=MetaInit(seed=aw.SEED),
        train_dataset=aw.DictRows("hf", STEPS),
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": aw.LR}), callbacks=[losses()])
    plan_text = trainer.plan.to_toml()
    trainer.train()
    imported = (losses.losses, aw._full(trainer.model))
    by_hand = _train(ParallelPlan.from_toml(BY_HAND).use(MetaInit(seed=aw.SEED)),
                     directory + "/hand")
    return {"plan": plan_text, "imported": imported, "by_hand": by_hand,
            "fsdp_left": bool(trainer.args.fsdp)}


def accelerator_from_config(path: str) -> dict[str, Any]:
    """prepare_accelerator given an accelerate config: the plan is imported from it."""
    import torch

    from composer_par.integrations.accelerate import prepare_accelerator

    aw._fresh_accelerate_state()
    with torch.device("cpu"):
        model = aw.build("llama")
    torch.manual_seed(0)
    model = model.to_empty(device="cpu")
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    accelerator, applied = prepare_accelerator(path, model, cpu=True)
    fsdp2 = accelerator.plan.plugin("fsdp2")
    result = {"reshard": fsdp2.reshard_after_forward, "blocks": list(fsdp2.blocks or ()),
              "processes": accelerator.num_processes,
              "sharded": type(next(applied.parameters())).__name__}
    aw._fresh_accelerate_state()
    return result
