"""The pipeline's terms of ``composer-par estimate``: what each pp rank holds, runs and
sends, stated to the estimator as an ``EstimatePipeline`` (the estimator applies its own
memory and collective accounting to each rank's stages).

* **the split**: the model shape's blocks in contiguous runs balanced by parameter count
  with :func:`.split.balanced` (what ``split = "auto"`` runs on the model), the
  parameters before the first block counted on the first stage, those after the last
  on the last, those between two blocks with the block before; an explicit split by
  module paths assigns the shape's groups and tensors by name. A shape from numbers
  has no order: half of what lies outside its blocks goes to the first stage (the
  embedding), half to the last (the final norm and the output head). With more stages
  than blocks, those two ends are stages of their own, as the split makes them.
* **activations in flight**: the schedule's timeline (:mod:`.timeline`) says, for each
  rank, the moments when it holds the most stage-microbatch activations
  (:func:`.timeline.peak_in_flight` is their largest count); the estimator weighs each
  stage's microbatches by the stage's own bytes and keeps the heaviest moment.
* **the bubble**: the timeline's idle share.
* **FSDP2 inside a stage**: torch's stage runs every backward with gradient sync off
  and without resharding, and reduces once after the last microbatch, so gradients
  accumulate unsharded; all-gathers are counted by walking the rank's order (a
  forward after a backward finds its parameters gathered; the multi-stage schedules'
  runtime also unshards each stage itself, read from torch's lowered order).
* **point-to-point**: per microbatch, a stage sends its output activation (seq x
  micro-batch x hidden) to the next stage and the gradient of its input to the
  previous one, unless both stages are on the same rank (torch passes them locally);
  it keeps one receive buffer per microbatch for each direction it receives. Intra- or
  inter-node from the topology: the pp group of each coordinate whose peer is on
  another node.

The single-stage schedules (GPipe, 1F1B) need no torch; the multi-stage ones import it
to read the schedule's own order (as ``explain`` does).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import (
    Collective,
    EstimatePipeline,
    EstimateRank,
    EstimateStage,
    dtype_bytes,
    torch_private,
)

from .schedules import SCHEDULES, microbatch_problem, placement
from .split import balanced
from .timeline import peak_in_flight, timeline

if TYPE_CHECKING:
    from composer_par.plugin.pipeline import Timeline

    from . import PP

@attrs.frozen
class _Unit:
    """One piece of the model shape in model order: a block (``group`` with one of its
    ``count`` copies) or tensors outside the blocks."""

    group: Any  # a ParamGroup (one block of it) or None
    tensors: tuple[Any, ...] = ()  # TensorShapes outside the blocks

    @property
    def numel(self) -> int:
        own = sum(t.numel for t in self.tensors)
        return own + (self.group.numel if self.group is not None else 0)


def _stage_units(model: Any, split: Any, num_stages: int
                 ) -> tuple[list[list[_Unit]], list[str]]:
    """The model shape's units per stage, and notes on what had to be assumed."""
    blocks = [g for g in model.groups if g.block and g.numel]
    why = _too_many_stages(model, num_stages)
    if why:
        raise _Unsplittable(why)
    notes: list[str] = []
    if not isinstance(split, str):
        named = _named_split(model, split, num_stages)
        if named is not None:
            return named, notes
        notes.append("the split's module paths do not name this model shape's blocks and "
                     "tensors (a shape from numbers has none): split as \"auto\" instead")
    order = [_Unit(g) for g in blocks for _ in range(g.count)]
    count, lead, trail, between = _placed(model)
    if any(t.position is None for g in model.groups if not g.block for t in g.tensors):
        notes.append("the parameters outside the blocks have no order in this model shape "
                     "(one from numbers): half are counted on the first stage (the "
                     "embedding), half on the last (the final norm and output head)")
    order = [attrs.evolve(u, tensors=tuple(between.get(i, ()))) for i, u in enumerate(order)]
    # More stages than blocks: the ends are stages of their own (split.py's rule).
    alone = count < num_stages
    if alone:
        order = ([_Unit(None, tuple(lead))] if lead else []) + order + (
            [_Unit(None, tuple(trail))] if trail else [])
    counts = _balanced(tuple(u.numel for u in order), num_stages,
                       0 if alone else sum(t.numel for t in lead),
                       0 if alone else sum(t.numel for t in trail))
    stages: list[list[_Unit]] = []
    start = 0
    for n in counts:
        stages.append(order[start:start + n])
        start += n
    if not alone:
        stages[0].insert(0, _Unit(None, tuple(lead)))
        stages[-1].append(_Unit(None, tuple(trail)))
    return stages, notes


