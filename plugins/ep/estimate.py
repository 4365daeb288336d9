"""What EP costs a step, for ``composer-par estimate`` and ``suggest``: the experts a rank
holds (:func:`experts_apart`), its token all-to-alls (the same logical payload bytes
:class:`~composer_par.testing.comm_count.CommCounter` counts: an all-to-all's input), with
``expert_tp`` its all-reduces over that dim, and alone (no data-parallel plugin) its
averaging of the dense gradients; and the report's section on it. Pure arithmetic: no
torch.

The experts: each MoE block's routed experts tensors (fused on tensor dim 0) move to a
group of their own, ``"<block> experts"``, holding ``num_experts / ep`` of them (and,
split over ``expert_tp``, ``1 / tp`` of each expert's weights), set apart from ep
(``ParamGroup.apart``): data parallelism shards them over its dims without ep, as FSDP2
shards the modules EP asks to be sharded apart.

Per MoE block and micro-batch a rank with ``T`` tokens routes ``T x top_k`` (token,
slot) pairs. The dispatch all-to-all's input is this rank's pairs (``S``), the combine's
the pairs it received for its experts (``R``); backward runs their transposes, the
combine's with input ``S`` and the dispatch's with input ``R``. Routing decides ``R``;
summed over the ep ranks it equals the sum of ``S``, and under uniform routing each
rank receives ``S`` on average: the estimate counts ``R = S``. Before each dispatch the
counts per expert are exchanged (one int64 per expert).

With expert tensor parallelism each tp rank computes its part of every pair's output,
so per MoE block and micro-batch the tp ranks all-reduce the ``S`` pairs' partial outputs
(forward, and again where the block is recomputed) and the ``T`` tokens' input gradient
(backward), and the gradient of an output-projection bias kept whole on every tp rank
(this rank's experts' rows)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from composer_par.plugin import (
    Collective,
    EstimatePart,
    EstimateSection,
    ModelShape,
    ParamGroup,
    Role,
    dtype_bytes,
    format_bytes,
    format_count,
    runs_of,
    split_bytes,
    table,
)

from .expert_tp import kept_whole

#: Bytes of one exchanged count (``torch.bincount``'s int64).
COUNT_BYTES = 8


def pair_bytes(hidden: int, dtype_bytes: int) -> int:
    """Bytes one routed (token, slot) pair moves in one all-to-all."""
    return hidden * dtype_bytes


def all_to_all_collectives(
    dim: str, *, size: int, moe_layers: int, tokens: int, top_k: int, hidden: int,
    num_experts: int, dtype_bytes: int, passes: int = 1, recomputed: int = 0,
    received: int | None = None,
) -> tuple[Collective, ...]:
    """One step's all-to-alls over ``dim`` on one rank: ``passes`` micro-batches of
    ``tokens`` tokens each through ``moe_layers`` MoE blocks, of which ``recomputed``
    run their forward again in backward (activation checkpointing). ``received``: the
    pairs this rank's experts receive per MoE block and micro-batch (default: the
    uniform routing's, its own ``tokens x top_k``)."""
    if size < 2 or moe_layers < 1:
        return ()
    sent = tokens * top_k
    got = sent if received is None else received
    row = pair_bytes(hidden, dtype_bytes)
    runs = moe_layers * passes
    again = recomputed * passes
    out = [
        Collective(dim, "all_to_all", runs * sent * row, runs,
                   "dispatch, forward: this rank's routed pairs to their experts' ranks"),
        Collective(dim, "all_to_all", runs * got * row, runs,
                   "combine, forward: the received pairs' outputs back"),
        Collective(dim, "all_to_all", runs * sent * row, runs,
                   "combine, backward: the outputs' gradients to the experts' ranks"),
        Collective(dim, "all_to_all", runs * got * row, runs,
                   "dispatch, backward: the inputs' gradients back"),
        Collective(dim, "all_to_all", runs * num_experts * COUNT_BYTES, runs,
                   "routing counts per expert, before each dispatch"),
    ]
    if again:
        out.append(Collective(
            dim, "all_to_all", again * ((sent + got) * row + num_experts * COUNT_BYTES),
            3 * again, "recomputation in backward: counts, dispatch and combine again"))
    return tuple(out)


def behind_pairs(collective: Collective, share: float) -> tuple[Collective, ...]:
    """``collective`` split by the share of its passes a pipeline runs in forward-backward
    pairs (pp's ``overlap``): that share runs behind the other half's compute (the
    dispatch marks its collectives), the rest as before."""
    paired = round(collective.calls * share)
    if paired == 0:
        return (collective,)
    part = collective.payload * paired // collective.calls
    hidden = attrs.evolve(collective, payload=part, calls=paired, overlap="compute",
                          why=f"{collective.why} (in forward-backward pairs: behind the "
                          "other microbatch's compute)")
    if paired == collective.calls:
        return (hidden,)
    return (hidden, attrs.evolve(collective, payload=collective.payload - part,
                                 calls=collective.calls - paired))


