"""Communication per step: the collectives of each mesh dim, as the plugins state them
(:class:`~composer_par.estimate.parts.EstimatePart`), else from the built-in estimator of
the dim's role (shard: FSDP, replicate: HSDP/DDP, model parallel: TP)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.experts import split_apart
from composer_par.estimate.layout import DimInfo, Layout, run_nodes
from composer_par.estimate.model_shape import ModelShape
from composer_par.estimate.units import bytes_of
from composer_par.estimate.workload import Workload
from composer_par.plugin.base import Role

if TYPE_CHECKING:
    from composer_par.estimate.parts import EstimatePart, EstimateStage


@attrs.frozen
class Collective:
    """Collectives of one kind on one mesh dim per step: ``calls`` of them, ``payload``
    logical bytes in all (see :mod:`composer_par.testing.comm_count`).

    ``group_size``/``nodes`` override the mesh dim's group (FSDP2's sub-groups for an
    int ``reshard_after_forward``). A ``send`` is point-to-point: its payload goes once
    from this rank to one peer, over the network when ``nodes`` is 2 (the peer is on
    another node), inside the node when 1."""

    dim: str
    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, send
    payload: int
    calls: int
    why: str
    group_size: int | None = None
    nodes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


def communication(
    layout: Layout, model: ModelShape, workload: Workload,
    parts: Sequence[tuple[str, EstimatePart]], *, dtype: str, reduce_dtype: str, mode: str,
    tp: int, shard: int, stage: EstimateStage | None = None,
) -> tuple[list[Collective], list[str]]:
    """Every collective of one step: the plugins' own, then the built-in estimator of each
    mesh dim's role where no plugin replaced it; and notes on the dims none covers.

    With ``stage`` (a piece of a model cut into pipeline stages): the built-in
    collectives of that piece alone, run as often as it says; the plugins' own
    collectives are the caller's to add once per rank."""
    notes: list[str] = []
    micro = workload.grad_accum
    # The training step's sync policy decides how many backwards reduce.
    scatters, all_reduces = workload.reductions()
    gathers: tuple[int | None, int | None] = (None, None)
    if stage is not None:
        # The stage's runs are every microbatch of the step (accumulation included).
        model = stage.model
        micro = stage.runs
        scatters = all_reduces = 1 if stage.accumulates else micro
        gathers = (stage.block_gathers, stage.root_gathers)
    abytes = bytes_of(dtype)
    ag_bytes, rs_bytes = bytes_of(dtype), bytes_of(reduce_dtype)
    replaced = {d for who, part in parts if part.collectives is not None
                for d in (*_claimed_dims(layout, who), *part.replaces)}
    collectives: list[Collective] = []
    for _, part in parts:
        if part.collectives is not None and stage is None:
            collectives.extend(part.collectives)
    model, apart = split_apart(model)
    for dim in layout.dims:
        if dim.size <= 1 or dim.name in replaced:
            continue
        if dim.role in (Role.SHARD, Role.REPLICATE) and apart.groups:
            # the groups sharded apart (experts): over the data-parallel group without
            # the dims they differ along
            without = apart.groups[0].apart
            found = _data_parallel(layout, apart, dim, tp, ag_bytes, rs_bytes, micro,
                                   scatters, all_reduces, gathers,
                                   layout.shard_size(without), without)
            collectives += [attrs.evolve(c, why=f"experts: {c.why}") for c in found]
        if dim.role in (Role.SHARD, Role.REPLICATE):
            # FSDP2 shards over the shard dim and the folded dims flattened (dp_shard x
            # cp): its collectives run over that group, each rank holding 1/(its size).
            collectives += _data_parallel(layout, model, dim, tp, ag_bytes, rs_bytes, micro,
                                          scatters, all_reduces, gathers, shard, ())
        elif dim.role is Role.MODEL_PARALLEL:
            collectives += _tp_collectives(layout, model, workload, dim, abytes, ag_bytes,
                                           mode, micro, shard,
                                           {g.name.removesuffix(" experts")
                                            for g in apart.groups})
        elif dim.role is Role.OTHER:
            notes.append(f"{dim.name}: {dim.plugin} states no estimate (role 'other')")
    return collectives, notes


def _data_parallel(
    layout: Layout, model: ModelShape, dim: DimInfo, tp: int, ag_bytes: int, rs_bytes: int,
    micro: int, scatters: int, all_reduces: int, gathers: tuple[int | None, int | None],
    shard: int, without: tuple[str, ...],
) -> list[Collective]:
    """The shard or replicate dim's collectives of ``model``'s groups, run over the
    data-parallel group less ``without``."""
    group, nodes = layout.data_parallel_group(dim, without)
    if dim.role is Role.SHARD:
        if gathers != (None, None):
            found = _stage_fsdp_collectives(model, dim, tp, ag_bytes, rs_bytes, gathers,
                                            scatters, group)
        else:
            found = _fsdp_collectives(layout, model, dim, tp, ag_bytes, rs_bytes, micro,
                                      scatters, group)
        return _over(found, group, nodes)
    return _over(_replicate_collectives(model, dim, tp, shard, rs_bytes, all_reduces,
                                        with_shard=shard > 1), group, nodes)


