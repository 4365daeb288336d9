"""The replica check (composer_par.check_replicas and the step's check_replicas_every):
clean replicas pass, one nudged copy is named on every rank, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from composer_par import MeshSpec, ParallelPlan, ReplicaDriftError, check_replicas
from composer_par.replicas import checksum
from composer_par.testing.distributed import run_ranks
from tests import replica_workers


def test_checksum_catches_one_last_bit_change_and_moved_elements() -> None:
    tensor = torch.randn(1000) * 1e4
    changed = tensor.clone()
    changed[500] = torch.nextafter(changed[500], torch.tensor(float("inf")))
    swapped = tensor.clone()
    swapped[[3, 7]] = tensor[[7, 3]]
    assert torch.equal(checksum(tensor), checksum(tensor.clone()))
    assert not torch.equal(checksum(tensor), checksum(changed))
    assert not torch.equal(checksum(tensor), checksum(swapped))
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.int8):
        assert checksum(tensor.to(dtype)).dtype == torch.int64


def test_without_a_process_group_there_is_nothing_to_compare() -> None:
    check_replicas(torch.nn.Linear(2, 2))


def test_the_step_option_is_checked() -> None:
    with pytest.raises(ValueError, match="check_replicas_every"):
        ParallelPlan(MeshSpec()).training_step(torch.nn.Linear(2, 2), lambda o, t: o.sum(),
                                     check_replicas_every=0)


def test_the_error_names_parameter_dim_and_ranks() -> None:
    error = ReplicaDriftError([("norm.weight", "tp", [[0], [1]])])
    assert "norm.weight over tp: ranks [0] != [1]" in str(error)


@pytest.mark.parametrize(("layout", "name", "rank", "dim", "ranks", "placements"), [
    ("fsdp2_tp", "layers.0.attention_norm.weight", 1, "tp", [[0], [1]],
     "(Shard(dim=0), Replicate())"),
    ("hsdp", "layers.1.feed_forward.w1.weight", 3, "dp_replicate", [[1], [3]],
     "(Replicate(), Shard(dim=0))"),
    ("replicate", "norm.weight", 2, "dp_replicate", [[0, 1, 3], [2]], "(Replicate(),)"),
    ("plain", "1.bias", 0, "world", [[0], [1, 2, 3]], "plain"),
])
def test_a_nudged_replica_raises_on_every_rank(layout: str, name: str, rank: int, dim: str,
                                               ranks: list[list[int]], placements: str) -> None:
    results = run_ranks(replica_workers.drift, 4, args=(layout, name, rank), timeout=300)
    for result in results:
        assert result["placements"] == placements
        assert result["clean"] == "ok"
        assert result["nudged"]["drifts"] == [(name, dim, ranks)]
        assert f"{name} over {dim}" in result["nudged"]["message"]


def test_the_step_checks_every_n_steps_and_raises_on_every_rank() -> None:
    results = run_ranks(replica_workers.through_the_step, 4, args=(2, 5, None), timeout=300)
    assert [r["checked"] for r in results] == [[0, 2, 4]] * 4
    assert all(r["raised"] is None for r in results)
    results = run_ranks(replica_workers.through_the_step, 4, args=(2, 6, 3), timeout=300)
    for result in results:
        assert result["checked"] == [0, 2, 4]
        assert result["raised"] == {"at_step": 4, "drifts": [("norm.weight", "tp", [[0], [1]])]}