def expert_tp_collectives(
    dim: str, *, size: int, moe_layers: int, tokens: int, top_k: int, hidden: int,
    dtype_bytes: int, passes: int = 1, recomputed: int = 0, whole_bias: tuple[int, ...] = (),
) -> tuple[Collective, ...]:
    """One step's all-reduces over ``dim`` (expert tensor parallelism over ``size``
    ranks) on one rank; ``whole_bias``: the elements this rank holds of each output
    projection bias kept whole over ``dim``, one entry per MoE block."""
    if size < 2 or moe_layers < 1:
        return ()
    row = pair_bytes(hidden, dtype_bytes)
    forwards = (moe_layers + recomputed) * passes
    out = [
        Collective(dim, "all_reduce", forwards * tokens * top_k * row, forwards,
                   "experts split over tp, forward: each routed pair's partial outputs "
                   "summed" + (" (recomputation included)" if recomputed else "")),
        Collective(dim, "all_reduce", moe_layers * passes * tokens * row,
                   moe_layers * passes,
                   "experts split over tp, backward: the tokens' input gradients summed"),
    ]
    if whole_bias:
        out.append(Collective(dim, "all_reduce", sum(whole_bias) * dtype_bytes * passes,
                              len(whole_bias) * passes,
                              "experts split over tp, backward: the gradient of the output "
                              "projection's bias, kept whole on every tp rank"))
    return tuple(out)


def experts_apart(model: ModelShape, dim: str, ep: int, split: int) -> ModelShape:
    """``model`` with every group's routed experts tensors moved to a group of their own
    (named ``"<group> experts"``, right after it), holding this rank's ``num_experts /
    ep`` experts (each split over ``split`` ranks) and set apart from ``dim``."""
    groups: list[ParamGroup] = []
    for group in model.groups:
        routed = [t for t in group.tensors if t.experts]
        if not routed:
            groups.append(group)
            continue
        rest = tuple(t for t in group.tensors if not t.experts)
        if rest:
            groups.append(attrs.evolve(group, tensors=rest))
        held = tuple(attrs.evolve(t, shape=held_shape(t.shape, ep, split)) for t in routed)
        groups.append(ParamGroup(f"{group.name} experts", held, block=group.block,
                                 count=group.count, apart=(dim,), parent=group.name))
    return attrs.evolve(model, groups=tuple(groups))