def _over(collectives: list[Collective], group: int, nodes: int | None) -> list[Collective]:
    """``collectives`` run over a data-parallel group wider than their mesh dim (nodes not
    None: the folded dims flattened in); those already on a sub-group keep it."""
    if nodes is None:
        return collectives
    return [c if c.group_size is not None else attrs.evolve(c, group_size=group, nodes=nodes)
            for c in collectives]


def _claimed_dims(layout: Layout, plugin: str) -> set[str]:
    return {d.name for d in layout.dims if d.plugin == plugin}


def _fsdp_collectives(
    layout: Layout, model: ModelShape, dim: DimInfo, tp: int, ag_bytes: int, rs_bytes: int,
    micro: int, reductions: int | None = None, group: int | None = None,
) -> list[Collective]:
    """FSDP2 over ``dim`` (a shard group of ``group`` ranks, default the dim's): which
    groups all-gather and reduce-scatter, with padding."""
    f = group or dim.size
    out: list[Collective] = []
    groups = [g for g in model.groups if g.numel]
    ag_fwd = sum(g.padded_numel(tp, f) * g.count for g in groups) * ag_bytes
    calls = sum(g.count for g in groups)
    out.append(Collective(dim.name, "all_gather", ag_fwd * micro, calls * micro,
                          "parameters, forward (every group)"))
    # Which groups are resharded after forward, so all-gathered again in backward: None
    # (torch's default) reshards every group but the root's; True or an int n >= the
    # shard size every group it is given to; 1 < n < f to runs of n ranks (a sub-group);
    # False (and n = 1) none.
    again = []
    runs: dict[int, list[Any]] = {}
    for g in groups:
        reshard = layout.reshard_of(g.name)
        if reshard is None:
            if g.name != "root" or g.block:
                again.append(g)
        elif isinstance(reshard, bool):
            if reshard:
                again.append(g)
        elif reshard >= f:
            again.append(g)
        elif reshard > 1:
            runs.setdefault(reshard, []).append(g)
    for size, members in sorted(runs.items()):
        payload = sum(g.padded_numel(tp, f) * g.count for g in members) * ag_bytes
        out.append(Collective(dim.name, "all_gather", payload * micro,
                              sum(g.count for g in members) * micro,
                              f"parameters, backward (resharded to groups of {size})",
                              group_size=size, nodes=run_nodes(layout, dim.name, size)))
    if again:
        payload = sum(g.padded_numel(tp, f) * g.count for g in again) * ag_bytes
        out.append(Collective(dim.name, "all_gather", payload * micro,
                              sum(g.count for g in again) * micro,
                              "parameters, backward (groups resharded after forward)"))
    rs = sum(g.padded_numel(tp, f) * g.count for g in groups) * rs_bytes
    times = micro if reductions is None else reductions
    out.append(Collective(dim.name, "reduce_scatter", rs * times, calls * times,
                          "gradients, backward (every group)" if times == micro
                          else "gradients, once per step (accumulated over the microbatches)"))
    return out


def _stage_fsdp_collectives(
    model: ModelShape, dim: DimInfo, tp: int, ag_bytes: int, rs_bytes: int,
    gathers: tuple[int | None, int | None], reductions: int, group: int | None = None,
) -> list[Collective]:
    """FSDP2 over ``dim`` (a shard group of ``group`` ranks, default the dim's) inside a
    pipeline stage whose runtime says how often it gathers each block group and its root
    group per step."""
    f = group or dim.size
    out: list[Collective] = []
    groups = [g for g in model.groups if g.numel]
    payload = calls = 0
    for g in groups:
        times = gathers[0] if g.block else gathers[1]
        times = 2 if times is None else times
        payload += g.padded_numel(tp, f) * g.count * ag_bytes * times
        calls += g.count * times
    if calls:
        out.append(Collective(dim.name, "all_gather", payload, calls,
                              "parameters, as the pipeline schedule runs the stage (a "
                              "forward after a backward finds them gathered)"))
    rs = sum(g.padded_numel(tp, f) * g.count for g in groups) * rs_bytes
    count = sum(g.count for g in groups)
    if count:
        out.append(Collective(dim.name, "reduce_scatter", rs * reductions, count * reductions,
                              "gradients, once per step (accumulated over the microbatches)"))
    return out


def _replicate_collectives(
    model: ModelShape, dim: DimInfo, tp: int, shard: int, rs_bytes: int, times: int,
    with_shard: bool,
) -> list[Collective]:
    groups = [g for g in model.groups if g.numel]
    payload = sum(g.local_numel(tp, shard) * g.count for g in groups) * rs_bytes
    calls = sum(g.count for g in groups)
    why = ("gradient shards after the reduce-scatter (HSDP)" if with_shard
           else "gradients, per group (replicate alone, DDP-like)")
    return [Collective(dim.name, "all_reduce", payload * times, calls * times, why)]


