"""Rank-side functions of tests/test_resumes.py: runs stopped or checkpointed mid-epoch
and resumed, through the Lightning Trainer and the Hugging Face Trainer, against the same
run uninterrupted. Every function returns each rank's full parameters compared (bitwise)
with the uninterrupted run's, not the tensors themselves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.lightning_workers import compare, full

SEED = 7
SAMPLES = 24
PER_RANK_BATCH = 2
EPOCHS = 2
BATCHES_PER_EPOCH = SAMPLES // 2 // PER_RANK_BATCH  # 2 data shards
STEPS = EPOCHS * BATCHES_PER_EPOCH
KILLED_AT = 4  # a checkpoint taken after this step (epoch 0, batch 4 of 6)
STOPPED_AT = 8  # a run stopped by max_steps here (epoch 1, batch 2 of 6)


# -- Lightning ----------------------------------------------------------------------------


def _plan() -> Any:
    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan

    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit(seed=SEED))


def _sequences(vocab: int) -> Any:
    """Learnable sequences (arithmetic, modulo the vocabulary), one per sample."""
    import torch
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1234)
    start = torch.randint(3, vocab, (SAMPLES, 1), generator=gen)
    stride = torch.randint(1, 4, (SAMPLES, 1), generator=gen)
    return TensorDataset((start + stride * torch.arange(16)) % vocab)


def _lit_module() -> Any:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from composer_par.models.llama import next_token_loss
    from composer_par.testing.tasks import LlamaTask

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = LlamaTask(seq_len=16).build()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            loss = next_token_loss(self.model(tokens), tokens)
            total = loss.detach().clone()
            dist.all_reduce(total)
            self.losses.append(float(total) / dist.get_world_size())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> Any:
            # The user's ordinary loader: the strategy shards it (plan.data_shard()) and
            # gives it its position in the epoch.
            return DataLoader(_sequences(256), shuffle=True, batch_size=PER_RANK_BATCH)

    return Lit()


def _fit(*, max_steps: int = -1, save_at: tuple[int, str] | None = None,
         ckpt_path: str | None = None, callbacks: tuple[Any, ...] = ()) -> tuple[Any, Any]:
    import lightning as L

    from composer_par.integrations.lightning import TrainerStrategy

    class SaveAfterStep(L.Callback):
        """As ModelCheckpoint(every_n_train_steps=...) saves: after the step's batch."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if save_at is not None and trainer.global_step == save_at[0]:
                trainer.save_checkpoint(save_at[1])

    lit = _lit_module()
    trainer = L.Trainer(strategy=TrainerStrategy(_plan()), devices=2, accelerator="cpu",
                        max_epochs=EPOCHS, max_steps=max_steps, logger=False,
                        enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[SaveAfterStep(), *callbacks])
    trainer.fit(lit, ckpt_path=ckpt_path)
    return trainer, lit


def lightning_resumes(root: str) -> dict[str, Any]:
    """An uninterrupted run (checkpointed after step KILLED_AT, as a run killed later
    would have left it), a run stopped by max_steps at STOPPED_AT with Lightning's
    ModelCheckpoint saving its last step, and each resumed with ckpt_path: the resumed
    runs must end bitwise where the whole one does, having trained the whole one's
    remaining batches (its losses)."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    killed = str(Path(root) / "killed")
    stopped = str(Path(root) / "stopped")
    whole_trainer, whole = _fit(save_at=(KILLED_AT, killed))
    final = full(whole.model)
    out: dict[str, Any] = {"rank": dist.get_rank(), "whole_steps": whole_trainer.global_step,
                           "whole_losses": whole.losses}
    trainer, lit = _fit(ckpt_path=killed)
    out["killed"] = {"same": compare(full(lit.model), final), "losses": lit.losses,
                     "steps": trainer.global_step}
    saver = ModelCheckpoint(dirpath=stopped, every_n_train_steps=STOPPED_AT, save_top_k=-1)
    trainer, lit = _fit(max_steps=STOPPED_AT, callbacks=(saver,))
    out["stopped_steps"] = trainer.global_step
    out["stopped_saved"] = sorted(os.listdir(stopped))
    trainer, lit = _fit(ckpt_path=saver.last_model_path or saver.best_model_path)
    out["stopped"] = {"same": compare(full(lit.model), final), "losses": lit.losses,
                      "steps": trainer.global_step}
    return out




# -- the Hugging Face Trainer ----------------------------------------------------------------

HF_STEPS = 6
HF_SAVE_AT = 3  # mid-epoch: an epoch is 4 steps (32 samples, 8 a step)
HF_LR = 5e-3


def _plan_trainer(directory: str, save: bool) -> Any:
    import transformers

    from composer_par.integrations.hf_trainer import PlanTrainer
    from tests import accelerate_workers as acc
    from tests import hf_workers

    acc._fresh_accelerate_state()
    args = transformers.TrainingArguments(
        output_dir=directory, use_cpu=True, max_steps=HF_STEPS,
        per_device_train_batch_size=4, learning_rate=HF_LR, lr_scheduler_type="linear",
        warmup_steps=0, max_grad_norm=0.5, logging_steps=1, report_to="none",
        save_strategy="steps" if save else "no", save_steps=HF_SAVE_AT,
        disable_tqdm=True, seed=SEED, dataloader_num_workers=0)
    return PlanTrainer(_plan(), model=hf_workers.build("llama"), args=args,
                       train_dataset=acc.DictRows("hf", 4))


def hf_resumes(root: str) -> dict[str, Any]:
    """A PlanTrainer run of HF_STEPS steps (AdamW, a linear schedule, shuffled data),
    checkpointed at HF_SAVE_AT; the plain loop loads that checkpoint with
    composer_par.checkpoint.load (bitwise the Trainer's state at that step) and saves it
    with composer_par.checkpoint.save; a PlanTrainer resumed from that directory ends
    bitwise where the uninterrupted run ends."""
    import torch
    import torch.distributed as dist
    import transformers

    from composer_par import checkpoint
    from tests import accelerate_workers as acc
    from tests import hf_workers

    snapshots: dict[int, Any] = {}

    class Snapshot(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == HF_SAVE_AT:
                snapshots[HF_SAVE_AT] = acc._local_state(kwargs["model"], kwargs["optimizer"])

    whole = _plan_trainer(os.path.join(root, "whole"), save=True)
    whole.add_callback(Snapshot())
    whole.train()
    final = acc._local_state(whole.model, whole.optimizer)
    out: dict[str, Any] = {"rank": dist.get_rank(), "whole_steps": whole.state.global_step}

    # the user's loop reads the Trainer's checkpoint
    plan = _plan()
    model = plan.apply(hf_workers.build("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR)
    info = checkpoint.load(os.path.join(root, "whole", f"checkpoint-{HF_SAVE_AT}"), model,
                           optimizer)
    out["plain_loaded"] = acc._bitwise(snapshots[HF_SAVE_AT], acc._local_state(model, optimizer))
    out["plain_step"] = info.step
    out["plain_scheduler_step"] = info.extra["trainer"]["scheduler"]["last_epoch"]

    # ... and writes its own; the Trainer resumes from that
    plain_dir = os.path.join(root, "plain")
    checkpoint.save(plain_dir, model, optimizer, step=info.step)
    resumed = _plan_trainer(os.path.join(root, "resumed"), save=False)
    resumed.train(resume_from_checkpoint=plain_dir)
    out["resumed_steps"] = resumed.state.global_step
    out["resumed"] = acc._bitwise(final, acc._local_state(resumed.model, resumed.optimizer))
    out["resumed_lr"] = resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()
    acc._fresh_accelerate_state()
    return out
