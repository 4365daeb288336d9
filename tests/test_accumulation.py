"""Gradient accumulation in the plan's training step (``accumulate=k, sync=...``): k
microbatches train at parity with the same global batch in one step, every rank's full
parameters and the losses, and the collectives per optimizer step are golden numbers."""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch

from composer_par import MeshSpec, ParallelPlan
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ATOL, RTOL
from composer_par.training import TrainingStep

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("accumulation")

WORLD = {"fsdp2": 2, "hsdp": 4}


@functools.cache
def _train(layout: str, accumulate: int, sync: str) -> list[dict[str, Any]]:
    return run_ranks("tests.accumulation_workers:train", WORLD[layout],
                     args=(layout, accumulate, sync), timeout=240)


def _assert_parity(layout: str, sync: str) -> None:
    one_shot = _train(layout, 1, "every")
    accumulated = _train(layout, 4, sync)
    for rank, (ours, theirs) in enumerate(zip(accumulated, one_shot, strict=True)):
        torch.testing.assert_close(torch.tensor(ours["losses"]),
                                   torch.tensor(theirs["losses"]), rtol=RTOL, atol=ATOL)
        assert ours["params"].keys() == theirs["params"].keys()
        for name, param in ours["params"].items():
            torch.testing.assert_close(param, theirs["params"][name], rtol=RTOL, atol=ATOL,
                                       msg=f"rank {rank} {name}")


def _counts(layout: str, accumulate: int, sync: str) -> list[dict[str, int]]:
    """The collectives of each step, the same on every rank."""
    results = _train(layout, accumulate, sync)
    for rank, result in enumerate(results):
        assert result["counts"] == results[0]["counts"], rank
    counts = results[0]["counts"]
    assert all(c == counts[0] for c in counts), counts
    return counts[0]


# The small Llama has three FSDP units (two blocks and the root); each microbatch's
# forward and backward all-gather four times (three in forward, the first block again in
# backward: the root and the last block stay gathered); one all-reduce averages the
# step's loss.
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sync", ["last", "every"])
def test_fsdp2_accumulation_trains_at_parity(sync: str) -> None:
    _assert_parity("fsdp2", sync)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp2_deferred_sync_reduce_scatters_once_per_step() -> None:
    assert _counts("fsdp2", 1, "every") == {"all_gather": 4, "reduce_scatter": 3,
                                            "all_reduce": 1}
    assert _counts("fsdp2", 4, "every") == {"all_gather": 16, "reduce_scatter": 12,
                                            "all_reduce": 1}
    assert _counts("fsdp2", 4, "last") == {"all_gather": 16, "reduce_scatter": 3,
                                           "all_reduce": 1}


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sync", ["last", "reduce_scatter", "every"])
def test_hsdp_accumulation_trains_at_parity(sync: str) -> None:
    _assert_parity("hsdp", sync)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_hsdp_collectives_per_step_under_each_policy() -> None:
    # Gradient all-reduces over dp_replicate: one per unit and backward; plus the loss's.
    assert _counts("hsdp", 1, "every") == {"all_gather": 4, "reduce_scatter": 3,
                                           "all_reduce": 4}
    assert _counts("hsdp", 4, "every") == {"all_gather": 16, "reduce_scatter": 12,
                                           "all_reduce": 13}
    assert _counts("hsdp", 4, "last") == {"all_gather": 16, "reduce_scatter": 3,
                                          "all_reduce": 4}
    assert _counts("hsdp", 4, "reduce_scatter") == {"all_gather": 16, "reduce_scatter": 12,
                                                    "all_reduce": 4}


# -- one process ------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs, targets)


def test_accumulated_gradients_and_loss_equal_one_backward() -> None:
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1)
    model, twin = _mlp(), _mlp()
    plan = ParallelPlan(MeshSpec())
    loss = plan.training_step(model, _mse, accumulate=4).step(inputs, targets)
    expected = _mse(twin(inputs), targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_batch_keyword_tensors_are_cut_and_others_passed_whole() -> None:
    seen: list[tuple[int, float]] = []

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, *, weight: torch.Tensor, scale: float
                    ) -> torch.Tensor:
            seen.append((weight.shape[0], scale))
            return self.linear(x) * weight * scale

    step = ParallelPlan(MeshSpec()).training_step(Scaled(), _mse, accumulate=2)
    step.step(torch.randn(6, 4), torch.randn(6, 1), weight=torch.ones(6, 1), scale=2.0)
    assert seen == [(3, 2.0), (3, 2.0)]


