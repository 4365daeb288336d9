"""A model cut into pipeline stages: each coordinate along the cut mesh dim estimated on
its own (:class:`RankEstimate`), from what the cutting plugin states
(:class:`~composer_par.estimate.parts.EstimatePipeline`).

A rank's memory is the core's accounting (:mod:`.memory`) applied to the parameter
groups of its stages, with its activations counted per stage: one microbatch's
(:func:`.memory.activation_bytes` of the stage's blocks, and the logits on the stage
that has them), weighted by the microbatches the rank holds at each moment the plugin
lists; the heaviest moment counts, plus one block being recomputed under full
checkpointing. Every plugin is asked for its terms once per stage
(``composer_par_estimate`` with ``stage``: the stage's model shape and its runs; stages
equal but for their label are asked once): the collectives add up; memory terms add up
across the rank's stages, except transient ones (held while one stage runs), of which
the largest stage's counts.

Its communication is the plugins' collectives of each stage plus the rank's
point-to-point sends, timed as every other collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.collectives import Collective
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.layout import local_workload
from composer_par.estimate.memory import Memory, activation_bytes, memory_per_rank
from composer_par.estimate.parts import (
    MemoryTerm,
    held_shape,
    hooked_collectives,
    plugin_parts,
)
from composer_par.estimate.timing import DimTraffic, dim_traffic
from composer_par.estimate.workload import AC_MODES

if TYPE_CHECKING:
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.model_shape import ModelShape
    from composer_par.estimate.parts import EstimatePipeline, EstimateRank, EstimateStage
    from composer_par.estimate.workload import Workload
    from composer_par.plan import ParallelPlan


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
    whole: ModelShape,
) -> int:
    every, matmul_every = layout.checkpoint_every, layout.checkpoint_matmul_every
    sp, lp = layout.sequence_parallel, layout.loss_parallel
    workload = local_workload(layout, workload)
    # The final norm runs on the stage with the head (the logits); a model without a
    # vocabulary names no such stage, and each stage counts it, as before the cut.
    per_stage = [activation_bytes(s.model, workload, dtype, tp=tp, sequence_parallel=sp,
                                  loss_parallel=lp, mode=mode, every=every, recompute=False,
                                  dispatched=s.model.dispatched, matmul_every=matmul_every,
                                  head=not whole.vocab or bool(s.model.vocab),
                                  saved_attention=layout.checkpoint_saves_attention,
                                  saved_collectives=layout.checkpoint_saves_collectives)
                 for s in rank.stages]
    held = max((sum(n * b for n, b in zip(moment, per_stage, strict=True))
                for moment in rank.held), default=0)
    if mode == "full" and any(s.model.layers // every for s in rank.stages):
        # one block's activations while it is recomputed: the heaviest of the rank's
        held += max(activation_bytes(one, workload, dtype, tp=tp, sequence_parallel=sp,
                                     loss_parallel=lp, mode="none", dispatched=one.dispatched,
                                     head=False)
                    for s in rank.stages for one in _single_blocks(s.model))
    return held


def _single_blocks(model: ModelShape) -> list[ModelShape]:
    """Each kind of block of ``model`` as a model of that one block (with the experts set
    apart from it)."""
    out = []
    for g in model.groups:
        if g.block and not g.apart:
            partners = [attrs.evolve(a, count=1) for a in model.groups
                        if a.apart and a.parent == g.name]
            out.append(attrs.evolve(model, layers=1, vocab=None,
                                    groups=(attrs.evolve(g, count=1), *partners)))
    return out


def rank_terms(per_stage: Sequence[Sequence[tuple[str, MemoryTerm]]]
               ) -> list[tuple[str, MemoryTerm]]:
    """The memory terms of a rank holding several stages: held terms summed over the
    stages, transient ones the largest stage's (by plugin, category and why)."""
    out: list[tuple[str, MemoryTerm]] = []
    largest: dict[tuple[str, str, str], tuple[str, MemoryTerm]] = {}
    for terms in per_stage:
        for who, term in terms:
            if not term.transient:
                out.append((who, term))
                continue
            key = (who, term.category, term.why)
            if key not in largest or term.bytes > largest[key][1].bytes:
                largest[key] = (who, term)
    return out + list(largest.values())


