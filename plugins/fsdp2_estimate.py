"""What FSDP2 costs a step, for ``composer-par estimate`` and ``suggest``: its
all-gathers and reduce-scatters (the logical payload bytes
:class:`~composer_par.testing.comm_count.CommCounter` counts), the buffers of the groups
it gathers, and the gradients it keeps unsharded while they accumulate. Pure arithmetic:
no torch.

* **collectives**: over its shard dim flattened with the dims data parallelism folds in
  (``dp_shard x cp x ep``), each group (every block, its units, then the root's own
  parameters) all-gathers in forward, again in backward when it was resharded after
  forward, and reduce-scatters its gradients once per backward that reduces (the
  training step's sync policy); groups set apart (expert parallelism's experts) over the
  group without the dims they differ along. ``reshard_after_forward`` (per unit with
  ``reshard_units``): None (torch's default) reshards every group but the root's and the
  last block's (kept for its backward, which follows at once); True
  or an int n >= the shard size every group it is given to; 1 < n < the shard size to
  runs of n ranks (a sub-group); False (and n = 1) none. All of them run behind compute
  (FSDP2 prefetches the next group's all-gather, and reduce-scatters while backward goes
  on). Inside a pipeline stage the schedule's order says how often each group gathers,
  and the stage reduces once per step.
* **memory**: the unsharded parameters of the group computing and of the one prefetched,
  and one group's unsharded gradients before its reduce-scatter; the root's parameters
  gathered from forward to backward under torch's default; with gradients accumulated
  over micro-batches and reduced once (sync ``"last"``, a pipeline stage) every unit's
  gradients whole, in the reduce dtype, and in a stage its parameters gathered until the
  step's reduction; with ``offload = "cpu"`` the sharded parameters, gradients and
  optimizer states on the host.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import (
    Collective,
    EstimatePart,
    MemoryTerm,
    ModelShape,
    dtype_bytes,
    optimizer_bytes,
    run_nodes,
    runs_of,
)

if TYPE_CHECKING:
    from composer_par.plugin import EstimateStage

ACCOUNTING = (
    "fsdp2: all-gather every parameter group (each block, its units, then the root) in "
    "forward, again in backward when resharded after forward (by default all but the "
    "root's and the last block's); reduce-scatter gradients "
    "once per backward that reduces; over the shard dim with the folded dims flattened in "
    "(groups set apart: without the dims they differ along); all of it behind compute; "
    "buffers: two groups gathered and one group's gradients",
)


def reshard_of(unit: str, default: bool | int | None,
               per_unit: dict[str, bool | int]) -> bool | int | None:
    """``reshard_after_forward`` of the unit ``unit`` (a block's path, a unit's, ``"a + b"``
    for modules sharded together, or ``root``): an entry of ``per_unit`` naming it or one
    of its paths, else the first pattern matching one, else ``default``."""
    names = {unit, *unit.split(" + ")}
    for key, value in per_unit.items():
        if key in names:
            return value
    for key, value in per_unit.items():
        if set(key) & set("*?[") and any(fnmatch.fnmatchcase(n, key) for n in names):
            return value
    return default


def split_apart(model: ModelShape) -> tuple[ModelShape, ModelShape]:
    """(the groups sharded over the whole data-parallel group, the groups set apart)."""
    together = tuple(g for g in model.groups if not g.apart)
    apart = tuple(g for g in model.groups if g.apart)
    return attrs.evolve(model, groups=together), attrs.evolve(model, groups=apart)


@attrs.frozen
class _Sharding:
    """What one estimate of FSDP2 needs of its options and the layout."""

    dim: Any  # DimInfo
    layout: Any
    reshard: Any  # the unit -> reshard_after_forward function
    keeps_last: bool  # the last block stays gathered for its backward unless named
    tp: int
    ag_bytes: int
    rs_bytes: int


def _collectives(s: _Sharding, model: ModelShape, group: int, nodes: int | None,
                 micro: int, scatters: int, stage: EstimateStage | None) -> list[Collective]:
    """The collectives of ``model``'s groups over a shard group of ``group`` ranks."""
    dim, tp, f = s.dim.name, s.tp, group
    groups = [g for g in model.groups if g.numel]
    calls = sum(g.count for g in groups)
    if not calls:
        return []
    out: list[Collective] = []
    if stage is not None:
        payload = count = 0
        for g in groups:
            times = stage.block_gathers if g.block else stage.root_gathers
            times = 2 if times is None else times
            payload += g.gathered_bytes(tp, f, s.ag_bytes) * g.count * times
            count += g.count * times
        if count:
            out.append(Collective(dim, "all_gather", payload, count,
                                  "parameters, as the pipeline schedule runs the stage (a "
                                  "forward after a backward finds them gathered)"))
    else:
        ag_fwd = sum(g.gathered_bytes(tp, f, s.ag_bytes) * g.count for g in groups)
        out.append(Collective(dim, "all_gather", ag_fwd * micro, calls * micro,
                              "parameters, forward (every group)"))
        again = []
        runs: dict[int, list[Any]] = {}
        last = next((g for g in reversed(groups) if g.block and not g.apart), None)
        for g in groups:
            reshard = s.reshard(g.name)
            if reshard is None and g is last and s.keeps_last:
                if g.count > 1:
                    again.append(attrs.evolve(g, count=g.count - 1))
            elif reshard is None:
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
            payload = sum(g.gathered_bytes(tp, f, s.ag_bytes) * g.count for g in members)
            out.append(Collective(dim, "all_gather", payload * micro,
                                  sum(g.count for g in members) * micro,
                                  f"parameters, backward (resharded to groups of {size})",
                                  group_size=size, nodes=run_nodes(s.layout, dim, size)))
        if again:
            payload = sum(g.gathered_bytes(tp, f, s.ag_bytes) * g.count for g in again)
            out.append(Collective(dim, "all_gather", payload * micro,
                                  sum(g.count for g in again) * micro,
                                  "parameters, backward (groups resharded after forward)"))
    rs = sum(g.padded_numel(tp, f) * g.count for g in groups) * s.rs_bytes
    out.append(Collective(dim, "reduce_scatter", rs * scatters, calls * scatters,
                          "gradients, backward (every group)" if scatters == micro
                          and stage is None else
                          "gradients, once per step (accumulated over the microbatches)"))
    if nodes is not None:
        # over a group wider than the dim (the folded dims flattened in); those already
        # on a sub-group keep it
        out = [c if c.group_size is not None else attrs.evolve(c, group_size=group, nodes=nodes)
               for c in out]
    return [attrs.evolve(c, overlap="compute") for c in out]


