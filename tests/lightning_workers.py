"""Rank-side functions of tests/test_integration_lightning.py.

Each case trains one plan on one model three ways on the same ranks: the plain loop
(``plan.training_step`` and a torch optimizer, the sampler from ``plan.data_shard()``),
Lightning Fabric with :class:`FabricStrategy` and the Lightning Trainer with
:class:`TrainerStrategy`. Every epoch is one step on a shuffled data set of one global
batch (``DistributedSampler.set_epoch`` reshuffles it), so that a Trainer resumed at an
epoch boundary sees the batches an uninterrupted run sees. lightning and transformers are
imported inside the functions: once per rank process.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

STEPS = 5
SAVE_AT = 3  # the checkpoint is taken after this many steps
GLOBAL_BATCH = 8
SEQ = 16
LR = 0.05
MOMENTUM = 0.9
CLIP = 1.0
SEED = 7


# -- models, plans, data --------------------------------------------------------------------


def build(kind: str) -> Any:
    """The case's model, built where the caller's device context says (meta)."""
    if kind == "hf_llama":
        import transformers

        from tests.hf_workers import config

        return transformers.LlamaForCausalLM(config("llama"))
    from composer_par.testing.tasks import LlamaTask

    return LlamaTask(seq_len=SEQ).build()


def vocab(kind: str) -> int:
    return 128 if kind == "hf_llama" else 256


def make_plan(name: str, world: int = 4) -> Any:
    from composer_par import FSDP2, HSDP, PP, TP, MeshSpec, MetaInit, ParallelPlan

    init = MetaInit(seed=SEED)
    if name == "fsdp2_tp":
        return ParallelPlan(MeshSpec(dp_shard=world // 2, tp=2)).use(FSDP2()).use(TP()).use(init)
    if name == "hsdp_fsdp2":
        return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=world // 2)).use(HSDP())
                .use(FSDP2()).use(init))
    if name == "fsdp2_bf16":
        return ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2(mixed_precision="bfloat16")
                                                          ).use(init)
    if name == "pp":
        return ParallelPlan(MeshSpec(pp=world)).use(PP()).use(init)
    if name == "pp_fsdp2":
        return (ParallelPlan(MeshSpec(pp=2, dp_shard=world // 2)).use(PP()).use(FSDP2())
                .use(init))
    raise ValueError(name)


def dataset(kind: str) -> Any:
    """One global batch of learnable sequences (arithmetic, modulo the vocabulary)."""
    import torch
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1234)
    size = vocab(kind)
    start = torch.randint(3, size, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return TensorDataset((start + stride * torch.arange(SEQ)) % size)


def loss_fn(outputs: Any, tokens: Any) -> Any:
    from composer_par.models.llama import next_token_loss

    return next_token_loss(getattr(outputs, "logits", outputs), tokens)


def per_rank_batch(plan: Any) -> int:
    return GLOBAL_BATCH // plan.data_shard()[1]


def epoch_loader(kind: str, plan: Any, epoch: int, sampler_kwargs: dict[str, Any]) -> Any:
    """The loader of one epoch as a user builds it by hand (shuffled, seed 0 as
    Lightning's samplers use by default)."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = dataset(kind)
    sampler = DistributedSampler(data, shuffle=True, seed=0, **sampler_kwargs)
    sampler.set_epoch(epoch)
    return DataLoader(data, batch_size=per_rank_batch(plan), sampler=sampler)


def optimizer(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def full(model: Any) -> dict[str, Any]:
    from composer_par.testing.parity import full_parameters

    return full_parameters(model)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How far two full parameter sets are apart: the largest difference, whether they
    are bitwise equal and within the fp32 tolerance."""
    import torch

    from composer_par.testing.parity import ATOL, RTOL

    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    worst, where, close, same = 0.0, "", True, True
    for name in a:
        diff = float((a[name] - b[name]).abs().max()) if a[name].numel() else 0.0
        if diff > worst:
            worst, where = diff, name
        same = same and torch.equal(a[name], b[name])
        close = close and torch.allclose(a[name], b[name], rtol=RTOL, atol=ATOL)
    return {"max_diff": worst, "where": where, "bitwise": same, "close": close,
            "count": len(a)}


# -- the three loops --------------------------------------------------------------------------


def plain(kind: str, plan_name: str, save_dir: str) -> dict[str, Any]:
    """The plan's own loop: plan.apply, plan.training_step, clip, SGD; a composer_par
    checkpoint after SAVE_AT steps."""
    import torch

    from composer_par import checkpoint

    plan = make_plan(plan_name)
    with torch.device("meta"):
        model = build(kind)
    model = plan.apply(model)
    opt = optimizer(model.parameters())
    step = plan.training_step(model, loss_fn)
    index, count = plan.data_shard()
    losses, at_save = [], {}
    for epoch in range(STEPS):
        for (tokens,) in epoch_loader(kind, plan, epoch, {"num_replicas": count, "rank": index}):
            losses.append(float(step.step(tokens, tokens)))
            step.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        if epoch + 1 == SAVE_AT:
            checkpoint.save(save_dir, model, opt, extra={"epoch": SAVE_AT}, plan=plan)
            at_save = full(model)
    return {"losses": losses, "final": full(model), "at_save": at_save}


def fabric_run(kind: str, plan_name: str, save_dir: str, *, start: int = 0,
               load_dir: str | None = None) -> dict[str, Any]:
    """The same through Fabric; from ``start`` after loading ``load_dir`` when given."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from composer_par.integrations.lightning import FabricStrategy

    plan = make_plan(plan_name)
    fabric = Fabric(strategy=FabricStrategy(plan), devices=4, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = build(kind)
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(optimizer(model.parameters()))
    index, count = plan.data_shard()
    out: dict[str, Any] = {
        "on_meta": on_meta,
        "sampler": fabric.strategy.distributed_sampler_kwargs == {"num_replicas": count,
                                                                 "rank": index},
        "mesh": tuple(fabric.strategy.device_mesh.mesh_dim_names),
        "plans_mesh": fabric.strategy.device_mesh is plan._device_mesh,
    }
    state: dict[str, Any] = {"model": model, "optimizer": opt, "epoch": 0}
    if load_dir is not None:
        fabric.load(load_dir, state)
        out["loaded_epoch"] = state["epoch"]
        out["loaded"] = full(model._forward_module)
    losses, at_save = [], {}
    if start == 0:
        # Fabric's own sampler: num_replicas and rank from the strategy, reshuffled on
        # every pass over the loader.
        loader = fabric.setup_dataloaders(DataLoader(dataset(kind), shuffle=True,
                                                     batch_size=per_rank_batch(plan)))
        epochs: Any = ((epoch, loader) for epoch in range(STEPS))
    else:
        kwargs = fabric.strategy.distributed_sampler_kwargs
        epochs = ((epoch, epoch_loader(kind, plan, epoch, kwargs))
                  for epoch in range(start, STEPS))
    for epoch, batches in epochs:
        for (tokens,) in batches:
            loss = loss_fn(model(tokens), tokens)
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=CLIP)
            opt.step()
            opt.zero_grad()
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        if epoch + 1 == SAVE_AT and start == 0:
            fabric.save(save_dir, {"model": model, "optimizer": opt, "epoch": SAVE_AT})
            at_save = full(model._forward_module)
    out.update(losses=losses, final=full(model._forward_module), at_save=at_save)
    return out


def fabric_pipeline(kind: str, plan_name: str, save_dir: str) -> dict[str, Any]:
    """A pipeline plan through Fabric: the step through fabric.strategy.training_step;
    the model's forward alone is refused."""
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from composer_par.integrations.lightning import FabricStrategy

    plan = make_plan(plan_name)
    fabric = Fabric(strategy=FabricStrategy(plan), devices=4, accelerator="cpu")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = build(kind)
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(optimizer(model.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(dataset(kind), shuffle=True,
                                                 batch_size=per_rank_batch(plan)))
    refused = ""
    try:
        model(next(iter(dataset(kind)))[0][None])
    except RuntimeError as exc:
        refused = str(exc)
    step = fabric.strategy.training_step(model, loss_fn)
    losses, at_save = [], {}
    for epoch in range(STEPS):
        for (tokens,) in loader:
            losses.append(float(step.step(tokens, tokens)))
            fabric.clip_gradients(model, opt, max_norm=CLIP)
            opt.step()
            opt.zero_grad()
        if epoch + 1 == SAVE_AT:
            fabric.save(save_dir, {"model": model, "optimizer": opt, "epoch": SAVE_AT})
            at_save = full(model._forward_module)
    return {"losses": losses, "final": full(model._forward_module), "at_save": at_save,
            "refused": "fabric.strategy.training_step" in refused}


def load_plain(kind: str, plan_name: str, load_dir: str) -> dict[str, Any]:
    """A Fabric checkpoint read by composer_par.checkpoint.load, outside Lightning."""
    import torch

    from composer_par import checkpoint

    plan = make_plan(plan_name)
    with torch.device("meta"):
        model = build(kind)
    model = plan.apply(model)
    opt = optimizer(model.parameters())
    info = checkpoint.load(load_dir, model, opt)
    return {"loaded": full(model), "extra": info.extra}


def _lit_module(kind: str) -> Any:
    import lightning as L
    import torch.distributed as dist

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.losses: list[float] = []
            self.val_losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build(kind)
                self.built_on_meta = all(p.is_meta for p in self.model.parameters())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            loss = loss_fn(self.model(tokens), tokens)
            total = loss.detach().clone()
            dist.all_reduce(total)
            self.losses.append(float(total) / dist.get_world_size())
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            (tokens,) = batch
            self.val_losses.append(float(loss_fn(self.model(tokens), tokens)))

        def configure_optimizers(self) -> Any:
            return optimizer(self.model.parameters())

        def train_dataloader(self) -> Any:
            from torch.utils.data import DataLoader

            return DataLoader(dataset(kind), shuffle=True,
                              batch_size=per_rank_batch(self.trainer.strategy.plan))

    return Lit()


def trainer_run(kind: str, plan_name: str, save_dir: str, *, resume: bool = False
                ) -> dict[str, Any]:
    """The same through the Lightning Trainer (no configure_model parallelism written);
    resumed from ``save_dir`` when ``resume``."""
    import lightning as L

    from composer_par.integrations.lightning import TrainerStrategy

    class SaveAt(L.Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch + 1 == SAVE_AT:
                trainer.save_checkpoint(save_dir)
                pl_module.at_save = full(pl_module.model)

    plan = make_plan(plan_name)
    lit = _lit_module(kind)
    lit.at_save = {}
    trainer = L.Trainer(strategy=TrainerStrategy(plan), devices=4, accelerator="cpu",
                        max_epochs=STEPS, gradient_clip_val=CLIP, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[] if resume else [SaveAt()])
    trainer.fit(lit, ckpt_path=save_dir if resume else None)
    final = full(lit.model)
    # Lightning sets the strategy up again for validate: the trained model is kept as it
    # is (this rank reads its validation shard, whole, from the same sampler kwargs).
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    data = dataset(kind)
    trainer.validate(lit, DataLoader(data, batch_size=GLOBAL_BATCH), verbose=False)
    shard = DistributedSampler(data, shuffle=False, **trainer.strategy.distributed_sampler_kwargs)
    (mine,) = next(iter(DataLoader(data, batch_size=GLOBAL_BATCH, sampler=shard)))
    with torch.no_grad():
        expected = float(loss_fn(lit.model(mine), mine))
    return {"losses": lit.losses, "final": final, "at_save": lit.at_save,
            "global_step": trainer.global_step, "built_on_meta": lit.built_on_meta,
            "validated": lit.val_losses == [expected],
            "unchanged": compare(full(lit.model), final)["bitwise"]}


def trainer_refusals() -> dict[str, list[str]]:
    """Trainer set-ups refused at setup, before the plan touches the model."""
    import lightning as L
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from composer_par.integrations.errors import IntegrationError
    from composer_par.integrations.lightning import TrainerStrategy

    codes: dict[str, list[str]] = {}

    def refused(name: str, lit: Any) -> None:
        plan = make_plan("hsdp_fsdp2")
        trainer = L.Trainer(strategy=TrainerStrategy(plan), devices=4, accelerator="cpu",
                            max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        try:
            trainer.fit(lit)
        except IntegrationError as exc:
            codes[name] = exc.report.codes()
        else:
            codes[name] = []

    outside = _lit_module("llama")
    outside.scale = nn.Parameter(torch.ones(1))  # not in .model
    refused("outside", outside)

    sharded = _lit_module("llama")

    def configure_model() -> None:  # the user's own parallelism, as ModelParallelStrategy asks
        with torch.device("cpu"):
            sharded.model = build("llama")
        fully_shard(sharded.model)

    sharded.configure_model = configure_model
    refused("configure_model", sharded)
    return codes


# -- the launches -------------------------------------------------------------------------------


def run_all(root: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Every case on this rank; the comparisons (small) come back, not the tensors."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for kind, plan_name in cases:
        key = f"{kind}/{plan_name}"
        base = Path(root) / kind / plan_name
        try:
            ref = plain(kind, plan_name, str(base / "plain"))
            fab = fabric_run(kind, plan_name, str(base / "fabric"))
            resumed = fabric_run(kind, plan_name, str(base / "unused"), start=SAVE_AT,
                                 load_dir=str(base / "fabric"))
            crossed = fabric_run(kind, plan_name, str(base / "unused2"), start=STEPS,
                                 load_dir=str(base / "plain"))
            outside = load_plain(kind, plan_name, str(base / "fabric"))
            tr = trainer_run(kind, plan_name, str(base / "trainer"))
            tr_resumed = trainer_run(kind, plan_name, str(base / "trainer"), resume=True)
            tr_outside = load_plain(kind, plan_name, str(base / "trainer"))
            results[key] = {
                "plain_losses": ref["losses"],
                "fabric": {k: fab[k] for k in ("on_meta", "sampler", "mesh", "plans_mesh",
                                               "losses")},
                "fabric_vs_plain": compare(fab["final"], ref["final"]),
                "fabric_resumed": compare(resumed["final"], fab["final"]),
                "fabric_resumed_losses": resumed["losses"],
                "fabric_loaded_plain": compare(crossed["loaded"], ref["at_save"]),
                "fabric_loaded_epoch": crossed["loaded_epoch"],
                "plain_loaded_fabric": compare(outside["loaded"], fab["at_save"]),
                "plain_loaded_extra": outside["extra"],
                "trainer_losses": tr["losses"],
                "trainer_vs_plain": compare(tr["final"], ref["final"]),
                "trainer_steps": tr["global_step"],
                "trainer_built_on_meta": tr["built_on_meta"],
                "trainer_validated": tr["validated"] and tr["unchanged"],
                "trainer_resumed": compare(tr_resumed["final"], tr["final"]),
                "trainer_resumed_losses": tr_resumed["losses"],
                "trainer_resumed_steps": tr_resumed["global_step"],
                "plain_loaded_trainer": compare(tr_outside["loaded"], tr["at_save"]),
                "plain_loaded_trainer_epoch": (tr_outside["extra"] or {}).get("epoch"),
            }
        except Exception:
            results[key] = {"error": traceback.format_exc()}
            raise
    base = Path(root) / "pipeline"
    ref = plain("llama", "pp_fsdp2", str(base / "plain"))
    fab = fabric_pipeline("llama", "pp_fsdp2", str(base / "fabric"))
    outside = load_plain("llama", "pp_fsdp2", str(base / "fabric"))
    results["pipeline"] = {
        "plain_losses": ref["losses"], "fabric_losses": fab["losses"],
        "forward_refused": fab["refused"],
        "fabric_vs_plain": compare(fab["final"], ref["final"]),
        "plain_loaded_fabric": compare(outside["loaded"], fab["at_save"]),
    }
    results["refusals"] = trainer_refusals()
    results["rank"] = dist.get_rank()
    results["pid"] = os.getpid()
    return results


# -- Lightning launching its own processes ------------------------------------------------------


def launched_by_fabric() -> dict[str, Any]:
    """``python -m tests.lightning_workers OUT_DIR``: Fabric starts the second process itself and
    initializes the process group (gloo, the plan's timeout), as in a user's script; both
    ranks train a plan through Fabric and through the plain loop and compare."""
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.integrations.lightning import FabricStrategy

    def plan() -> Any:
        return ParallelPlan(MeshSpec(dp_shard=2), timeout=120).use(FSDP2()).use(
            MetaInit(seed=SEED))

    fabric = Fabric(strategy=FabricStrategy(plan()), devices=2, accelerator="cpu")
    fabric.launch()
    tokens = dataset("llama").tensors[0]
    index, count = fabric.strategy.plan.data_shard()
    with fabric.init_module(empty_init=True):
        model = build("llama")
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(optimizer(model.parameters()))
    plain_plan = plan()
    with torch.device("meta"):
        reference = build("llama")
    reference = plain_plan.apply(reference)
    ref_opt = optimizer(reference.parameters())
    step = plain_plan.training_step(reference, loss_fn)
    losses, ref_losses = [], []
    local = tokens.chunk(count)[index]
    for _ in range(3):
        loss = loss_fn(model(local), local)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        ref_losses.append(float(step.step(local, local)))
        ref_opt.step()
        ref_opt.zero_grad()
    refused = []
    try:  # the plan replaces the parameters an optimizer built before would hold
        fabric.setup(build("llama"), optimizer(model.parameters()))
    except RuntimeError as exc:
        refused.append("setup" if "setup_module" in str(exc) else str(exc))
    try:
        fabric.save("unused", {"model": model}, filter={"model": lambda key, value: True})
    except TypeError as exc:
        refused.append("filter" if "filter" in str(exc) else str(exc))
    from composer_par.plugin import torch_private

    wait = torch_private.group_timeout(torch_private.default_group(), "cpu")
    return {"rank": dist.get_rank(), "world": dist.get_world_size(),
            "backend": dist.get_backend(), "timeout_s": wait.total_seconds() if wait else None,
            "losses": losses, "ref_losses": ref_losses, "refused": refused,
            "same": compare(full(model._forward_module), full(reference))}


if __name__ == "__main__":
    import json
    import sys

    # One file per rank: two processes printing to one pipe can interleave their lines.
    result = launched_by_fabric()
    Path(sys.argv[1], f"rank{result['rank']}.json").write_text(json.dumps(result))
    # Left to interpreter exit, gloo's threads can abort the process ("terminate called
    # without an active exception") under load: both ranks finish, then tear down.
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
