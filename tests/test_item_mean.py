"""The item-mean loss (``plan.training_step(..., items=count)``): where labels are ignored
unevenly, every layout trains as one process does over the whole global batch with the
loss over every labelled token, on every rank; without ``items`` it would not."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from composer_par import FSDP2, HSDP, FaultTolerance, MeshSpec, ParallelPlan
from composer_par.item_mean import averaged_ranks, global_items, labelled_tokens, loss_scale
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ATOL, RTOL
from composer_par.training import TrainingStep
from tests.item_mean_workers import WORLD, reference, task


@functools.cache
def _reference(item_mean: bool = True) -> dict[str, Any]:
    return reference(item_mean)


def _assert_trains_as_one_process(results: list[dict[str, Any]]) -> None:
    expected = _reference()
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(expected["losses"]), rtol=RTOL, atol=ATOL,
                                   msg=f"rank {rank} losses")
        assert result["params"].keys() == expected["params"].keys(), rank
        for name, param in result["params"].items():
            torch.testing.assert_close(param, expected["params"][name], rtol=RTOL,
                                       atol=ATOL, msg=f"rank {rank} {name}")


def test_the_labels_make_a_mean_of_means_differ() -> None:
    """The data is uneven enough that the test can fail: two halves' mean of means
    trains to other parameters than the mean over every labelled token."""
    plain, item = _reference(item_mean=False), _reference()
    differs = max(float((plain["params"][n] - item["params"][n]).abs().max())
                  for n in item["params"])
    assert differs > 100 * ATOL
    assert abs(plain["losses"][0] - item["losses"][0]) > 100 * ATOL


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("layout", "accumulate"), [
    ("fsdp2", 2),  # data shards and accumulation microbatches
    ("hsdp_tp", 1),  # a replicate dim, and tp ranks counting the same tokens
    ("pp_fsdp2", 1),  # the schedule's microbatches; only the last stage counts
    ("pp_fsdp2", 2),  # twice the schedule's microbatches in one pass
    ("cp_fsdp2", 1),  # each cp rank its part of the sequences
])
def test_item_mean_trains_as_one_process_on_every_rank(layout: str, accumulate: int) -> None:
    results = run_ranks("tests.item_mean_workers:train", WORLD[layout],
                        args=(layout, accumulate), timeout=300)
    _assert_trains_as_one_process(results)


def test_one_process_counts_its_own_items() -> None:
    plan = ParallelPlan(MeshSpec())
    labels = torch.tensor([[1, -100, 3], [-100, -100, 2]])
    assert global_items(int(labelled_tokens(labels)), True, averaged_ranks(plan, 1), 1,
                        torch.device("cpu")) == 3
    assert loss_scale(3, microbatches=2, averaged=4) == pytest.approx(8 / 3)
    # A global batch with nothing labelled learns nothing (no 0 / 0).
    assert loss_scale(0, microbatches=2, averaged=4) == 0.0


def test_items_must_be_callable() -> None:
    model = task().build()
    plan = ParallelPlan(MeshSpec()).use(FSDP2())
    with pytest.raises(TypeError, match="items must be callable"):
        TrainingStep(plan, model, lambda out, y: out.sum(), items=3)  # type: ignore[arg-type]


def test_items_are_refused_with_replica_groups_launched_apart() -> None:
    """Fault-tolerant replica groups are launches of their own: no process group sums
    their counts, and each group's gradients would weigh as its own mean."""
    pytest.importorskip("torchft")
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
            .use(FaultTolerance(group=0)))
    with pytest.raises(ValueError, match=r"\['dp_replicate'\] spanning launches"):
        TrainingStep(plan, task().build(), lambda out, y: out.sum(), items=labelled_tokens)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tp_ranks_given_different_targets_are_told_on_every_rank() -> None:
    told = run_ranks("tests.item_mean_workers:count_differently_on_tp_ranks", 2,
                     timeout=120)
    assert all("must be given the same targets" in message for message in told), told