def _placed(model: Any) -> tuple[int, list[Any], list[Any], dict[int, list[Any]]]:
    """``(blocks, lead, trail, between)`` of a model shape: the tensors outside the
    blocks before the first, after the last, and after each block index; those of
    unknown place (a shape from numbers) halved between the ends (:func:`_halves`)."""
    count = sum(g.count for g in model.groups if g.block and g.numel)
    lead: list[Any] = []
    trail: list[Any] = []
    between: dict[int, list[Any]] = {}
    unknown: list[Any] = []
    for t in (t for g in model.groups if not g.block for t in g.tensors):
        if t.position is None:
            unknown.append(t)
        elif t.position <= 0:
            lead.append(t)
        elif t.position >= count:
            trail.append(t)
        else:
            between.setdefault(t.position - 1, []).append(t)
    first, last = _halves(unknown)
    return count, lead + first, trail + last, between


def stage_limit(model: Any) -> tuple[int, int]:
    """``(blocks, ends)`` of a model shape: the most stages a split can make is their sum,
    the ends being what the split puts before the first block and after the last."""
    count, lead, trail, _ = _placed(model)
    return count, bool(lead) + bool(trail)


def _too_many_stages(model: Any, num_stages: int) -> str | None:
    """CP602's words when ``num_stages`` outnumber the blocks and the two ends, else
    None."""
    count, ends = stage_limit(model)
    if count + ends >= num_stages:
        return None
    return (f"{num_stages} pipeline stages need a block each, or the parts before the "
            f"first block or after the last, and the model has {count} block(s) and {ends} "
            "such part(s) (CP602): no pipeline terms")


class _Unsplittable(ValueError):
    pass


@functools.lru_cache(maxsize=64)
def _balanced(costs: tuple[int, ...], stages: int, first: int, last: int) -> tuple[int, ...]:
    # suggest prices many layouts of one model: the split of each pp size once
    return tuple(balanced(costs, stages, first, last))


def _halves(tensors: list[Any]) -> tuple[list[Any], list[Any]]:
    """Split tensors of unknown order in halves (by rows) between the first stage (the
    embedding) and the last (the final norm and the output head, as large)."""
    first: list[Any] = []
    last: list[Any] = []
    for t in tensors:
        rows = t.shape[0] if t.shape else 1
        rest = t.shape[1:]
        lead = rows // 2
        if lead:
            first.append(attrs.evolve(t, name=f"{t.name} (first stage)",
                                      shape=(lead, *rest)))
        if rows - lead:
            last.append(attrs.evolve(t, name=f"{t.name} (last stage)",
                                     shape=(rows - lead, *rest)))
    return first, last


def _named_split(model: Any, split: Any, num_stages: int) -> list[list[_Unit]] | None:
    """Units per stage from module paths, or None when the names do not cover the shape."""
    if len(split) != num_stages:
        return None

    def stage_of(name: str) -> int | None:
        for index, paths in enumerate(split):
            if any(name == p or name.startswith(p + ".") for p in paths):
                return index
        return None

    stages: list[list[_Unit]] = [[] for _ in range(num_stages)]
    for g in model.groups:
        if g.block:
            if g.count != 1:
                return None
            at = stage_of(g.name)
            if at is None:
                return None
            stages[at].append(_Unit(g))
        else:
            for t in g.tensors:
                at = stage_of(t.name)
                if at is None:
                    return None
                stages[at].append(_Unit(None, (t,)))
    return stages


