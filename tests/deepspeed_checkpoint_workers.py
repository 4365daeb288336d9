"""Rank workers of tests/test_migrate_deepspeed_checkpoint.py: real DeepSpeed (ZeRO-2 and
ZeRO-3 on gloo ranks, CPU) trains and saves; a plan loads the checkpoint and resumes.

The fixtures under tests/data/deepspeed/ were written by :func:`write_fixture` with
DeepSpeed 0.19.8 (``python -m tests.deepspeed_checkpoint_workers tests/data/deepspeed``
with DeepSpeed installed rewrites them). Beside each checkpoint, ``expected.safetensors``
holds what DeepSpeed itself says the state is, read through its own accessors
(``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``), not from the files:
the weights and AdamW moments at the save, and the parameters after STEPS_AFTER more
steps; ``expected.json`` the losses of those steps.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composer_par.testing.tasks import LlamaTask

TASK = LlamaTask(dim=16, n_heads=2, n_kv_heads=1, vocab_size=64, seq_len=8)
LR = 0.01
STEPS_BEFORE, STEPS_AFTER = 3, 3
TAG = f"global_step{STEPS_BEFORE}"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _batch(step: int) -> torch.Tensor:
    """This rank's part of the global batch of ``step`` (its data-parallel shard)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = TASK.batch(step)
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def _mean(loss: torch.Tensor) -> float:
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def deepspeed_train_and_save(root: str, stage: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-``stage`` trains STEPS_BEFORE steps, saves, and trains STEPS_AFTER
    more; returns what DeepSpeed holds at the save and after (on every rank)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = TASK.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {"train_micro_batch_size_per_gpu": TASK.global_batch // dist.get_world_size(),
              "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            loss = TASK.loss(engine, _batch(step))
            engine.backward(loss)
            engine.step()
            losses.append(_mean(loss))
        return losses

    def full(moment: str | None) -> dict[str, torch.Tensor]:
        # Collectives under ZeRO-3: every rank asks for every parameter.
        return {name: (safe_get_full_fp32_param(p) if moment is None
                       else safe_get_full_optimizer_state(p, moment)).detach().clone()
                for name, p in engine.module.named_parameters()}

    train(range(STEPS_BEFORE))
    engine.save_checkpoint(root, tag=TAG)
    expected: dict[str, torch.Tensor] = {}
    for prefix, moment in (("saved", None), *((m, m) for m in MOMENTS)):
        expected.update({f"{prefix}.{k}": v for k, v in full(moment).items()})
    losses = train(range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    expected.update({f"final.{k}": v for k, v in full(None).items()})
    return {"expected": expected, "losses": losses, "version": deepspeed.__version__}


def write_fixture(directory: str, stage: int) -> None:
    """A DeepSpeed ZeRO-``stage`` checkpoint in ``directory``, with ``expected.*``."""
    from safetensors.torch import save_file

    from composer_par.testing.distributed import run_ranks

    out = Path(directory)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    result = run_ranks(f"{__name__}:deepspeed_train_and_save", 2, args=(str(out), stage),
                       timeout=300)[0]
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's own tools
        (out / script).unlink(missing_ok=True)
    save_file(result["expected"], str(out / "expected.safetensors"))
    (out / "expected.json").write_text(json.dumps(
        {"losses": result["losses"], "stage": stage, "deepspeed": result["version"],
         "step": STEPS_BEFORE}, indent=2) + "\n")


def read_expected(directory: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """``expected.safetensors`` split by prefix (saved, exp_avg, exp_avg_sq, final), and
    ``expected.json``."""
    from safetensors.torch import load_file

    split: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(directory / "expected.safetensors")).items():
        prefix, name = key.split(".", 1)
        split.setdefault(prefix, {})[name] = value
    return split, json.loads((directory / "expected.json").read_text())


# -- groups, frozen and tied parameters, buffers, bf16 -----------------------------------


class Mixed(nn.Module):
    """What a Llama fixture lacks: a tied head, a frozen layer, a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 5)
        self.frozen = nn.Linear(5, 3).requires_grad_(False)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        out = self.frozen(torch.tanh(self.proj(hidden)) * self.scale.to(hidden.dtype))
        return out.float().pow(2).mean() + self.head(hidden).float().pow(2).mean()


def deepspeed_mixed_save(root: str, stage: int) -> dict[str, torch.Tensor]:
    """DeepSpeed ZeRO-``stage`` in bf16 trains :class:`Mixed` with two parameter groups
    (stage 3: sub-groups of a few elements, so each rank holds several flat groups) and
    saves; returns every state-dict entry as DeepSpeed holds it."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = Mixed()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    groups = [{"params": [model.embed.weight, model.proj.weight], "weight_decay": 0.1},
              {"params": [model.proj.bias], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "sub_group_size": 16},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS_BEFORE):
        loss = engine(torch.randint(0, 10, (2, 4), generator=gen))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag=TAG)
    expected = {f"saved.{k}": v for k, v in initial.items()}  # frozen and buffers stay
    # The weights only: under bf16, ZeRO-2's safe_get_full_optimizer_state fails on
    # 0.19.8 ("exp_avg not found in optimizer state fragment"); the Llama fixtures
    # check the moments.
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            expected[f"saved.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        else:  # no fp32 master: DeepSpeed keeps (and saves) the bf16 copy alone
            expected[f"saved.{name}"] = initial[name].to(p.dtype)
    expected["saved.head.weight"] = expected["saved.embed.weight"].clone()
    return expected


def write_mixed_fixture(directory: str, stage: int) -> None:
    from safetensors.torch import save_file

    from composer_par.testing.distributed import run_ranks

    out = Path(directory)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    expected = run_ranks(f"{__name__}:deepspeed_mixed_save", 2, args=(str(out), stage),
                         timeout=300)[0]
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (out / script).unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in expected.items()},
              str(out / "expected.safetensors"))
    (out / "expected.json").write_text(json.dumps({"stage": stage, "step": STEPS_BEFORE},
                                                  indent=2) + "\n")


