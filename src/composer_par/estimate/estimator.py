"""The estimator: a layout, a model shape and a workload in, an :class:`Estimate` out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.accumulation import SyncCost, sync_costs
from composer_par.estimate.collectives import communication
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.experts import ExpertsSummary, experts_apart, experts_summary
from composer_par.estimate.layout import Layout
from composer_par.estimate.memory import Memory, memory_per_rank
from composer_par.estimate.model_shape import ModelShape
from composer_par.estimate.parts import EstimatePart, EstimatePipeline, plugin_parts
from composer_par.estimate.pipeline import RankEstimate, pipeline_ranks
from composer_par.estimate.report import ACCOUNTING, format_estimate
from composer_par.estimate.timing import DimTraffic, bandwidths, dim_traffic
from composer_par.estimate.workload import Workload

if TYPE_CHECKING:
    from composer_par.plan import ParallelPlan


@attrs.frozen
class Estimate:
    layout: Layout
    model: ModelShape
    workload: Workload
    dtype: str
    reduce_dtype: str
    activation_checkpoint: str
    memory: Memory
    traffic: tuple[DimTraffic, ...]
    intra_node_gbps: float
    inter_node_gbps: float
    bandwidth_assumed: tuple[str, ...]
    notes: tuple[str, ...] = ()
    device_memory: int | None = None
    # A model cut into pipeline stages: what the cutting plugin stated, and each
    # coordinate's estimate (``memory`` is then the fullest one's, ``traffic`` the
    # slowest one's).
    pipeline: EstimatePipeline | None = None
    ranks: tuple[RankEstimate, ...] = ()
    # Without a pipeline and with grad_accum > 1: every sync policy's gradient memory
    # and reductions per step, for comparison (the estimate above is workload.sync's).
    accumulation: tuple[SyncCost, ...] = ()
    # With expert parallelism: what a rank holds of the experts and the all-to-alls.
    experts: ExpertsSummary | None = None

    @property
    def fullest(self) -> RankEstimate | None:
        return max(self.ranks, key=lambda r: r.memory.total) if self.ranks else None

    @property
    def slowest(self) -> RankEstimate | None:
        return max(self.ranks, key=lambda r: r.seconds) if self.ranks else None

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.traffic)

    @property
    def payload(self) -> int:
        return sum(t.payload for t in self.traffic)

    @property
    def inter_bytes(self) -> float:
        return sum(t.inter_bytes for t in self.traffic)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory.total <= self.device_memory

    def to_dict(self) -> dict[str, Any]:
        topology = self.layout.topology
        return {
            "mesh": self.layout.mesh.to_dict(),
            "topology": topology.to_dict() if topology else None,
            "model": self.model.to_dict(),
            "workload": {**self.workload.to_dict(), "dtype": self.dtype,
                         "reduce_dtype": self.reduce_dtype,
                         "activation_checkpoint": self.activation_checkpoint},
            "memory": self.memory.to_dict(),
            "device_memory": self.device_memory,
            "fits": self.fits,
            "communication": [t.to_dict() for t in self.traffic],
            "communication_seconds": self.seconds,
            "bandwidth_gbps": {"intra_node": self.intra_node_gbps,
                               "inter_node": self.inter_node_gbps,
                               "assumed": list(self.bandwidth_assumed)},
            "accounting": list(ACCOUNTING),
            "notes": list(self.notes),
            "pipeline": self._pipeline_dict(),
            "accumulation": self._accumulation_dict(),
            "experts": self.experts.to_dict() if self.experts is not None else None,
        }

    def _accumulation_dict(self) -> dict[str, Any] | None:
        if not self.accumulation:
            return None
        return {"accumulate": self.workload.grad_accum, "sync": self.workload.sync,
                "policies": [c.to_dict() for c in self.accumulation]}

    def _pipeline_dict(self) -> dict[str, Any] | None:
        line = self.pipeline
        if line is None:
            return None
        fullest, slowest = self.fullest, self.slowest
        groups = max(1, self.layout.mesh.world_size // max(1, self.layout.mesh.size(line.dim)))
        intra = sum(r.send_intra_bytes for r in self.ranks)
        inter = sum(r.send_inter_bytes for r in self.ranks)
        return {
            "dim": line.dim, "title": line.title, "bubble": line.bubble,
            "microbatches": line.microbatches,
            "fullest_rank": fullest.coordinate if fullest else None,
            "slowest_rank": slowest.coordinate if slowest else None,
            "point_to_point_per_step": {
                "per_pipeline": {"intra_node_bytes": round(intra),
                                 "inter_node_bytes": round(inter)},
                "pipelines": groups,
                "all_pipelines": {"intra_node_bytes": round(intra * groups),
                                  "inter_node_bytes": round(inter * groups)}},
            "ranks": [r.to_dict() for r in self.ranks],
        }

    def format(self, paint: Any = None) -> str:
        return format_estimate(self, paint)


def estimate(
    layout: Layout,
    model: ModelShape,
    workload: Workload,
    *,
    plan: ParallelPlan | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    device_memory: int | None = None,
) -> Estimate:
    """Per-rank memory and per-step communication of ``layout`` training ``model``.

    Bandwidths: the arguments, else the layout's topology, else the defaults
    (:data:`DEFAULT_INTRA_NODE_GBPS`, :data:`DEFAULT_INTER_NODE_GBPS`), reported as
    assumed. With ``plan``, its plugins' ``composer_par_estimate`` hooks are asked.
    """
    notes: list[str] = []
    parts: list[tuple[str, EstimatePart]] = []
    if model.attention_kind is not None and model.attention_kind != workload.attention:
        # The kernel the model's config says it runs decides whether scores are kept.
        workload = attrs.evolve(workload, attention=model.attention_kind)
    if plan is not None:
        parts = plugin_parts(plan, layout, model, workload)
    cuts = [(who, part.pipeline) for who, part in parts if part.pipeline is not None]
    if len(cuts) > 1:
        raise EstimateError("more than one plugin cuts the model into pipeline stages: "
                            + ", ".join(f"{who} over {cut.dim}" for who, cut in cuts))
    pipeline = cuts[0][1] if cuts else None
    if pipeline is not None and workload.sync != "last":
        raise EstimateError(
            f"sync {workload.sync!r} with a pipeline: its schedule reduces gradients once per "
            "step, after the last microbatch's backward (sync 'last'), which the training "
            "step takes alone")
    for who, part in parts:
        notes += [f"{who}: {n}" for n in part.notes]
    # dtypes: the workload's, else the plan's mixed precision, else the model's, else fp32
    dtype = workload.dtype or layout.param_dtype or model.dtype
    if dtype is None:
        dtype = "float32"
        notes.append("dtype float32: neither --dtype nor the plan's mixed precision says "
                     "otherwise (pass --dtype bf16 for 16-bit mixed precision)")
    reduce_dtype = workload.reduce_dtype or (layout.reduce_dtype if workload.dtype is None
                                              else None) or dtype
    mode = workload.activation_checkpoint or layout.activation_checkpoint or "none"
    for who, part in parts:
        if part.activation_checkpoint and workload.activation_checkpoint is None:
            mode = part.activation_checkpoint
            notes.append(f"activation checkpointing {mode}: stated by {who}")
    every = layout.checkpoint_every if workload.activation_checkpoint is None else 1
    layout = attrs.evolve(layout, checkpoint_every=every)
    tp = layout.tensor_parallel_size()
    shard = layout.shard_size()
    # Modules that are data-parallel units of their own leave the root's group.
    grouped, unfound = model.with_units(layout.units)
    # Expert parallelism's experts: num_experts / ep per rank, sharded apart from ep.
    grouped = experts_apart(grouped, layout)
    if unfound:
        notes.append(f"units {', '.join(unfound)}: no parameter of the model's root group "
                     "lies under them (give --model to measure the model); counted in the "
                     "root's unit")
    memory = memory_per_rank(layout, grouped, workload, parts, dtype=dtype,
                             reduce_dtype=reduce_dtype, mode=mode, tp=tp, shard=shard)
    collectives, uncovered = communication(layout, grouped, workload, parts, dtype=dtype,
                                           reduce_dtype=reduce_dtype, mode=mode, tp=tp,
                                           shard=shard)
    notes += uncovered
    accumulation: tuple[SyncCost, ...] = ()
    if pipeline is None and workload.grad_accum > 1:
        accumulation = sync_costs(layout, grouped, workload, parts, dtype=dtype,
                                  reduce_dtype=reduce_dtype, mode=mode, tp=tp, shard=shard)
    intra_gbps, inter_gbps, assumed = bandwidths(layout.topology, intra_node_gbps,
                                                 inter_node_gbps)
    traffic = dim_traffic(layout, collectives, intra_gbps, inter_gbps)
    ranks: tuple[RankEstimate, ...] = ()
    if pipeline is not None:
        ranks = pipeline_ranks(layout, model, pipeline, workload, parts, dtype=dtype,
                               reduce_dtype=reduce_dtype, mode=mode, tp=tp, shard=shard,
                               intra_gbps=intra_gbps, inter_gbps=inter_gbps)
        fullest = max(ranks, key=lambda r: r.memory.total)
        slowest = max(ranks, key=lambda r: r.seconds)
        memory, traffic = fullest.memory, slowest.traffic
    if layout.topology is None and any(d.size > 1 for d in layout.dims):
        notes.append("no topology: every mesh dim is counted as inside a node (give "
                     "--nodes/--devices-per-node)")
    experts = (experts_summary(layout, model, grouped, memory.local_params, traffic,
                               workload.grad_accum) if pipeline is None else None)
    if pipeline is not None and layout.experts_dim is not None and model.moe is not None:
        notes.append(f"{layout.experts_dim} inside a pipeline: each stage holds "
                     "num_experts / ep of its blocks' experts, but the all-to-alls are "
                     "counted as the whole model's for one pass of the step, not per "
                     "stage and microbatch")
    return Estimate(layout, model, workload, dtype, reduce_dtype, mode, memory,
                    traffic, intra_gbps, inter_gbps, assumed, tuple(notes),
                    device_memory, pipeline, ranks, accumulation, experts)


def estimate_plan(
    plan: ParallelPlan,
    model: ModelShape,
    workload: Workload,
    *,
    world_size: int | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    device_memory: int | None = None,
) -> Estimate:
    """:func:`estimate` for a plan: its layout, and its plugins' own terms."""
    layout = Layout.from_plan(plan, world_size)
    return estimate(layout, model, workload, plan=plan, intra_node_gbps=intra_node_gbps,
                    inter_node_gbps=inter_node_gbps, device_memory=device_memory)