# A stage without its label -> its plugins' memory terms and collectives.
StageAnswers = dict["EstimateStage", tuple[list[tuple[str, MemoryTerm]], list[Collective]]]


def _stage_answers(plan: ParallelPlan, layout: Layout, stage: EstimateStage,
                   workload: Workload, answers: StageAnswers
                   ) -> tuple[list[tuple[str, MemoryTerm]], list[Collective]]:
    """The plugins' memory terms and collectives for ``stage``, asked once per stage that
    differs in more than its label: a pipeline of one layer a stage repeats one shape on
    every rank (Llama 3 405B: 128 stages, 3 shapes), and suggest estimates thousands of
    such layouts. The hook's contract says an answer depends on the stage's part of the
    model, passes and gathers, not on its label."""
    key = attrs.evolve(stage, label="")
    if key not in answers:
        parts = plugin_parts(plan, layout, stage.model, workload, stage)
        answers[key] = ([(who, t) for who, part in parts for t in part.memory_terms()],
                        hooked_collectives(plan, layout, stage.model, workload, parts))
    return answers[key]


def rank_estimate(
    plan: ParallelPlan, layout: Layout, whole: ModelShape, rank: EstimateRank,
    workload: Workload, *, dtype: str, mode: str, tp: int, shard: int, intra_gbps: float,
    inter_gbps: float, pipeline_plugin: str = "", answers: StageAnswers | None = None,
) -> RankEstimate:
    """``rank`` estimated; ``answers``: the plugins' answers for stages already asked,
    shared by the ranks of one pipeline (see :func:`_stage_answers`)."""
    for moment in rank.held:
        if len(moment) != len(rank.stages):
            raise EstimateError(f"pipeline rank {rank.coordinate}: a held moment lists "
                                f"{len(moment)} stage(s) of {len(rank.stages)}")
    # Each stage's model as the model-parallel plugins leave one rank's view of it.
    rank = attrs.evolve(rank, stages=tuple(
        attrs.evolve(s, model=held_shape(plan, layout, s.model)) for s in rank.stages))
    model = merged_model(whole, rank.stages)
    per_stage: list[list[tuple[str, MemoryTerm]]] = []
    collectives: list[Collective] = []
    answers = {} if answers is None else answers
    for stage in rank.stages:
        stage_terms, stage_collectives = _stage_answers(plan, layout, stage, workload,
                                                        answers)
        per_stage.append(stage_terms)
        collectives += stage_collectives
    terms = rank_terms(per_stage)
    terms += [("", MemoryTerm("other", int(size), name))
              for name, size in rank.buffers.items()]
    by_mode = {m: _activations(layout, rank, workload, dtype, tp, m, whole)
               for m in AC_MODES}
    memory = memory_per_rank(layout, model, workload, terms, dtype=dtype, mode=mode, tp=tp,
                             shard=shard, by_mode=by_mode)
    collectives += rank.sends
    traffic = dim_traffic(layout, collectives, intra_gbps, inter_gbps)
    accumulates = shard > 1 and any(s.accumulates for s in rank.stages)
    return RankEstimate(rank.coordinate, tuple(s.label for s in rank.stages),
                        model.layers, model.params, memory, traffic, rank.in_flight,
                        tuple(rank.sends), accumulates=accumulates)


def pipeline_ranks(
    plan: ParallelPlan, layout: Layout, whole: ModelShape, pipeline: EstimatePipeline,
    workload: Workload, **kwargs: Any,
) -> tuple[RankEstimate, ...]:
    """Every coordinate of ``pipeline`` estimated (see the module docstring)."""
    if not pipeline.ranks:
        raise EstimateError(f"the pipeline over {pipeline.dim} states no ranks")
    answers: StageAnswers = {}
    return tuple(rank_estimate(plan, layout, whole, rank, workload, answers=answers, **kwargs)
                 for rank in pipeline.ranks)


__all__ = ["RankEstimate", "merged_model", "pipeline_ranks", "rank_estimate", "rank_terms"]