def _block_linears(model: ModelShape, moe_blocks: set[str]) -> tuple[int, int, int]:
    """(row-parallel, column-parallel, MLP row-parallel) Linears of every block: a dense
    block has two row-parallel outputs (attention's, the MLP's) and the column-parallel
    rest of its matrices; a MoE block whose routed experts a plugin sets apart (EP,
    ``moe_blocks``) its attention's output and its shared expert's, and the rest of the
    matrices TP splits (the router is not among them) column-parallel. A shape from
    numbers counts no matrices: its MoE blocks keep the dense blocks' column count."""
    colwise_dense = max(2, model.matrices_per_block - 2) if model.matrices_per_block else 2
    rows, cols, mlp = 2 * model.layers, colwise_dense * model.layers, model.layers
    if model.moe is None:
        return rows, cols, mlp
    rowwise = 1 + (1 if model.moe.shared_ffn else 0)
    for g in model.groups:
        if g.name not in moe_blocks or not g.block:
            continue
        colwise = (max(0, sum(1 for t in g.tensors if t.tp) - rowwise)
                   if model.matrices_per_block else colwise_dense)
        rows += (rowwise - 2) * g.count
        cols += (colwise - colwise_dense) * g.count
        mlp += (rowwise - 2) * g.count
    return rows, cols, mlp


def _tp_collectives(
    layout: Layout, model: ModelShape, workload: Workload, dim: DimInfo, act_bytes: int,
    grad_bytes: int, mode: str, micro: int, shard: int, moe_blocks: set[str],
) -> list[Collective]:
    x = workload.seq * workload.micro_batch * model.hidden * act_bytes
    layers = model.layers
    # A checkpointed block's recomputation in backward issues its collectives again: up
    # to the last tensor backward needs (torch's early stop, full checkpointing's
    # default): not the MLP's output collective; without early stop, all of them;
    # selective checkpointing that saves collective outputs (the plugin's default), none.
    reissue = layout.reissue(mode)
    recomputed = layers // layout.checkpoint_every if reissue != "none" else 0
    outputs_again = recomputed if reissue == "all" else 0  # the MLP's output collective
    has_root = any(not g.block and g.numel for g in model.groups)
    root = 1 if has_root else 0
    out: list[Collective] = []
    if layout.sequence_parallel:
        # per block and direction: gather the attention and the MLP input, reduce-scatter
        # their outputs; the embedding scatters (forward) and the head gathers its input;
        # a recomputed block gathers both inputs again and reduce-scatters attention's
        gathers = 2 * (2 * layers + root) + 2 * recomputed
        scatters = 2 * (2 * layers + root) + recomputed + outputs_again
        out.append(Collective(dim.name, "all_gather", gathers * x * micro, gathers * micro,
                              "activations (sequence parallel): attention/MLP inputs"))
        out.append(Collective(dim.name, "reduce_scatter", scatters * x * micro,
                              scatters * micro,
                              "activations (sequence parallel): attention/MLP outputs"))
        if shard > 1:
            # the sequence-parallel norms' gradients are partial sums over tp; FSDP2
            # all-reduces them to the parameters' placement before reduce-scattering
            norms = sum(g.untouched_numel() * g.count for g in model.groups)
            if norms:
                count = sum(sum(1 for t in g.tensors if not t.tp) * g.count
                            for g in model.groups)
                out.append(Collective(dim.name, "all_reduce", norms * grad_bytes * micro,
                                      count * micro, "gradients of sequence-parallel norms"))
    else:
        # forward: the row-parallel outputs (2 per dense block) and the embedding;
        # backward: the input gradient of every column-parallel Linear that takes a
        # replicated input (torch's ColwiseParallel reduces each separately) and of the
        # output head. A recomputed block issues its forward's again but the MLP's
        # output (the last: early stop), or all of them.
        rowwise, colwise, mlp = _block_linears(model, moe_blocks)
        if recomputed:
            again = rowwise if reissue == "all" else rowwise - mlp
            recomputed = again * recomputed // max(1, layers)
        calls = rowwise + root + recomputed + colwise + root
        per_block = (f"forward {rowwise // layers}, backward {colwise // layers} per block"
                     if layers and not rowwise % layers and not colwise % layers else
                     f"forward {rowwise}, backward {colwise} over {layers} blocks")
        out.append(Collective(dim.name, "all_reduce", calls * x * micro, calls * micro,
                              f"activations: {per_block} (one per column-parallel input), "
                              "+1 each way at the embedding / output head"
                              + ("; MoE blocks: attention and shared expert only"
                                 if moe_blocks else "")))
    if model.vocab and has_root and not layout.loss_parallel:
        logits = workload.seq * workload.micro_batch * model.vocab * act_bytes
        out.append(Collective(dim.name, "all_gather", logits * micro, micro,
                              "logits gathered from the vocabulary-split output head"))
    elif model.vocab and has_root:
        # Loss-parallel cross-entropy (torch's) reduces one fp32 value per token three
        # times in forward, over the vocabulary shards: the logits' max, the sum of their
        # exponentials and the target's logit; its backward is local.
        per_token = workload.seq * workload.micro_batch * 4
        out.append(Collective(dim.name, "all_reduce", 3 * per_token * micro, 3 * micro,
                              "loss-parallel cross-entropy: max, sum of exponentials and "
                              "target logit per token"))
    return out
