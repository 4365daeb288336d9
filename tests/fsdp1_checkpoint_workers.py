"""Rank workers of tests/test_migrate_fsdp1_checkpoint.py: real FSDP1
(``FullyShardedDataParallel``) trains and saves full and sharded state dicts; a plan
loads them and resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from composer_par.migrate import fsdp1_plan
from composer_par.migrate.fsdp1_checkpoint import load_fsdp1
from composer_par.models.llama import DecoderLayer
from composer_par.plugin.registry import Registry
from composer_par.testing.parity import full_parameters
from composer_par.testing.tasks import llama

LR = 0.01
STEPS_BEFORE, STEPS_AFTER = 3, 3


def _batch(step: int) -> torch.Tensor:
    """This rank's half of the global batch of ``step`` (the data-parallel shard)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = llama.batch(step)
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = llama.loss(model, _batch(step))
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def _fsdp1_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as FSDP1 expects
    model = llama.build()
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
                auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}), use_orig_params=True,
                device_id=torch.device("cpu"))  # FSDP1 on gloo ranks: CPU named outright


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        # FSDP1's names, its wrapper prefixes stripped: the model's own.
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}


def fsdp1_train_and_save(root: str, kind: str) -> dict[str, Any]:
    """FSDP1 trains STEPS_BEFORE steps, saves (``kind`` full or sharded), trains
    STEPS_AFTER more: the losses and full parameters a resume must reproduce."""
    model = _fsdp1_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, optimizer, range(STEPS_BEFORE))
    saved = _full_params(model)
    out = Path(root)
    if kind == "full":
        # torch's state-dict API on the FSDP1 model: full, FQN-keyed state dicts (the
        # format FSDP.state_dict_type(FULL_STATE_DICT) and FSDP.optim_state_dict give).
        options = StateDictOptions(full_state_dict=True)
        msd, osd = get_state_dict(model, optimizer, options=options)
        if dist.get_rank() == 0:
            torch.save(msd, out / "pytorch_model_fsdp.bin")
            torch.save(osd, out / "optimizer.bin")
    else:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, checkpoint_id=out / "pytorch_model_fsdp_0")
            dcp.save({"optimizer": FSDP.optim_state_dict(model, optimizer)},
                     checkpoint_id=out / "optimizer_0")
    dist.barrier()
    losses = _train(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {"saved": saved, "losses": losses, "final": _full_params(model)}


def _plan_model(task: Any) -> nn.Module:
    """``task``'s model under the plan FSDP1's own arguments give."""
    plan = fsdp1_plan(ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy(
        {DecoderLayer})).plan()
    plan.use(Registry().get("meta_init")(seed=123))  # other weights: the load must replace them
    with torch.device("meta"):
        model = task.build()
    return plan.apply(model)


def plan_load_and_resume(root: str, kind: str) -> dict[str, Any]:
    """A plan (from FSDP1's own arguments) loads the checkpoint and trains on."""
    model = _plan_model(llama)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out = Path(root)
    if kind == "full":
        info = load_fsdp1(out / "pytorch_model_fsdp.bin", model, optimizer,
                          optimizer_path=out / "optimizer.bin")
    else:
        info = load_fsdp1(out / "pytorch_model_fsdp_0", model, optimizer,
                          optimizer_path=out / "optimizer_0")
    loaded = full_parameters(model)
    losses = _train(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {"loaded": loaded, "losses": losses, "final": full_parameters(model),
            "kind": info.kind, "optimizer_keys": info.optimizer_keys}


def load_into_another_model(root: str) -> str:
    """A model with fewer layers than the checkpoint: the load refuses, naming the keys."""
    from composer_par.checkpoint import KeyMismatchError
    from composer_par.testing.tasks import LlamaTask

    model = _plan_model(LlamaTask(n_layers=1))
    try:
        load_fsdp1(Path(root) / "pytorch_model_fsdp.bin", model)
    except KeyMismatchError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"
