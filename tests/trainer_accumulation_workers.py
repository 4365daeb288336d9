"""Rank-side functions of tests/test_trainer_accumulation.py: the FSDP2 plan (on 2 ranks)
or HSDP x FSDP2 (2 x 2, on 4 ranks) trained with gradient accumulation through the
Lightning Trainer, Lightning Fabric's ``no_backward_sync``, accelerate's ``accumulate``
and the Hugging Face Trainer, next to the plan's own loop over the same global batches in
one step each.

Every case runs on one process group, in sequence, and builds its plan afresh. Each
records the collectives of every microbatch (forward and backward) by kind.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Any

STEPS = 3
ACCUMULATE = 4  # microbatches of one sequence per optimizer step, on every rank
LR = 0.05


def _world() -> int:
    """The ranks, every one a data shard of its own under both plans."""
    import torch.distributed as dist

    return int(dist.get_world_size())


def _plan() -> Any:
    from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan

    if _world() == 4:
        plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
    else:
        plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
    return plan.use(MetaInit(seed=0))


def _task() -> Any:
    import attrs

    from composer_par.testing.tasks import llama

    return attrs.evolve(llama, global_batch=ACCUMULATE * _world())


def _build(kind: str) -> Any:
    import torch

    if kind == "hf":
        from tests import hf_workers

        return hf_workers.build("llama")
    with torch.device("meta"):
        return _task().build()


def _global_batch(kind: str, step: int) -> Any:
    if kind == "hf":
        from tests import hf_workers

        return hf_workers.batch("llama", step, size=ACCUMULATE * _world())["input_ids"]
    return _task().batch(step)


def _rows(kind: str) -> Any:
    """Every global batch's sequences, ordered for a loader of one sequence per batch
    sharded over ``n`` data shards (shard ``r`` reads rows ``r, r + n, ...``, both the
    Lightning sampler's and accelerate's sharding): step ``s``'s microbatches on shard
    ``r`` are the ``r``-th part of global batch ``s``, in order, as
    :func:`one_step_each` cuts it."""
    import torch

    n = _world()
    parts = [_global_batch(kind, s).chunk(n) for s in range(STEPS)]
    return torch.stack([parts[s][r][j] for s in range(STEPS)
                        for j in range(ACCUMULATE) for r in range(n)])


def _loss(kind: str, model: Any, ids: Any) -> Any:
    if kind == "hf":
        return model(input_ids=ids, labels=ids).loss
    from composer_par.models.llama import next_token_loss

    return next_token_loss(model(ids), ids)


def _full(model: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def _kinds(counter: Any) -> dict[str, int]:
    return dict(Counter(call.kind for call in counter.calls))


def _fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# -- the reference: the plan's own loop, the global batch in one step ---------------------


def one_step_each(kind: str) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``plan.training_step`` without accumulation."""
    import torch

    plan = _plan()
    model = plan.apply(_build(kind))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if kind == "hf":
        step = plan.training_step(model, lambda outputs, _ids: outputs.loss)
    else:
        from composer_par.models.llama import next_token_loss

        step = plan.training_step(model, next_token_loss)
    index, count = plan.data_shard()
    for s in range(STEPS):
        ids = _global_batch(kind, s).chunk(count)[index]
        if kind == "hf":
            step.step((), ids, input_ids=ids, labels=ids)
        else:
            step.step(ids, ids)
        optimizer.step()
        optimizer.zero_grad()
    return {"params": _full(model)}


# -- the adapters ---------------------------------------------------------------------------


