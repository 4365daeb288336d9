"""Folded dims (the ``composer_par_folded_dims`` hook): a model-parallel dim over which
parameters are equal is folded into data parallelism. FSDP2 shards over its dim and the
folded ones flattened; HSDP alone replicates over both; the data shards count a folded
dim only when its ranks read their own samples. Each plan trains at parity with one
process on real gloo ranks, every rank's parameters compared."""

from __future__ import annotations

import pytest

from composer_par.plugin import FoldedDim
from composer_par.testing.parity import ParityCase
from tests import folded_workers
from tests.composition_workers import check_cases

LLAMA = "composer_par.testing.tasks:llama"


def test_folded_dims_in_the_data_shards() -> None:
    distinct = folded_workers.fsdp2_folded_distinct()
    same = folded_workers.fsdp2_folded_same_samples()
    answers = distinct.hooks.answers("composer_par_folded_dims")
    assert [(p.name, a) for p, a in answers] == [("fold", [FoldedDim("x", True)])]
    assert [f.dim for f in distinct.folded_dims()] == ["x"]
    assert distinct.data_parallel_dims() == ["dp_shard", "x"]
    assert [distinct.data_shard(r, 4) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    # ranks along x read the same samples: the plan slices them (context parallelism)
    assert same.data_parallel_dims() == ["dp_shard"]
    assert [same.data_shard(r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_fsdp2_describes_the_flattened_shard_dim() -> None:
    text = str(folded_workers.fsdp2_folded_distinct().explain())
    assert "over mesh (dp_shard x x)" in text, text


@pytest.mark.distributed
def test_folded_dims_train_at_parity() -> None:
    names = ["fsdp2_folded_distinct", "fsdp2_folded_same_samples", "hsdp_fsdp2_folded",
             "hsdp_alone_folded"]
    cases = [ParityCase(task=LLAMA, plan=f"tests.folded_workers:{name}", world_size=4,
                        steps=4, lr=1.0) for name in names]
    results = check_cases(cases, timeout=240)
    for name, result in zip(names, results, strict=True):
        try:
            result.assert_close()
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        assert result.losses[-1] < result.losses[0] - 0.05, (name, result.losses)