def _shards(layout: Any, model: ModelShape, shard: int) -> dict[str, int]:
    return {g.name: shard if not g.apart else layout.shard_size(g.apart) for g in model.groups}


def estimate_part(fsdp2: Any, layout: Any, model: ModelShape, workload: Any,
                  stage: EstimateStage | None) -> EstimatePart | None:
    """FSDP2's terms for ``layout`` (its plugin object ``fsdp2``: dim and options)."""
    if fsdp2.dim not in layout.mesh:
        return None
    dim = layout.dim(fsdp2.dim)
    notes: list[str] = []
    model, unfound = model.with_units(fsdp2.units)
    if unfound and stage is None:
        notes.append(f"units {', '.join(unfound)}: no parameter of the model's root group "
                     "lies under them (give --model to measure the model); counted in the "
                     "root's unit")
    per_unit = dict(fsdp2.reshard_units)

    def reshard(unit: str) -> bool | int | None:
        return reshard_of(unit, fsdp2.reshard_after_forward, per_unit)

    tp = layout.tensor_parallel_size()
    shard = layout.shard_size()
    s = _Sharding(dim, layout, reshard, fsdp2.keeps_last_block, tp,
                  dtype_bytes(workload.dtype), dtype_bytes(workload.reduce_dtype))
    micro = runs_of(workload, stage)
    scatters = (1 if stage.accumulates else stage.runs) if stage is not None \
        else workload.reductions()[0]
    together, apart = split_apart(model)
    collectives: list[Collective] = []
    if apart.groups:
        without = apart.groups[0].apart
        group, nodes = layout.data_parallel_group(dim, without)
        if group > 1:
            collectives += [attrs.evolve(c, why=f"experts: {c.why}")
                            for c in _collectives(s, apart, group, nodes, micro, scatters,
                                                  stage)]
    group, nodes = layout.data_parallel_group(dim)
    if group > 1:
        collectives += _collectives(s, together, group, nodes, micro, scatters, stage)
    terms = _memory(fsdp2, s, model, workload, stage, shard) if shard > 1 else []
    return EstimatePart(collectives=tuple(collectives), terms=tuple(terms),
                        accounting=ACCOUNTING, notes=tuple(notes))