def lightning_trainer(sync: str) -> dict[str, Any]:
    """``Trainer(accumulate_grad_batches=4)`` with ``TrainerStrategy(plan,
    gradient_sync=sync)``."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from composer_par.integrations.lightning import TrainerStrategy
    from composer_par.testing.comm_count import CommCounter

    counts: list[dict[str, int]] = []

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = _build("llama")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (ids,) = batch
            return _loss("llama", self.model, ids)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.model.parameters(), lr=LR)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(_rows("llama")), batch_size=1)

    class Count(L.Callback):
        # Each batch's forward and backward; the optimizer step of the 4th runs inside too.
        def on_train_batch_start(self, *args: Any) -> None:
            self.counter = CommCounter()
            self.counter.__enter__()

        def on_train_batch_end(self, *args: Any) -> None:
            self.counter.__exit__(None, None, None)
            counts.append(_kinds(self.counter))

    lit = Lit()
    # The collectives counted are the training's own: the replica check left out.
    strategy = TrainerStrategy(_plan(), gradient_sync=sync, check_replicas_every=None)
    trainer = L.Trainer(strategy=strategy, devices=_world(),
                        accelerator="cpu", max_epochs=1, accumulate_grad_batches=ACCUMULATE,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[Count()])
    trainer.fit(lit)
    return {"params": _full(lit.model), "counts": counts, "steps": trainer.global_step}


def fabric_no_backward_sync(sync: str) -> dict[str, Any]:
    """Lightning Fabric's documented accumulation loop: ``fabric.no_backward_sync(model,
    enabled=...)`` around every microbatch but the last of each step."""
    import torch
    from lightning.fabric import Fabric

    from composer_par.integrations.lightning import FabricStrategy
    from composer_par.testing.comm_count import CommCounter

    plan = _plan()
    strategy = FabricStrategy(plan, gradient_sync=sync, check_replicas_every=None)
    fabric = Fabric(strategy=strategy, devices=_world(),
                    accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = _task().build()
    model = fabric.setup_module(model)
    optimizer: Any = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    index, count = plan.data_shard()
    counts: list[dict[str, int]] = []
    for s in range(STEPS):
        local = _global_batch("llama", s).chunk(count)[index]
        for i, ids in enumerate(local.chunk(ACCUMULATE)):
            with CommCounter() as counter, fabric.no_backward_sync(
                    model, enabled=i < ACCUMULATE - 1):
                fabric.backward(_loss("llama", model, ids) / ACCUMULATE)
            counts.append(_kinds(counter))
        optimizer.step()
        optimizer.zero_grad()
    return {"params": _full(model._forward_module), "counts": counts}


def accelerate_accumulate(sync: str) -> dict[str, Any]:
    """accelerate's documented loop: ``with accelerator.accumulate(model):`` around every
    microbatch, ``Accelerator(gradient_accumulation_steps=4)``."""
    import torch

    from composer_par.integrations.accelerate import prepare_accelerator
    from composer_par.testing.comm_count import CommCounter

    _fresh_accelerate_state()
    plan = _plan()
    accelerator, model = prepare_accelerator(plan, _build("llama"), gradient_sync=sync,
                                             check_replicas_every=None,
                                             gradient_accumulation_steps=ACCUMULATE)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    index, count = plan.data_shard()
    counts: list[dict[str, int]] = []
    for s in range(STEPS):
        for ids in _global_batch("llama", s).chunk(count)[index].chunk(ACCUMULATE):
            with CommCounter() as counter, accelerator.accumulate(model):
                accelerator.backward(_loss("llama", model, ids))
                optimizer.step()
                optimizer.zero_grad()
            counts.append(_kinds(counter))
    _fresh_accelerate_state()
    return {"params": _full(model), "counts": counts}


def hf_trainer(sync: str, directory: str) -> dict[str, Any]:
    """The Hugging Face Trainer, ``gradient_accumulation_steps=4``, through ``PlanTrainer(
    plan, gradient_sync=sync)``; the collectives counted per optimizer step."""
    import torch
    import transformers

    from composer_par.integrations.hf_trainer import PlanTrainer
    from composer_par.testing.comm_count import CommCounter

    counts: list[dict[str, int]] = []

    class Count(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.counter = CommCounter()
            self.counter.__enter__()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.counter.__exit__(None, None, None)
            counts.append(_kinds(self.counter))

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        rows = _rows("hf")

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> Any:
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    _fresh_accelerate_state()
    args = transformers.TrainingArguments(
        output_dir=directory, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=1,
        gradient_accumulation_steps=ACCUMULATE, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        train_sampling_strategy="sequential", save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = PlanTrainer(_plan(), model=_build("hf"), args=args, gradient_sync=sync,
                          check_replicas_every=None,
                          train_dataset=Rows(),
                          optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": LR}),
                          callbacks=[Count()])
    trainer.train()
    params = _full(trainer.model)
    _fresh_accelerate_state()
    return {"params": params, "counts": counts, "steps": trainer.state.global_step}


def run_all(directory: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Each ``(adapter, sync)`` case and the references, by name; a case that raises
    leaves its traceback."""
    runs = {
        "reference/llama": lambda _: one_step_each("llama"),
        "reference/hf": lambda _: one_step_each("hf"),
        "lightning_trainer": lightning_trainer,
        "fabric": fabric_no_backward_sync,
        "accelerate": accelerate_accumulate,
        "hf_trainer": lambda sync: hf_trainer(sync, f"{directory}/hf-{sync}"),
    }
    out: dict[str, Any] = {}
    environ = dict(os.environ)
    references = sorted({"reference/hf" if adapter == "hf_trainer" else "reference/llama"
                         for adapter, _ in cases})
    for adapter, sync in [(reference, "") for reference in references] + cases:
        key = f"{adapter}/{sync}" if sync else adapter
        # Lightning's launchers rewrite the launch variables (WORLD_SIZE and others): each
        # case starts from the environment the ranks were started with.
        os.environ.clear()
        os.environ.update(environ)
        try:
            out[key] = runs[adapter](sync)
        except Exception:
            out[key] = {"error": traceback.format_exc()}
    return out