def _stage_shape(model: Any, units: list[_Unit], index: int, last: bool) -> Any:
    """The model shape of one stage: its blocks (runs of one group merged) and a root
    group of what it holds outside the blocks."""
    groups: list[Any] = []
    for u in units:
        if u.group is None:
            continue
        if groups and groups[-1].name == u.group.name and u.group.count > 1:
            groups[-1] = attrs.evolve(groups[-1], count=groups[-1].count + 1)
        else:
            groups.append(attrs.evolve(u.group, count=1))
    outside = tuple(t for u in units for t in u.tensors)
    root = next((g for g in model.groups if not g.block), None)
    if outside:
        groups.append(attrs.evolve(root, name=f"stage {index} root", tensors=outside)
                      if root is not None else
                      attrs.evolve(model.groups[0], name=f"stage {index} root",
                                   tensors=outside, block=False, count=1))
    layers = sum(g.count for g in groups if g.block)
    return attrs.evolve(model, groups=tuple(groups), layers=layers,
                        params=sum(g.numel * g.count for g in groups),
                        vocab=model.vocab if last else None)


@attrs.frozen
class _Facts:
    """What one schedule of one size does, for every rank: the timeline, the peak
    stage-microbatches in flight, the heaviest moments, and each rank's order."""

    line: Timeline
    peaks: tuple[int, ...]
    held: tuple[tuple[tuple[int, ...], ...], ...]
    orders: tuple[tuple[tuple[str, int], ...], ...]
    # per rank, (stage, resharded after forward) -> the stage's all-gathers in a step
    gathered: tuple[dict[tuple[int, bool], int], ...]


# Suggest estimates many layouts with one schedule, size and microbatch count: their
# simulated timelines are kept rather than simulated again.
@functools.lru_cache(maxsize=256)
def _facts(schedule: str, pp: int, per_rank: int, microbatches: int, dim: str) -> _Facts:
    info = SCHEDULES[schedule]
    line = timeline(schedule, pp, per_rank, microbatches, dim)
    layout = placement(pp, pp * per_rank, info.style)
    held = tuple(held_moments(line, r, layout[r]) for r in range(pp))
    if info.multi:
        orders = lowered_order(schedule, pp, per_rank, microbatches)
    else:
        orders = tuple(tuple((_KIND[kind], stage) for a in row for kind, stage, _ in a.runs)
                       for row in line.actions)
    gathered = tuple({(s, resharded): gathers(orders[r], s, resharded)
                      for s in layout[r] for resharded in (False, True)} for r in range(pp))
    return _Facts(line, peak_in_flight(line), held, orders, gathered)


@functools.lru_cache(maxsize=32)
def lowered_order(schedule: str, pp: int, per_rank: int, microbatches: int
                  ) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per rank, torch's lowered order of a multi-stage schedule as ``(action, stage)``:
    FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, UNSHARD, RESHARD, SEND_F,
    SEND_B, ... (an overlapped forward and backward as its two halves)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from .timeline import _Stand

    info = SCHEDULES[schedule]
    num_stages = pp * per_rank
    layout = placement(pp, num_stages, info.style)
    stand_ins: Any = [_Stand(s, num_stages, pp) for s in layout[0]]
    built = get_schedule_class(schedule)(stand_ins, microbatches)
    return tuple(tuple((kind, stage) for action in actions for kind, stage, _ in action)
                 for actions in torch_private.schedule_actions(built, lowered=True))


def paired_shares(line: Timeline, microbatches: int) -> dict[int, float]:
    """Per stage, the share of its forward and backward passes that the schedule's
    timeline (torch's order) runs as one half of an overlapped forward and backward
    (DualPipeV's steady state; none in the other schedules)."""
    halves: dict[int, int] = {}
    for row in line.actions:
        for action in row:
            if len(action.runs) == 2:
                for _, stage, _ in action.runs:
                    halves[stage] = halves.get(stage, 0) + 1
    return {stage: count / (2 * microbatches) for stage, count in halves.items()}


_KIND = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}


