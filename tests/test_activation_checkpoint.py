"""ActivationCheckpoint: full / selective / every N on the shared blocks; names unchanged."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from composer_par.plugins.activation_checkpoint import MARK, checkpoint_block

from composer_par import (
    FSDP2,
    ActivationCheckpoint,
    MeshSpec,
    MetaInit,
    ParallelPlan,
    PlanError,
)
from composer_par.blocks import WRAPPER_COMPONENTS
from composer_par.testing.distributed import run_ranks
from composer_par.testing.tasks import EncoderTask, LlamaTask, encoder, llama
from tests.ac_policy_workers import CountOps

TASKS = {"llama": llama, "encoder": encoder}


def build(task: Any, *plugins: Any, seed: int = 5) -> tuple[torch.nn.Module, ParallelPlan]:
    plan = ParallelPlan(MeshSpec())
    for plugin in plugins:
        plan.use(plugin)
    plan.use(MetaInit(seed=seed))
    with torch.device("meta"):
        model = task.build()
    return plan.apply(model), plan


def grads_after_step(task: Any, model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    loss = task.loss(model, task.batch(0))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("task_name", sorted(TASKS))
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_names_state_dict_and_gradients_unchanged(task_name: str, mode: str) -> None:
    task = TASKS[task_name]
    plain, _ = build(task)
    checked, plan = build(task, ActivationCheckpoint(mode=mode))
    names = [n for n, _ in checked.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()]
    assert list(checked.state_dict()) == list(plain.state_dict())
    assert not any(part in WRAPPER_COMPONENTS for n in names for part in n.split("."))
    assert [n for n, _ in checked.named_modules()] == [n for n, _ in plain.named_modules()]
    assert len(plan.notes["checkpointed_blocks"]) == 2
    loss, grads = grads_after_step(task, checked)
    ref_loss, ref_grads = grads_after_step(task, plain)
    assert loss == ref_loss
    for name, grad in ref_grads.items():
        # Recomputation runs the same CPU kernels on the same inputs: bitwise equal.
        assert torch.equal(grads[name], grad), name


def backward_ops(model: torch.nn.Module, task: Any) -> Counter[str]:
    loss = task.loss(model, task.batch(0))
    with CountOps() as counter:
        loss.backward()
    return counter.ops


def test_selective_saves_matmuls_and_recomputes_the_rest() -> None:
    task = LlamaTask()
    plain = backward_ops(build(task)[0], task)
    full = backward_ops(build(task, ActivationCheckpoint(mode="full"))[0], task)
    selective = backward_ops(build(task, ActivationCheckpoint(mode="selective"))[0], task)
    matmuls = ("mm", "addmm", "bmm")
    count = lambda ops: sum(ops[m] for m in matmuls)  # noqa: E731
    # Full recomputes every block's forward, matmuls included; selective keeps them.
    assert count(full) > count(plain)
    assert count(selective) == count(plain)
    # ... and recomputes the cheap ops (SwiGLU's silu, RMSNorm's rsqrt).
    for op in ("silu", "rsqrt"):
        assert selective[op] > plain[op], op
        assert full[op] == selective[op], op


def test_every_n_checkpoints_the_nth_blocks() -> None:
    task = LlamaTask(n_layers=4)
    model, plan = build(task, ActivationCheckpoint(every=2))
    assert plan.notes["checkpointed_blocks"] == ["layers.1", "layers.3"]
    assert [MARK in layer.__dict__ for layer in model.layers] == [False, True, False, True]
    assert "full checkpointing of every 2nd block" in str(plan.explain())


def test_a_deepcopy_checkpoints_itself_not_the_original() -> None:
    model, _ = build(llama, ActivationCheckpoint())
    twin = copy.deepcopy(model)
    for copied in twin.layers:
        assert copied.forward.__self__ is copied and copied.__dict__[MARK] == "full"
    with torch.no_grad():
        for param in twin.parameters():
            param.zero_()
    # The copy computes with its own (zeroed) weights; the original is untouched.
    assert not torch.equal(twin(llama.batch(0)), model(llama.batch(0)))


def test_checkpointing_twice_is_refused() -> None:
    block = torch.nn.Linear(2, 2)
    checkpoint_block(block, "full")
    with pytest.raises(RuntimeError, match="already checkpointed"):
        checkpoint_block(block, "selective")


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="mode"):
        ActivationCheckpoint(mode="everything")  # type: ignore[arg-type]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="every must be an int >= 1"):
            ActivationCheckpoint(every=bad)  # type: ignore[arg-type]


def test_cp210_every_selects_no_block() -> None:
    with torch.device("meta"):
        model = llama.build()
    plan = ParallelPlan(MeshSpec()).use(ActivationCheckpoint(every=3)).use(MetaInit())
    report = plan.validate(model)
    (finding,) = report.findings
    assert finding.code == "CP210" and finding.plugin == "activation_checkpoint"
    assert "every=3 selects none of the 2 block(s)" in finding.message
    with pytest.raises(PlanError):
        plan.apply(model)
    assert not any(MARK in layer.__dict__ for layer in model.layers)  # untouched


def test_cp401_no_blocks_to_checkpoint() -> None:
    plan = ParallelPlan(MeshSpec()).use(ActivationCheckpoint())
    assert plan.validate(torch.nn.Linear(3, 3)).codes() == ["CP401"]


def test_cp411_wrapped_blocks_are_refused() -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    with torch.device("meta"):
        model = llama.build()
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    composable_checkpoint(model.layers[1])
    plan = ParallelPlan(MeshSpec()).use(ActivationCheckpoint(blocks="layers")).use(MetaInit())
    report = plan.validate(model)
    assert report.codes() == ["CP411", "CP411"]
    messages = " ".join(f.message for f in report.findings)
    assert "layers.0 (CheckpointWrapper) is a checkpoint_wrapper" in messages
    assert "layers.1 (DecoderLayer) already has torch's composable checkpoint" in messages


def test_the_encoder_task_builds_on_meta_and_metainit_initializes_attention() -> None:
    task = EncoderTask()
    model, _ = build(task)
    attention = model[1].layers[0].self_attn
    assert torch.isfinite(attention.in_proj_weight).all()
    assert attention.in_proj_weight.std() > 0
    assert torch.equal(attention.in_proj_bias, torch.zeros_like(attention.in_proj_bias))
    assert not any(t.is_meta for t in model.parameters())


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp2_groups_the_same_modules_after_checkpointing() -> None:
    facts = run_ranks("tests.ac_compile_workers:fsdp_groups", 2, args=("selective",),
                      timeout=120)[0]
    # Each block's parameters in its own group, the rest in the root's: as without
    # checkpointing, since no wrapper module was inserted.
    assert facts["groups"] == facts["expected_groups"]
    assert list(facts["groups"]) == ["layers.0", "layers.1", "<root>"]
    assert facts["same_block_objects"]
    assert facts["checkpointed"] == ["FSDPDecoderLayer", "FSDPDecoderLayer"]
    assert not any(part in WRAPPER_COMPONENTS
                   for n in facts["names"] + facts["state_dict"] for part in n.split("."))


def test_fsdp2_and_checkpointing_agree_on_explicit_blocks() -> None:
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks="layers"))
            .use(ActivationCheckpoint(blocks=["DecoderLayer"])))
    assert "CP208" in plan.validate().codes()
    same = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks="layers")).use(
        ActivationCheckpoint(blocks="layers"))
    assert same.validate().ok


def test_plan_file_round_trip_and_bad_values() -> None:
    from composer_par import PlanFileError

    text = (
        '[mesh]\ndp_shard = 2\n[[plugins]]\nname = "fsdp2"\n'
        '[[plugins]]\nname = "activation_checkpoint"\nmode = "selective"\nevery = 2\n'
    )
    plan = ParallelPlan.from_toml(text)
    assert plan.plugin("activation_checkpoint") == ActivationCheckpoint(mode="selective", every=2)
    assert ParallelPlan.from_toml(plan.to_toml()).plugins == plan.plugins
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(text.replace("every = 2", "every = 0"))
    assert info.value.report.codes() == ["CP506"]
    assert "every must be an int >= 1" in str(info.value)