def test_the_options_are_checked() -> None:
    plan = ParallelPlan(MeshSpec())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="accumulate"):
            plan.training_step(_mlp(), _mse, accumulate=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync"):
        plan.training_step(_mlp(), _mse, accumulate=2, sync="never")
    step = plan.training_step(_mlp(), _mse, accumulate=3)
    with pytest.raises(ValueError, match="accumulate=3"):
        step.step(torch.randn(8, 4), torch.randn(8, 1))


def test_a_pipeline_takes_only_the_schedules_own_sync() -> None:
    plan: Any = types.SimpleNamespace(pipeline=object())
    for sync in ("reduce_scatter", "every"):
        with pytest.raises(ValueError, match="last microbatch's backward"):
            TrainingStep(plan, _mlp(), _mse, accumulate=2, sync=sync)
    TrainingStep(plan, _mlp(), _mse, accumulate=2)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fabric_step_accumulates_with_the_same_counts_at_parity() -> None:
    pytest.importorskip("lightning")
    one_shot = _train("fsdp2", 1, "every")
    fabric = run_ranks("tests.accumulation_workers:fabric_train", 2, args=(4, "last"),
                       timeout=240)
    for rank, (ours, theirs) in enumerate(zip(fabric, one_shot, strict=True)):
        assert ours["counts"] == [{"all_gather": 16, "reduce_scatter": 3,
                                   "all_reduce": 1}] * 3, rank
        torch.testing.assert_close(torch.tensor(ours["losses"]),
                                   torch.tensor(theirs["losses"]), rtol=RTOL, atol=ATOL)
        for name, param in ours["params"].items():
            torch.testing.assert_close(param, theirs["params"][name], rtol=RTOL, atol=ATOL,
                                       msg=f"rank {rank} {name}")


# -- with a pipeline -------------------------------------------------------------------

PP_WORLD = {"pp": 2, "pp_fsdp2": 4}


@functools.cache
def _pp_train(layout: str, accumulate: int, passes: int = 1) -> list[dict[str, Any]]:
    return run_ranks("tests.accumulation_workers:pp_train", PP_WORLD[layout],
                     args=(layout, accumulate, passes), timeout=300)


@functools.cache
def _pp_reference() -> dict[str, Any]:
    from tests.accumulation_workers import pp_reference

    return pp_reference()


def _assert_pp_parity(layout: str, accumulate: int, passes: int = 1) -> None:
    """Every rank's own parameters (its stage's) and the losses against one process;
    together the ranks hold every parameter."""
    reference = _pp_reference()
    seen: set[str] = set()
    for rank, result in enumerate(_pp_train(layout, accumulate, passes)):
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(reference["losses"]), rtol=RTOL, atol=ATOL)
        assert result["params"], rank
        for name, param in result["params"].items():
            torch.testing.assert_close(param, reference["params"][name], rtol=RTOL,
                                       atol=ATOL, msg=f"rank {rank} {name}")
        seen |= result["params"].keys()
    assert seen == reference["params"].keys()
    assert reference["losses"][-1] < reference["losses"][0]


def _pp_counts(layout: str, accumulate: int, passes: int = 1) -> list[dict[str, int]]:
    """Each rank's collectives per step, the same on every step after the first (whose
    first schedule pass also exchanges the stages' shapes)."""
    out = []
    for rank, result in enumerate(_pp_train(layout, accumulate, passes)):
        counts = result["counts"][1:]
        assert all(c == counts[0] for c in counts), (rank, counts)
        out.append({kind: counts[0].get(kind, 0)
                    for kind in ("all_gather", "reduce_scatter", "all_reduce")})
    return out


# 1F1B over pp 2 with 2 microbatches; accumulate=2 runs 4 in one schedule pass. The
# reference is one process, the whole global batch in one backward.
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_pipeline_accumulation_trains_at_parity() -> None:
    _assert_pp_parity("pp", 2)
    # Two steps before one optimizer step add into .grad as two backwards do (torch's
    # schedule alone would divide the first step's gradients by its count again).
    _assert_pp_parity("pp", 1, passes=2)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_pipeline_fsdp2_accumulation_trains_at_parity() -> None:
    _assert_pp_parity("pp_fsdp2", 2)
    _assert_pp_parity("pp_fsdp2", 1, passes=2)


# Each stage has three FSDP units (its two blocks and its root). torch's schedule defers
# their reduce-scatters to the end of its pass: one per unit per step however many
# microbatches it runs; a loop of two steps reduce-scatters twice. The all-gathers grow
# by two a microbatch.
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_pipeline_fsdp2_accumulation_reduce_scatters_once_per_step() -> None:
    per_rank = 4
    assert _pp_counts("pp_fsdp2", 1) == [{"all_gather": 7, "reduce_scatter": 3,
                                          "all_reduce": 1}] * per_rank
    assert _pp_counts("pp_fsdp2", 2) == [{"all_gather": 11, "reduce_scatter": 3,
                                          "all_reduce": 1}] * per_rank
    assert _pp_counts("pp_fsdp2", 1, passes=2) == [{"all_gather": 14, "reduce_scatter": 6,
                                                    "all_reduce": 2}] * per_rank