def gathers(order: Sequence[tuple[str, int]], stage: int, resharded: bool) -> int:
    """All-gathers of one FSDP2 module of ``stage`` in one step of ``order``.

    FSDP2 gathers before a forward or a backward that finds the parameters sharded; it
    reshards after a forward when ``resharded``; torch's pipeline stage turns resharding
    after backward off until the step's end. The multi-stage runtime's UNSHARD gathers
    every module of the stage, RESHARD frees them."""
    gathered = False
    count = 0
    for kind, at in order:
        if at != stage:
            continue
        if kind == "UNSHARD":
            count += 1
            gathered = True
        elif kind == "RESHARD":
            gathered = False
        elif kind in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT"):
            if not gathered:
                count += 1
                gathered = True
            if kind == "FORWARD" and resharded:
                gathered = False
    return count


def held_moments(line: Timeline, rank: int, stages: tuple[int, ...]
                 ) -> tuple[tuple[int, ...], ...]:
    """The moments of ``rank``'s step at which it holds the most activations: per moment,
    the microbatches held of each of its ``stages`` (counted as
    :func:`.timeline.peak_in_flight` counts them: from the end of a forward to the end of
    its backward, or of its weight backward when split)."""
    index = {s: i for i, s in enumerate(stages)}
    events: list[tuple[int, int, int]] = []
    for action in line.actions[rank]:
        for kind, stage, _ in action.runs:
            if kind == "F":
                events.append((action.end, 1, index[stage]))
            elif kind in ("B", "W"):
                events.append((action.end, -1, index[stage]))
    held = [0] * len(stages)
    moments: set[tuple[int, ...]] = set()
    for _, change, at in sorted(events, key=lambda e: (e[0], e[1])):
        held[at] += change
        if change > 0:
            moments.add(tuple(held))
    # A moment no heavier than another in every stage never decides the peak.
    kept = [m for m in moments
            if not any(o != m and all(a >= b for a, b in zip(o, m, strict=True))
                       for o in moments)]
    return tuple(sorted(kept)) or ((0,) * len(stages),)


def _activation_bytes(layout: Any, model: Any, workload: Any) -> int:
    """Bytes of one stage output: what a stage sends per microbatch each way (this rank's
    tokens: a context-parallel rank's share of the sequence)."""
    tp = layout.tensor_parallel_size()
    tokens = workload.seq // layout.sequence_split * workload.micro_batch
    x = tokens * model.hidden * dtype_bytes(workload.dtype)
    # A sequence-parallel output is a DTensor sharded over tp: torch sends the local shard.
    return x // tp if layout.sequence_parallel and tp > 1 else x


def _microbatches(pp: PP, size: int, workload: Any) -> int:
    # The training step's accumulation runs grad_accum times the schedule's microbatches
    # in one schedule pass.
    return pp.microbatch_count(size) * workload.grad_accum


def problem(pp: PP, layout: Any, model: Any, workload: Any) -> str | None:
    """Why the pipeline states no terms for ``layout`` (what validation or the training
    step refuses), or None."""
    info = pp.info
    assert info is not None
    size = layout.mesh.size(pp.dim)
    per_rank = pp.virtual_stages()
    microbatches = _microbatches(pp, size, workload)
    found = microbatch_problem(info, microbatches, size, per_rank)
    if found or (info.stages_per_rank is not None and per_rank != info.stages_per_rank):
        who = (f"the training step refuses accumulate={workload.grad_accum} with it"
               if found and workload.grad_accum > 1 else "validation reports it")
        return (f"no pipeline terms: {found or 'stages_per_rank does not fit the schedule'} "
                f"({who})")
    return _too_many_stages(model, size * per_rank)


def cuts(pp: PP, layout: Any) -> bool:
    """Whether ``pp`` cuts the model over ``layout``'s mesh."""
    mesh = layout.mesh
    return pp.info is not None and pp.dim in mesh.names and mesh.size(pp.dim) > 1