def held_shape(shape: tuple[int, ...], ep: int, split: int) -> tuple[int, ...]:
    """One rank's part of a routed experts tensor: ``1/ep`` of its experts (tensor dim 0)
    and, split over ``split`` ranks (expert tensor parallelism), ``1/split`` of each
    expert's weights (tensors of three or more tensor dims; counted on the last dim). A
    bias (two tensor dims, one row per expert) is counted whole: the down projection's
    is, and the gate/up one's split share is too small to matter."""
    held = (-(-shape[0] // ep), *shape[1:])
    if split > 1 and len(held) >= 3:
        held = (*held[:-1], -(-held[-1] // split))
    return held


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


ACCOUNTING = (
    "ep: each ep rank holds num_experts / ep experts of every MoE block, sharded by the "
    "data-parallel plugin over its dims without ep (the dense parameters over them and "
    "ep); per MoE block and micro-batch of T tokens a rank routes T*top_k pairs of "
    "hidden*dtype bytes: all-to-all inputs dispatch forward and combine backward its own "
    "pairs, combine forward and dispatch backward the pairs its experts receive (as many "
    "under uniform routing), and num_experts int64 counts before each dispatch; "
    "full checkpointing runs the counts, dispatch and combine again (selective saves "
    "their outputs); the ranks wait for them (no overlap)",
)

#: The ratio of the most loaded ep rank's routed pairs to the mean that the estimate
#: prices as the imbalance risk of an expert-parallel layout.
IMBALANCE = 2.0


def active_params(model: ModelShape) -> int:
    """Parameters one token passes through, of the whole model (``model`` as a rank holds
    it keeps the whole model's count and its MoE fields)."""
    moe = model.moe
    if moe is None:
        return model.params
    experts = moe.expert_size(model.hidden) * moe.num_experts * moe.moe_layers
    return model.params - experts + experts * moe.top_k // moe.num_experts


def summary(layout: Any, model: ModelShape, dim: str, collectives: Sequence[Collective],
            runs: int) -> ExpertsSummary:
    """What a rank holds of the experts and moves by all-to-all, for the report."""
    moe = model.moe
    assert moe is not None
    size = layout.mesh.size(dim)
    tp = layout.tensor_parallel_size()
    shard = layout.shard_size()
    experts_shard = layout.shard_size((dim,))
    experts = sum(g.local_numel(tp, experts_shard) * g.count for g in model.groups if g.apart)
    dense = sum(g.local_numel(tp, shard) * g.count for g in model.groups if not g.apart)
    info = layout.dim(dim)
    rows = []
    for c in collectives:
        if c.dim != dim or c.kind != "all_to_all":
            continue
        intra, inter = split_bytes(c.kind, c.payload, c.group_size or size,
                                   c.nodes if c.nodes is not None else info.nodes)
        rows.append(ExpertRow(c.why, c.calls, c.payload,
                              c.payload / max(1, moe.moe_layers * runs), intra, inter))
    return ExpertsSummary(dim, size, moe.num_experts // size, experts_shard, dense, experts,
                          active_params(model), tuple(rows))


def imbalance_risk(ex: ExpertsSummary, factor: float = IMBALANCE) -> str:
    """What tokens-per-expert imbalance costs: the rank whose experts receive ``factor``
    times the mean pairs moves that many in its combine (forward) and dispatch
    (backward) and computes that many, and every rank waits."""
    received = sum(r.payload for r in ex.all_to_all
                   if r.why.startswith(("combine, forward", "dispatch, backward")))
    share = received / ex.all_to_all_bytes if ex.all_to_all_bytes else 0.0
    slower = 1 + share * (factor - 1)
    return (f"risk: tokens-per-expert imbalance. The estimate assumes uniform routing; the "
            f"ep rank whose experts receive the most pairs sets the pace of every rank: at "
            f"{factor:g}x the mean, its all-to-alls take {slower:.2f}x their estimated time "
            f"and its expert compute {factor:g}x; watch routing_stats (rank_max / "
            "rank_mean) and the router's balancing loss")


def section_lines(ex: ExpertsSummary, model: ModelShape, layout: Any) -> list[str]:
    """The report's section: the experts a rank holds, its parameters (dense and
    experts), and the all-to-alls per step, per MoE block and by where their bytes go."""
    moe = model.moe
    assert moe is not None
    shards = " / ".join(f"{d.name}({d.size})" for d in layout.dims
                        if d.role is Role.SHARD and d.size > 1)
    further = (f", each sharded over {ex.experts_shard} rank(s) by {shards} (not {ex.dim})"
               if ex.experts_shard > 1 else "")
    lines = [f"expert parallelism over {ex.dim}({ex.size}): {ex.experts_per_rank} of "
             f"{moe.num_experts} experts per rank in each of {moe.moe_layers} MoE "
             f"block(s){further}",
             f"  parameters per rank: {format_count(ex.dense_params)} dense + "
             f"{format_count(ex.experts_params)} experts = "
             f"{format_count(ex.dense_params + ex.experts_params)} (of "
             f"{format_count(model.params)}); {format_count(ex.active_params)} active "
             f"per token (top-{moe.top_k} of {moe.num_experts})"]
    if ex.experts_shard > ex.experts_per_rank:
        lines.append(f"  fewer experts per rank ({ex.experts_per_rank}) than ranks sharding "
                     f"them ({ex.experts_shard}): FSDP2 splits each expert's rows (tensor "
                     "dim 1) instead")
    elif ex.experts_shard > 1 and ex.experts_per_rank % ex.experts_shard:
        lines.append(f"  the {ex.experts_per_rank} expert(s) per rank do not divide among the "
                     f"{ex.experts_shard} ranks sharding them: FSDP2 cuts tensor dim 0 (the "
                     "expert) padded to a multiple of them")
    rows = [(r.why, str(r.calls), format_bytes(r.payload), format_bytes(round(r.per_block)),
             format_bytes(r.intra_bytes), format_bytes(r.inter_bytes)) for r in ex.all_to_all]
    rows.append(("total", str(sum(r.calls for r in ex.all_to_all)),
                 format_bytes(ex.all_to_all_bytes),
                 format_bytes(round(sum(r.per_block for r in ex.all_to_all))),
                 format_bytes(sum(r.intra_bytes for r in ex.all_to_all)),
                 format_bytes(sum(r.inter_bytes for r in ex.all_to_all))))
    lines.append(table(rows, ("ALL-TO-ALL", "CALLS", "PAYLOAD", "PER BLOCK", "INTRA-NODE",
                              "INTER-NODE"), right=(1, 2, 3, 4, 5), indent="  "))
    lines.append("  (uniform routing: each rank receives as many pairs as it sends; under "
                 "uneven routing the rank whose experts receive the most moves and computes "
                 "the most, and sets the pace of every rank)")
    return lines


def estimate_part(ep: Any, layout: Any, model: ModelShape, workload: Any, stage: Any,
                  data_parallel: bool) -> EstimatePart:
    """EP's terms: the token all-to-alls over ep (uniform routing: each rank receives as
    many pairs as it sends), with ``expert_tp`` the all-reduces over that dim, and
    without a data-parallel plugin (``data_parallel`` False) the dense gradients'
    all-reduces over ep; the experts' memory and data-parallel terms follow from the
    experts held apart (:func:`experts_apart`)."""
    size = layout.mesh.size(ep.dim) if ep.dim in layout.mesh else 1
    moe = model.moe
    if size < 2:
        return EstimatePart(collectives=())
    if moe is None:
        return EstimatePart(collectives=(), notes=(
            f"{ep.dim}({size}): the model shape names no experts (give --model, or "
            "a MoE --preset), so no all-to-all is counted",))
    dtype = dtype_bytes(workload.dtype)
    runs = runs_of(workload, stage)
    tokens = workload.seq // layout.sequence_split * workload.micro_batch
    moe_layers = sum(g.count for g in model.groups if g.apart and g.block)
    if not any(g.apart for g in model.groups):
        moe_layers = moe.moe_layers if stage is None else 0
    # A checkpointed block's recomputation runs its all-to-alls again (the combine's
    # output is what the router weights' gradient needs), unless the checkpointing saves
    # the functional collectives' outputs (selective's default), EP's among them.
    recomputed = layout.reissued_blocks(workload.activation_checkpoint or "none",
                                        moe_layers)
    collectives = all_to_all_collectives(
        ep.dim, size=size, moe_layers=moe_layers, tokens=tokens, top_k=moe.top_k,
        hidden=model.hidden, num_experts=moe.num_experts, dtype_bytes=dtype, passes=runs,
        recomputed=recomputed)
    split = (layout.mesh.size(ep.expert_tp)
             if ep.expert_tp is not None and ep.expert_tp in layout.mesh else 1)
    if split > 1:
        whole_bias = tuple(t.numel for g in model.groups if g.apart for t in g.tensors
                           if t.experts and kept_whole(t.name.rsplit(".", 1)[-1])
                           for _ in range(g.count))
        collectives += expert_tp_collectives(
            str(ep.expert_tp), size=split, moe_layers=moe_layers, tokens=tokens,
            top_k=moe.top_k, hidden=model.hidden, dtype_bytes=dtype, passes=runs,
            recomputed=recomputed, whole_bias=whole_bias)
    if stage is not None and stage.paired > 0:
        collectives = tuple(c for whole in collectives for c in behind_pairs(whole,
                                                                             stage.paired))
    if not data_parallel:
        # average_gradients: each dense parameter's gradient (this rank's part of it, under
        # TP as the estimate splits it) all-reduced after each backward
        tp = layout.tensor_parallel_size()
        dense = [t for g in model.groups if not g.apart for t in g.tensors if not t.experts
                 for _ in range(g.count)]
        if dense:
            collectives += (Collective(
                ep.dim, "all_reduce", sum(t.local_numel(tp, 1) for t in dense) * dtype * runs,
                len(dense) * runs, "dense gradients averaged over ep, per parameter and "
                "backward (no data-parallel plugin)"),)
    if stage is not None:
        return EstimatePart(collectives=collectives)
    notes = []
    sections: tuple[EstimateSection, ...] = ()
    if layout.pipeline_dim is None:
        ex = summary(layout, model, ep.dim, collectives, runs)
        sections = (EstimateSection("experts", tuple(section_lines(ex, model, layout)), ex),)
        notes.append(imbalance_risk(ex))
    notes.append(f"{ep.dim}({size}): each rank holds {moe.num_experts // size} of the "
                 f"{moe.num_experts} experts of each of {moe.moe_layers} MoE block(s) and "
                 f"routes {tokens} x {moe.top_k} (token, slot) pairs per block and "
                 "micro-batch; the all-to-alls assume uniform routing (each rank receives as "
                 "many pairs as it sends): the rank whose experts receive the most sets the "
                 "pace")
    if ep.capacity_factor is not None:
        notes.append(f"capacity factor {ep.capacity_factor:g}: the pairs it drops are "
                     "not subtracted")
    return EstimatePart(collectives=collectives, sections=sections, accounting=ACCOUNTING,
                        notes=tuple(notes))


__all__ = ["ACCOUNTING", "COUNT_BYTES", "IMBALANCE", "ExpertRow", "ExpertsSummary",
           "active_params", "all_to_all_collectives", "estimate_part",
           "expert_tp_collectives", "experts_apart", "held_shape", "imbalance_risk",
           "pair_bytes", "summary"]
