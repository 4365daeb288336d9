"""Rank-side functions of tests/test_replica_default.py: the replica check on by default.

Each case applies FSDP2 x TP (dp_shard 2 x tp 2) to a small model, moves the final
norm's weight (replicated over tp) on tp coordinate 1 only, then takes a step the way a
user of that entry point writes it, with no replica option given: ``plan.training_step``,
the accelerate adapter, the Hugging Face Trainer, Lightning Fabric and the Lightning
Trainer. What each rank raised is returned.
"""

from __future__ import annotations

import traceback
from typing import Any

SEED = 7


def _plan() -> Any:
    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan

    return (ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(FSDP2()).use(TP())
            .use(MetaInit(seed=SEED)))


def _llama() -> Any:
    import torch

    from composer_par.testing.tasks import LlamaTask

    with torch.device("meta"):
        return LlamaTask(seq_len=8).build()


def _tokens(plan: Any) -> Any:
    from composer_par.testing.tasks import LlamaTask

    index, count = plan.data_shard()
    return LlamaTask(seq_len=8, global_batch=4).batch(0).chunk(count)[index]


def nudge(model: Any, name: str, plan: Any) -> None:
    """Move ``name`` (a parameter replicated over tp) on tp coordinate 1 only."""
    import torch
    import torch.distributed as dist

    if plan.mesh.coordinate(dist.get_rank())["tp"] == 1:
        with torch.no_grad():
            dict(model.named_parameters())[name].to_local().add_(1e-3)


def _outcome(run: Any) -> dict[str, Any]:
    from composer_par import ReplicaDriftError

    try:
        run()
    except ReplicaDriftError as exc:
        return {"raised": type(exc).__name__, "drifts": exc.drifts, "message": str(exc)}
    except Exception as exc:  # anything else is the case's failure, shown whole
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, ReplicaDriftError):  # a trainer wrapping it
            return {"raised": type(inner).__name__, "drifts": inner.drifts,
                    "message": str(inner)}
        return {"raised": type(exc).__name__, "error": traceback.format_exc()[-3000:]}
    return {"raised": None}


def training_step(opt_out: bool = False) -> dict[str, Any]:
    import torch

    from composer_par.models.llama import next_token_loss

    plan = _plan()
    model = plan.apply(_llama())
    nudge(model, "norm.weight", plan)
    options = {"check_replicas_every": None} if opt_out else {}
    step = plan.training_step(model, next_token_loss, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = _tokens(plan)

    def run() -> None:
        step.step(tokens, tokens)
        optimizer.step()
        optimizer.zero_grad()

    return _outcome(run)


def accelerate_loop() -> dict[str, Any]:
    import torch

    from composer_par.integrations.accelerate import prepare_accelerator
    from composer_par.models.llama import next_token_loss
    from tests.accelerate_workers import _fresh_accelerate_state

    _fresh_accelerate_state()
    plan = _plan()
    accelerator, model = prepare_accelerator(plan, _llama())
    nudge(model, "norm.weight", plan)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = _tokens(plan)

    def run() -> None:
        accelerator.backward(next_token_loss(model(tokens), tokens))
        optimizer.step()
        optimizer.zero_grad()

    return _outcome(run)


def hf_trainer() -> dict[str, Any]:
    import tempfile

    import torch
    import transformers

    from composer_par.integrations.hf_trainer import PlanTrainer
    from tests import hf_workers
    from tests.accelerate_workers import DictRows, _fresh_accelerate_state

    _fresh_accelerate_state()
    plan = _plan()
    with tempfile.TemporaryDirectory() as directory:
        args = transformers.TrainingArguments(
            output_dir=directory, use_cpu=True, max_steps=2, per_device_train_batch_size=2,
            learning_rate=0.1, save_strategy="no", report_to="none", disable_tqdm=True,
            seed=SEED, dataloader_num_workers=0, logging_steps=1)
        trainer = PlanTrainer(plan, model=hf_workers.build("llama"), args=args,
                              train_dataset=DictRows("hf", 2),
                              optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
        nudge(trainer.model, "model.norm.weight", plan)
        return _outcome(trainer.train)


def fabric_loop() -> dict[str, Any]:
    import torch
    from lightning.fabric import Fabric

    from composer_par.integrations.lightning import FabricStrategy
    from composer_par.models.llama import next_token_loss

    plan = _plan()
    fabric = Fabric(strategy=FabricStrategy(plan), devices=4, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        from composer_par.testing.tasks import LlamaTask

        model = LlamaTask(seq_len=8).build()
    model = fabric.setup_module(model)
    nudge(model._forward_module, "norm.weight", plan)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = _tokens(plan)

    def run() -> None:
        fabric.backward(next_token_loss(model(tokens), tokens))
        optimizer.step()
        optimizer.zero_grad()

    return _outcome(run)


def lightning_trainer() -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from composer_par.integrations.lightning import TrainerStrategy
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.tasks import LlamaTask

    plan = _plan()

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = LlamaTask(seq_len=8).build()

        def on_train_start(self) -> None:
            nudge(self.model, "norm.weight", plan)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            return next_token_loss(self.model(tokens), tokens)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

    data = TensorDataset(LlamaTask(seq_len=8, global_batch=8).batch(0))
    trainer = L.Trainer(strategy=TrainerStrategy(plan), devices=4, accelerator="cpu",
                        max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    return _outcome(lambda: trainer.fit(Lit(), DataLoader(data, batch_size=2)))


CASES = ("training_step", "training_step_opted_out", "accelerate", "hf_trainer", "fabric",
         "lightning_trainer")


def run_cases() -> dict[str, dict[str, Any]]:
    """Every case in one launch, the Lightning ones last (a Trainer that raised tears its
    strategy down)."""
    return {
        "training_step": training_step(),
        "training_step_opted_out": training_step(opt_out=True),
        "accelerate": accelerate_loop(),
        "hf_trainer": hf_trainer(),
        "fabric": fabric_loop(),
        "lightning_trainer": lightning_trainer(),
    }
