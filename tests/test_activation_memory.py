"""The estimate's activation memory against measurement: the bytes autograd holds for
backward at the end of a forward, by torch's memory tracker, on the project's Llama and
on transformers' LlamaForCausalLM, without checkpointing and with selective and full
checkpointing applied by the plan. Bound: 10% (docs/estimate.md has the table)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from composer_par import ActivationCheckpoint, MeshSpec, ParallelPlan
from composer_par.estimate import ModelShape, Workload, activation_bytes
from composer_par.testing.activation_memory import held_for_backward

SEQ, BATCH, VOCAB = 64, 4, 512
# A Llama with grouped-query attention and an MLP size that is not a multiple of hidden.
SIZES = {"hidden": 128, "layers": 3, "heads": 8, "kv_heads": 2, "ffn": 352}


def _project_llama() -> tuple[torch.nn.Module, Callable[[torch.Tensor], Any]]:
    from composer_par.models.llama import Llama, LlamaConfig, next_token_loss

    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=SIZES["hidden"], n_layers=SIZES["layers"],
                              n_heads=SIZES["heads"], n_kv_heads=SIZES["kv_heads"],
                              ffn_hidden=SIZES["ffn"], max_seq_len=SEQ))
    return model, lambda tokens: next_token_loss(model(tokens), tokens)


def _hf_llama() -> tuple[torch.nn.Module, Callable[[torch.Tensor], Any]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=SIZES["hidden"], intermediate_size=SIZES["ffn"],
        num_hidden_layers=SIZES["layers"], num_attention_heads=SIZES["heads"],
        num_key_value_heads=SIZES["kv_heads"], max_position_embeddings=SEQ,
        attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model, lambda tokens: model(input_ids=tokens, labels=tokens, use_cache=False).loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("build", [_project_llama, _hf_llama], ids=["project llama", "hf llama"])
def test_estimated_activations_within_10_percent_of_measured(build: Any, mode: str) -> None:
    torch.manual_seed(0)
    model, loss_of = build()
    if mode != "none":
        ParallelPlan(MeshSpec()).use(ActivationCheckpoint(mode=mode)).apply(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    measured = held_for_backward(model, lambda: loss_of(tokens))["activations"]
    shape = ModelShape.from_module(model)
    # recompute=False: at the end of forward no block is being recomputed yet.
    estimated = activation_bytes(shape, Workload(seq=SEQ, micro_batch=BATCH), "float32", tp=1,
                                 sequence_parallel=False, loss_parallel=False, mode=mode,
                                 recompute=False)
    assert estimated == pytest.approx(measured, rel=0.10), (mode, estimated, measured)



def _measured_and_estimated(plugin: Any) -> tuple[ParallelPlan, ModelShape, Any, int]:
    """The project's Llama under a plan of ``plugin`` alone: the plan, the model's shape,
    the plan's estimate and the activations measured held for backward."""
    from composer_par.estimate import estimate_plan

    torch.manual_seed(0)
    model, loss_of = _project_llama()
    plan = ParallelPlan(MeshSpec()).use(plugin)
    plan.apply(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    measured = held_for_backward(model, lambda: loss_of(tokens))["activations"]
    shape = ModelShape.from_module(model)
    est = estimate_plan(plan, shape, Workload(seq=SEQ, micro_batch=BATCH, dtype="float32"),
                        world_size=1)
    return plan, shape, est, measured


@pytest.mark.timeout(120)
@pytest.mark.parametrize("every", [2, 3])
def test_selective_checkpointing_saving_every_nth_matmul_as_measured(every: int) -> None:
    """ActivationCheckpoint(mode="selective", matmul_every=N) saves the 1st, (N+1)-th, ...
    matmul output of each block and recomputes the rest: the plan's estimate (through
    its settings: checkpoint_matmul_every) follows, within the bound above, where
    counting every matmul output would overshoot by half again."""
    from composer_par import ActivationCheckpoint as AC

    plan, shape, est, measured = _measured_and_estimated(
        AC(mode="selective", matmul_every=every))
    assert est.layout.checkpoint_matmul_every == every
    assert est.memory.activations == pytest.approx(measured, rel=0.10), (
        est.memory.activations, measured)
    # counting every matmul's output (the estimate before it read matmul_every)
    every_output = activation_bytes(shape, Workload(seq=SEQ, micro_batch=BATCH), "float32",
                                    tp=1, sequence_parallel=False, loss_parallel=False,
                                    mode="selective", recompute=False)
    assert every_output > 1.3 * measured
    # the matmuls it does not save are recomputed: compute the step pays for
    selective = Workload(seq=SEQ, micro_batch=BATCH, dtype="float32",
                         activation_checkpoint="selective")
    part = plan.plugins[0].composer_par_estimate(est.layout, shape, selective, None)
    (recompute,) = part.compute
    assert recompute.forward_share == pytest.approx(1 - len(range(0, 7, every)) / 7)
    assert recompute.attention_share == 1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("every", [1, 2])
def test_selective_checkpointing_saving_the_attention_outputs_as_measured(every: int) -> None:
    """save = ["matmul", "attention", "collectives"] (torchtitan's selective op policy,
    with matmul_every 2): the attention kernel's output and log-sum-exp are kept too, and
    the plan's estimate (through checkpoint_saves_attention) follows within the bound;
    the attention is then not recomputed in backward."""
    from composer_par import ActivationCheckpoint as AC
    from composer_par.estimate import estimate_plan

    plan, shape, est, measured = _measured_and_estimated(
        AC(mode="selective", matmul_every=every, save=["matmul", "attention", "collectives"]))
    assert est.layout.checkpoint_saves_attention
    assert est.memory.activations == pytest.approx(measured, rel=0.10), (
        est.memory.activations, measured)
    # leaving the attention outputs out errs several times more
    without = estimate_plan(ParallelPlan(MeshSpec()).use(AC(mode="selective",
                                                            matmul_every=every)),
                            shape, Workload(seq=SEQ, micro_batch=BATCH, dtype="float32"),
                            world_size=1)
    error = abs(est.memory.activations - measured)
    assert abs(without.memory.activations - measured) > 3 * error, (
        est.memory.activations, without.memory.activations, measured)
    selective = Workload(seq=SEQ, micro_batch=BATCH, dtype="float32",
                         activation_checkpoint="selective")
    (recompute,) = plan.plugins[0].composer_par_estimate(est.layout, shape, selective,
                                                         None).compute
    assert recompute.attention_share == 0.0


_TP_AC = {"none": "",
          "selective": 'mode = "selective"\n',
          "selective, collectives recomputed": 'mode = "selective"\nsave = ["matmul"]\n',
          "full": 'mode = "full"\n'}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("checkpointing", list(_TP_AC))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_activations_on_every_rank_as_estimated(
        sequence_parallel: bool, checkpointing: str) -> None:
    """TP over 2 gloo ranks, with and without sequence parallelism, under each
    checkpointing: every rank's activations held for backward against the plan's
    estimate. Selective checkpointing that saves the collectives' outputs keeps the
    gathered inputs and reduced outputs; one that issues them again in backward does not,
    and the estimate (through checkpoint_saves_collectives) leaves them out."""
    from composer_par.estimate import estimate_plan
    from composer_par.testing import run_ranks
    from composer_par.testing.parity import build_plan
    from tests import activation_memory_workers as workers

    ac = _TP_AC[checkpointing]
    plan_toml = (f'[mesh]\ntp = 2\n\n[[plugins]]\nname = "tp"\n'
                 f'sequence_parallel = {str(sequence_parallel).lower()}\n\n'
                 + (f'[[plugins]]\nname = "activation_checkpoint"\n{ac}\n' if ac else "")
                 + '[[plugins]]\nname = "meta_init"\nseed = 7\n')
    measured = run_ranks(workers.held, 2, args=(plan_toml,), timeout=150)
    shape = ModelShape.from_module(workers.task.build())
    est = estimate_plan(build_plan(plan_toml), shape,
                        Workload(seq=workers.SEQ, micro_batch=workers.BATCH, dtype="float32"),
                        world_size=2)
    expected = est.memory.activations
    if checkpointing == "full":
        # the estimate's peak counts one block being recomputed; the end of forward does
        # not
        expected = activation_bytes(
            shape, Workload(seq=workers.SEQ, micro_batch=workers.BATCH), "float32", tp=2,
            sequence_parallel=sequence_parallel, loss_parallel=False, mode="full",
            recompute=False)
    assert est.layout.checkpoint_saves_collectives == ("collectives recomputed"
                                                      not in checkpointing)
    for rank, held in enumerate(measured):
        assert expected == pytest.approx(held, rel=0.10), (rank, expected, held)