# -- a plan loads and resumes --------------------------------------------------------------


def _plan_model() -> nn.Module:
    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(dp_shard=-1)).use(FSDP2()).use(MetaInit(seed=123))
    with torch.device("meta"):
        model = TASK.build()
    return plan.apply(model)


def plan_load_and_resume(source: str, kind: str) -> dict[str, Any]:
    """A plan loads ``source`` (``kind``: the DeepSpeed checkpoint itself, or what
    ``convert`` made of it: safetensors or DCP) and trains STEPS_AFTER steps."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from composer_par import checkpoint as ck
    from composer_par.migrate import load_deepspeed
    from composer_par.testing.parity import full_parameters

    model = _plan_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    view: dict[str, Any] = {}
    if kind == "deepspeed":
        view["stage"] = load_deepspeed(source, model, optimizer).stage
    elif kind == "safetensors":
        ck.load_safetensors(model, source)
    else:  # DCP converted from DeepSpeed: with the optimizer's state
        ck.load(source, model, optimizer)
    if kind != "safetensors":
        _, osd = get_state_dict(model, optimizer,
                                options=StateDictOptions(full_state_dict=True))
        view.update({m: {fqn: state[m].detach().clone() for fqn, state in osd["state"].items()}
                     for m in MOMENTS})
        view["step"] = {float(s["step"]) for s in osd["state"].values()}
    view["loaded"] = full_parameters(model)
    losses = []
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        optimizer.zero_grad()
        loss = TASK.loss(model, _batch(step))
        loss.backward()
        optimizer.step()
        losses.append(_mean(loss))
    view.update(losses=losses, final=full_parameters(model))
    return view


def load_into_another_model(source: str) -> str:
    """A model with another vocabulary than the checkpoint's: the load refuses, naming
    the keys and shapes."""
    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.migrate import load_deepspeed

    plan = ParallelPlan(MeshSpec(dp_shard=-1)).use(FSDP2()).use(MetaInit(seed=1))
    with torch.device("meta"):
        model = LlamaTask(dim=16, n_heads=2, n_kv_heads=1, vocab_size=32, seq_len=8).build()
    model = plan.apply(model)
    try:
        load_deepspeed(source, model)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


if __name__ == "__main__":
    for zero_stage in (2, 3):
        write_fixture(str(Path(sys.argv[1]) / f"zero{zero_stage}"), zero_stage)
        write_mixed_fixture(str(Path(sys.argv[1]) / f"zero{zero_stage}_mixed"), zero_stage)
