"""A model-parallel plugin that only folds its mesh dim into data parallelism, for
tests/test_folded_dims.py: what FSDP2 and HSDP do with a dim context or expert
parallelism would fold, without either of them."""

from __future__ import annotations

from typing import ClassVar

import attrs

from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan
from composer_par.plugin import Claim, FoldedDim, Plugin, Role, hookimpl


@attrs.frozen
class Fold(Plugin):
    """Claims ``dim`` as model parallel and asks data parallelism to fold it in."""

    name: ClassVar[str] = "fold"
    dim: str = "x"
    distinct_samples: bool = True

    def claims(self) -> tuple[Claim, ...]:
        return (Claim(self.dim, Role.MODEL_PARALLEL),)

    @hookimpl
    def composer_par_folded_dims(self) -> list[FoldedDim]:
        return [FoldedDim(self.dim, distinct_samples=self.distinct_samples)]


def fsdp2_folded_distinct() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_shard=2, x=2)).use(Fold()).use(FSDP2())
            .use(MetaInit(seed=7)))


def fsdp2_folded_same_samples() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_shard=2, x=2)).use(Fold(distinct_samples=False))
            .use(FSDP2()).use(MetaInit(seed=7)))


def hsdp_fsdp2_folded() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=1, x=2)).use(Fold()).use(HSDP())
            .use(FSDP2()).use(MetaInit(seed=7)))


def hsdp_alone_folded() -> ParallelPlan:
    return (ParallelPlan(MeshSpec(dp_replicate=2, x=2)).use(Fold()).use(HSDP())
            .use(MetaInit(seed=7)))