def estimate_pipeline(pp: PP, layout: Any, model: Any, workload: Any
                      ) -> EstimatePipeline | None:
    """The pipeline's stages, ranks, sends and bubble for ``layout``, or None without a
    pipeline dim or when :func:`problem` says why not."""
    if not cuts(pp, layout) or problem(pp, layout, model, workload):
        return None
    info = pp.info
    assert info is not None
    mesh = layout.mesh
    size = mesh.size(pp.dim)
    per_rank = pp.virtual_stages()
    microbatches = _microbatches(pp, size, workload)
    num_stages = size * per_rank
    units, notes = _stage_units(model, pp.split, num_stages)
    shapes = [_stage_shape(model, u, s, s == num_stages - 1) for s, u in enumerate(units)]
    facts = _facts(info.name, size, per_rank, microbatches, pp.dim)
    line = facts.line
    layout_of = pp.stage_placement(size)
    rank_of = {s: r for r, stages in enumerate(layout_of) for s in stages}
    # The split-backward schedules keep every FSDP module gathered from forward to
    # backward (PP's finalize sets it); otherwise blocks reshard after forward unless
    # the data-parallel plugin says false, the stage root only when it says true.
    reshard = layout.reshard_after_forward
    blocks_reshard = not info.split_backward and reshard is not False
    root_reshard = not info.split_backward and reshard is not None and reshard is not False
    x = _activation_bytes(layout, model, workload)
    runs = microbatches
    crossing = _crossing(layout.topology, layout.topology.node_patterns(mesh, (pp.dim,))
                         if layout.topology is not None else [])
    paired = paired_shares(line, microbatches) if pp.overlap else {}
    ranks = []
    for r, local in enumerate(layout_of):
        stages = tuple(EstimateStage(
            f"stage {s}", shapes[s], runs=microbatches,
            block_gathers=facts.gathered[r][(s, blocks_reshard)],
            root_gathers=facts.gathered[r][(s, root_reshard)], accumulates=True,
            paired=paired.get(s, 0.0))
            for s in local)
        sends = _sends(pp.dim, r, local, rank_of, num_stages, crossing, x, runs)
        receive = sum(1 for s in local if s > 0 and rank_of[s - 1] != r)
        receive += sum(1 for s in local if s < num_stages - 1 and rank_of[s + 1] != r)
        buffers = ({f"receive buffers ({microbatches} per direction and stage)":
                    receive * microbatches * x} if receive else {})
        ranks.append(EstimateRank(r, stages, facts.held[r], facts.peaks[r], sends, buffers))
    return EstimatePipeline(pp.dim, line.title, tuple(ranks), line.bubble, microbatches,
                            tuple(notes))


def _crossing(topology: Any, groups: list[tuple[int, ...]]) -> set[tuple[int, int]]:
    """The (coordinate, coordinate) pairs along pp whose ranks, in some pp group, are on
    different nodes (``groups``: one per way a pp group sits on the nodes)."""
    if topology is None:
        return set()
    out = set()
    for g in groups:
        nodes = [topology.node_of(rank) for rank in g]
        out |= {(a, b) for a in range(len(g)) for b in range(len(g)) if nodes[a] != nodes[b]}
    return out


def _sends(dim: str, rank: int, local: tuple[int, ...], rank_of: dict[int, int],
           num_stages: int, crossing: set[tuple[int, int]], x: int, runs: int
           ) -> tuple[Collective, ...]:
    """This coordinate's point-to-point sends per step, each over the network when, in
    any pp group, the peer is on another node."""
    out = []
    for stage in local:
        for peer_stage, what in ((stage + 1, "activations"), (stage - 1, "input gradients")):
            if not 0 <= peer_stage < num_stages or rank_of[peer_stage] == rank:
                continue
            peer = rank_of[peer_stage]
            crosses = (rank, peer) in crossing
            out.append(Collective(
                dim, "send", x * runs, runs,
                f"{what} of stage {stage} to stage {peer_stage} ({dim} {rank} -> {peer}), "
                "one per microbatch", group_size=2, nodes=2 if crosses else 1,
                overlap="compute"))
    return tuple(out)


__all__ = ["cuts", "estimate_pipeline", "gathers", "held_moments", "lowered_order",
           "problem"]
