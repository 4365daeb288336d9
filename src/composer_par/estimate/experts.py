"""The routed experts as expert parallelism holds them: each group's experts tensors in
a group of their own, ``num_experts / ep`` experts per rank, which data parallelism
shards or replicates over its dims without ep (``ParamGroup.apart``), as FSDP2 shards
the modules a plugin asks to be sharded apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.layout import Layout
from composer_par.estimate.model_shape import ModelShape, ParamGroup

if TYPE_CHECKING:
    from composer_par.estimate.timing import DimTraffic


def experts_apart(model: ModelShape, layout: Layout) -> ModelShape:
    """``model`` with every group's routed experts tensors moved to a group of their own
    (named ``"<group> experts"``, right after it), holding this rank's ``num_experts /
    ep`` experts and sharded apart from ``layout.experts_dim``; unchanged without expert
    parallelism or experts."""
    dim = layout.experts_dim
    if dim is None or not model.experts_params:
        return model
    ep, split = layout.experts_size(), layout.experts_split_size()
    groups: list[ParamGroup] = []
    for group in model.groups:
        routed = [t for t in group.tensors if t.experts]
        if not routed:
            groups.append(group)
            continue
        rest = tuple(t for t in group.tensors if not t.experts)
        if rest:
            groups.append(attrs.evolve(group, tensors=rest))
        held = tuple(attrs.evolve(t, shape=_held_shape(t.shape, ep, split)) for t in routed)
        groups.append(ParamGroup(f"{group.name} experts", held, block=group.block,
                                 count=group.count, apart=(dim,)))
    return attrs.evolve(model, groups=tuple(groups))


def _held_shape(shape: tuple[int, ...], ep: int, split: int) -> tuple[int, ...]:
    """One rank's part of a routed experts tensor: ``1/ep`` of its experts (tensor dim 0)
    and, split over ``split`` ranks (expert tensor parallelism), ``1/split`` of each
    expert's weights (tensors of three or more tensor dims; counted on the last dim). A
    bias (two tensor dims, one row per expert) is counted whole: the down projection's
    is, and the gate/up one's split share is too small to matter."""
    held = (-(-shape[0] // ep), *shape[1:])
    if split > 1 and len(held) >= 3:
        held = (*held[:-1], -(-held[-1] // split))
    return held


def split_apart(model: ModelShape) -> tuple[ModelShape, ModelShape]:
    """(the groups data parallelism runs over all its dims, the groups sharded apart),
    each as a model shape."""
    together = tuple(g for g in model.groups if not g.apart)
    apart = tuple(g for g in model.groups if g.apart)
    return attrs.evolve(model, groups=together), attrs.evolve(model, groups=apart)




@attrs.frozen
class ExpertRow:
    """One kind of expert-parallel all-to-all per step and rank: its payload, per MoE
    block and micro-batch, and the bytes this rank sends inside and between nodes."""

    why: str
    calls: int
    payload: int
    per_block: float
    intra_bytes: float
    inter_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"why": self.why, "calls": self.calls, "payload_bytes": self.payload,
                "per_block_bytes": round(self.per_block),
                "intra_node_bytes": round(self.intra_bytes),
                "inter_node_bytes": round(self.inter_bytes)}


@attrs.frozen
class ExpertsSummary:
    """What expert parallelism holds and moves on one rank."""

    dim: str
    size: int
    experts_per_rank: int
    experts_shard: int  # ranks each of them is further sharded over (FSDP2 without ep)
    dense_params: int  # elements one rank holds
    experts_params: int
    active_params: int  # of the whole model, per token
    all_to_all: tuple[ExpertRow, ...]

    @property
    def all_to_all_bytes(self) -> int:
        return sum(r.payload for r in self.all_to_all)

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "size": self.size, "experts_per_rank": self.experts_per_rank,
                "experts_shard": self.experts_shard,
                "params_per_rank": {"dense": self.dense_params,
                                    "experts": self.experts_params,
                                    "total": self.dense_params + self.experts_params},
                "active_params_per_token": self.active_params,
                "all_to_all": [r.to_dict() for r in self.all_to_all],
                "all_to_all_bytes": self.all_to_all_bytes,
                "all_to_all_intra_node_bytes": round(sum(r.intra_bytes
                                                         for r in self.all_to_all)),
                "all_to_all_inter_node_bytes": round(sum(r.inter_bytes
                                                         for r in self.all_to_all))}


def experts_summary(layout: Layout, model: ModelShape, held: ModelShape, local_params: int,
                    traffic: Sequence[DimTraffic], runs: int) -> ExpertsSummary | None:
    """The summary of expert parallelism, or None without it: ``held`` is the model as
    :func:`experts_apart` made it, ``local_params`` the elements a rank holds, ``runs``
    the micro-batches of a step."""
    dim, moe = layout.experts_dim, model.moe
    if dim is None or moe is None or layout.experts_size() < 2:
        return None
    size = layout.experts_size()
    tp = layout.tensor_parallel_size()
    shard = layout.shard_size((dim,))
    experts = sum(g.local_numel(tp, shard) * g.count for g in held.groups if g.apart)
    rows = []
    for t in traffic:
        if t.dim.name != dim:
            continue
        for c in t.collectives:
            if c.kind != "all_to_all":
                continue
            from composer_par.estimate.timing import split_bytes

            intra, inter = split_bytes(c.kind, c.payload, c.group_size or t.dim.size,
                                       c.nodes if c.nodes is not None else t.dim.nodes)
            rows.append(ExpertRow(c.why, c.calls, c.payload,
                                  c.payload / max(1, moe.moe_layers * runs), intra, inter))
    return ExpertsSummary(dim, size, moe.num_experts // size, shard,
                          local_params - experts, experts, model.active_params, tuple(rows))


__all__ = ["ExpertRow", "ExpertsSummary", "experts_apart", "experts_summary", "split_apart"]
