"""A model cut into pipeline stages: each coordinate along the cut mesh dim estimated on
its own (:class:`RankEstimate`), from what the cutting plugin states
(:class:`~composer_par.estimate.parts.EstimatePipeline`).

A rank's memory is the built-in accounting (:mod:`.memory`) applied to the parameter
groups of its stages, with two changes the plugin asks for:

* activations: per stage, one microbatch's (:func:`.memory.activation_bytes` of the
  stage's blocks, and the logits on the stage that has them), weighted by the
  microbatches the rank holds at each moment the plugin lists; the heaviest moment
  counts, plus one block being recomputed under full checkpointing;
* a stage whose runtime ``accumulates`` gradients over the microbatches under a shard
  dim keeps them unsharded (in the reduce dtype) and its parameters gathered until the
  step's one reduction.

Its communication is the built-in collectives of each stage, run as often as the stage
says, plus the rank's point-to-point sends, timed as every other collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.collectives import Collective, communication
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.experts import experts_apart
from composer_par.estimate.layout import local_workload
from composer_par.estimate.memory import Memory, activation_bytes, memory_per_rank
from composer_par.estimate.timing import DimTraffic, dim_traffic
from composer_par.estimate.units import bytes_of
from composer_par.estimate.workload import AC_MODES

if TYPE_CHECKING:
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.model_shape import ModelShape
    from composer_par.estimate.parts import (
        EstimatePart,
        EstimatePipeline,
        EstimateRank,
        EstimateStage,
    )
    from composer_par.estimate.workload import Workload


@attrs.frozen
class RankEstimate:
    """One coordinate along the cut mesh dim: its stages, memory and communication."""

    coordinate: int
    stages: tuple[str, ...]
    blocks: int
    params: int  # parameters of its stages (whole, before any sharding)
    memory: Memory
    traffic: tuple[DimTraffic, ...]
    in_flight: int
    sends: tuple[Collective, ...]
    # gradients kept unsharded over the shard dim until the step's one reduction
    accumulates: bool = False

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.traffic)

    @property
    def send_intra_bytes(self) -> float:
        return sum(c.payload for c in self.sends if (c.nodes or 1) <= 1)

    @property
    def send_inter_bytes(self) -> float:
        return sum(c.payload for c in self.sends if (c.nodes or 1) > 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "coordinate": self.coordinate, "stages": list(self.stages), "blocks": self.blocks,
            "params": self.params, "memory": self.memory.to_dict(),
            "in_flight": self.in_flight, "gradients_unsharded": self.accumulates,
            "point_to_point": {"intra_node_bytes": round(self.send_intra_bytes),
                               "inter_node_bytes": round(self.send_inter_bytes),
                               "sends": [c.to_dict() for c in self.sends]},
            "communication": [t.to_dict() for t in self.traffic],
            "communication_seconds": self.seconds,
        }


def merged_model(whole: ModelShape, stages: Sequence[EstimateStage]) -> ModelShape:
    """The parameter groups of ``stages`` as one model shape (the sizes of ``whole``)."""
    groups = tuple(g for stage in stages for g in stage.model.groups)
    vocab = next((s.model.vocab for s in stages if s.model.vocab), None)
    return attrs.evolve(whole, groups=groups, params=sum(g.numel * g.count for g in groups),
                        layers=sum(s.model.layers for s in stages), vocab=vocab)


def _activations(
    layout: Layout, rank: EstimateRank, workload: Workload, dtype: str, tp: int, mode: str,
) -> int:
    every = layout.checkpoint_every
    sp, lp = layout.sequence_parallel, layout.loss_parallel
    workload = local_workload(layout, workload)
    per_stage = [activation_bytes(s.model, workload, dtype, tp=tp, sequence_parallel=sp,
                                  loss_parallel=lp, mode=mode, every=every, recompute=False)
                 for s in rank.stages]
    held = max((sum(n * b for n, b in zip(moment, per_stage, strict=True))
                for moment in rank.held), default=0)
    if mode == "full" and any(s.model.layers // every for s in rank.stages):
        one = next(s.model for s in rank.stages if s.model.layers)
        held += activation_bytes(attrs.evolve(one, layers=1, vocab=None), workload, dtype,
                                 tp=tp, sequence_parallel=sp, loss_parallel=lp, mode="none")
    return held


def rank_estimate(
    layout: Layout, whole: ModelShape, rank: EstimateRank, workload: Workload,
    parts: Sequence[tuple[str, EstimatePart]], *, dtype: str, reduce_dtype: str, mode: str,
    tp: int, shard: int, intra_gbps: float, inter_gbps: float,
) -> RankEstimate:
    for moment in rank.held:
        if len(moment) != len(rank.stages):
            raise EstimateError(f"pipeline rank {rank.coordinate}: a held moment lists "
                                f"{len(moment)} stage(s) of {len(rank.stages)}")
    # Expert parallelism's experts: num_experts / ep of each of the stage's blocks.
    rank = attrs.evolve(rank, stages=tuple(attrs.evolve(s, model=experts_apart(s.model, layout))
                                           for s in rank.stages))
    model = merged_model(whole, rank.stages)
    base = memory_per_rank(layout, model, workload, parts, dtype=dtype,
                           reduce_dtype=reduce_dtype, mode=mode, tp=tp, shard=shard)
    by_mode = {m: _activations(layout, rank, workload, dtype, tp, m) for m in AC_MODES}
    grads, buffers = base.grads, base.comm_buffers
    accumulating = [s for s in rank.stages if s.accumulates]
    if shard > 1 and accumulating:
        mixed = bytes_of(dtype) == 2
        ag_bytes, rs_bytes = bytes_of(dtype), bytes_of(reduce_dtype)
        pbytes = 2 if mixed else bytes_of(dtype)
        grads = 0
        gathered = 0
        for stage in rank.stages:
            for g in stage.model.groups:
                if stage.accumulates:
                    # unsharded over the shard dim (split by TP only) until the reduction
                    grads += g.local_numel(tp, 1) * g.count * rs_bytes
                    gathered += g.padded_numel(tp, shard) * g.count * ag_bytes
                else:
                    grads += g.local_numel(tp, shard) * g.count * pbytes
        largest = max((g.padded_numel(tp, shard) for s in accumulating
                       for g in s.model.groups if g.numel), default=0)
        buffers = gathered + largest * rs_bytes
        if tp > 1:
            buffers += 2 * workload.seq * workload.micro_batch * model.hidden * ag_bytes
    extra = dict(base.extra)
    for name, size in rank.buffers.items():
        extra[name] = int(size)
    memory = attrs.evolve(base, grads=grads, comm_buffers=buffers, activations=by_mode[mode],
                          activations_by_mode=by_mode, extra=extra)
    collectives: list[Collective] = []
    for _, part in parts:
        if part.collectives is not None:
            collectives.extend(part.collectives)
    for stage in rank.stages:
        found, _ = communication(layout, model, workload, parts, dtype=dtype,
                                 reduce_dtype=reduce_dtype, mode=mode, tp=tp, shard=shard,
                                 stage=stage)
        collectives += found
    collectives += rank.sends
    traffic = dim_traffic(layout, collectives, intra_gbps, inter_gbps)
    return RankEstimate(rank.coordinate, tuple(s.label for s in rank.stages),
                        model.layers, model.params, memory, traffic, rank.in_flight,
                        tuple(rank.sends), accumulates=shard > 1 and bool(accumulating))


def pipeline_ranks(
    layout: Layout, whole: ModelShape, pipeline: EstimatePipeline, workload: Workload,
    parts: Sequence[tuple[str, EstimatePart]], **kwargs: Any,
) -> tuple[RankEstimate, ...]:
    """Every coordinate of ``pipeline`` estimated (see the module docstring)."""
    if not pipeline.ranks:
        raise EstimateError(f"the pipeline over {pipeline.dim} states no ranks")
    return tuple(rank_estimate(layout, whole, rank, workload, parts, **kwargs)
                 for rank in pipeline.ranks)


__all__ = ["RankEstimate", "merged_model", "pipeline_ranks", "rank_estimate"]