def _memory(fsdp2: Any, s: _Sharding, model: ModelShape, workload: Any,
            stage: EstimateStage | None, shard: int) -> list[MemoryTerm]:
    """FSDP2's memory terms on a rank sharding over ``shard`` ranks."""
    tp, layout = s.tp, s.layout
    shards = _shards(layout, model, shard)
    mixed = s.ag_bytes == 2
    pbytes = 2 if mixed else s.ag_bytes
    groups = [g for g in model.groups if g.numel]
    blocks = [g for g in groups if g.block]
    largest = max((g.padded_numel(tp, shards[g.name]) for g in blocks), default=0)
    # gathered as the parameters' dtype, or as narrower as a plugin says (float8)
    gathered_block = max((g.gathered_bytes(tp, shards[g.name], s.ag_bytes) for g in blocks),
                         default=0)
    sharded_grads = sum(g.local_numel(tp, shards[g.name]) * g.count for g in groups) * pbytes
    unsharded_grads = sum(g.local_numel(tp, 1) * g.count for g in groups) * s.rs_bytes
    terms: list[MemoryTerm] = []
    if stage is not None and stage.accumulates:
        largest = max((g.padded_numel(tp, shard) for g in groups), default=0)
        gathered = sum(g.gathered_bytes(tp, shard, s.ag_bytes) * g.count for g in groups)
        terms += [
            MemoryTerm("grads", unsharded_grads - sharded_grads,
                       f"gradients unsharded over the shard dims in {s.rs_bytes} B: "
                       "accumulated over the microbatches until the step's one "
                       "reduce-scatter"),
            MemoryTerm("buffers", gathered, "the stage's parameters, gathered after "
                       "backward until the step ends"),
            MemoryTerm("buffers", largest * s.rs_bytes,
                       "one group's unsharded gradients before its reduce-scatter",
                       transient=True)]
    else:
        terms.append(MemoryTerm(
            "buffers", 2 * gathered_block + largest * s.rs_bytes,
            "unsharded groups in flight: the one computing, the one prefetched and one "
            "group's gradients", transient=True))
        root = [g for g in groups if not g.block and g.name == "root"]
        if root and s.reshard("root") is None:
            terms.append(MemoryTerm("buffers", root[0].gathered_bytes(tp, shard, s.ag_bytes),
                                    "the root's parameters, unsharded from forward to "
                                    "backward (torch's default)"))
        if stage is None and workload.grad_accum > 1 and workload.sync == "last":
            terms.append(MemoryTerm(
                "grads", unsharded_grads - sharded_grads,
                f"gradients, {s.rs_bytes} B per parameter, not divided by the shard dims: "
                f"kept unsharded between the {workload.grad_accum} micro-batches until the "
                "step's one reduce-scatter (sync 'last')"))
    if fsdp2.offload == "cpu":
        local = sum(g.local_numel(tp, shards[g.name]) * g.count for g in groups)
        terms += [
            MemoryTerm("params", -local * pbytes, "sharded parameters on the host "
                       "(offload = \"cpu\")"),
            MemoryTerm("grads", -sharded_grads, "sharded gradients on the host"),
            MemoryTerm("optimizer", -local * optimizer_bytes(workload.optimizer, mixed),
                       "optimizer states on the host, stepped there")]
    return terms


__all__ = ["ACCOUNTING", "estimate_part", "reshard_of", "split_apart"]
