"""The replica check is on by default: ``plan.training_step`` and every trainer adapter
(accelerate, the Hugging Face Trainer, Lightning Fabric, the Lightning Trainer) check,
before their first optimizer step and every ``composer_par.replicas.EVERY``-th after it,
that each replicated parameter is equal on every rank holding it, with no option given;
a drift raises on every rank, naming the parameter, the mesh dim and the ranks.
``check_replicas_every=None`` opts out.

Real gloo ranks: FSDP2 x TP (2 x 2), the final norm's weight (replicated over tp) moved on
tp coordinate 1 after apply. The interval's cost is measured by
benchmarks/bench_replica_check.py, not here.
"""

from __future__ import annotations

from typing import Any

import pytest

from composer_par import replicas
from composer_par.testing.distributed import run_ranks
from tests import replica_default_workers

# One worker runs the whole module, so its module-scoped launch runs once.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("replica_default")]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict[str, Any]]]:
    results = run_ranks(replica_default_workers.run_cases, 4, timeout=900)
    return {case: [r[case] for r in results] for case in replica_default_workers.CASES}


# tp groups of dp_shard 2 x tp 2: ranks 0 and 1, ranks 2 and 3; rank 1 and 3 moved.
DRIFTS = [("norm.weight", "tp", [[0], [1]]), ("norm.weight", "tp", [[2], [3]])]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["training_step", "accelerate", "fabric",
                                  "lightning_trainer"])
def test_a_drift_raises_on_every_rank_with_no_option_given(
        outcomes: dict[str, list[dict[str, Any]]], case: str) -> None:
    for rank, outcome in enumerate(outcomes[case]):
        assert outcome["raised"] == "ReplicaDriftError", (rank, outcome)
        assert sorted(map(tuple, outcome["drifts"])) == sorted(map(tuple, DRIFTS)), outcome
        assert "norm.weight over tp: ranks [0] != [1]" in outcome["message"]


@pytest.mark.timeout(900)
def test_the_hugging_face_trainer_checks_by_default(
        outcomes: dict[str, list[dict[str, Any]]]) -> None:
    for rank, outcome in enumerate(outcomes["hf_trainer"]):
        assert outcome["raised"] == "ReplicaDriftError", (rank, outcome)
        assert {d[0] for d in outcome["drifts"]} == {"model.norm.weight"}
        assert {d[1] for d in outcome["drifts"]} == {"tp"}


@pytest.mark.timeout(900)
def test_none_opts_out(outcomes: dict[str, list[dict[str, Any]]]) -> None:
    assert all(o["raised"] is None for o in outcomes["training_step_opted_out"])


def test_the_default_interval_and_its_validation() -> None:
    assert replicas.EVERY == 100
    assert replicas.check_every(None) is None
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="check_replicas_every"):
            replicas.check_every(bad)
