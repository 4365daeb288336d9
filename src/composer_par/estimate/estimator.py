"""The estimator: a layout, a model shape and a workload in, an :class:`Estimate` out.

It asks the plan's plugins in the order the plan applies them: the plugin that cuts the
model into pipeline stages (``composer_par_estimate_pipeline``), the model-parallel
plugins for the model as one rank holds it (``composer_par_estimate_shape``), then every
plugin for its terms (``composer_par_estimate``), and, for a collective a comm hook
customizes, the hooking plugin for what runs instead; it adds the answers to the core's
accounting of parameters, gradients, optimizer states and activations, times the
collectives, and turns compute and communication into a step time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.accumulation import SyncCost, sync_costs
from composer_par.estimate.collectives import Collective
from composer_par.estimate.compute import step_flops
from composer_par.estimate.devices import Device
from composer_par.estimate.devices import device as device_kind
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.layout import Layout
from composer_par.estimate.memory import Memory, memory_per_rank
from composer_par.estimate.model_shape import ModelShape
from composer_par.estimate.parts import (
    EstimatePart,
    EstimatePipeline,
    EstimateSection,
    held_shape,
    hooked_collectives,
    plugin_parts,
)
from composer_par.estimate.pipeline import RankEstimate, pipeline_ranks
from composer_par.estimate.report import ACCOUNTING, format_estimate
from composer_par.estimate.step_time import StepTime, step_time
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
    step: StepTime
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
    # What the plugins show of their own terms, and how they count them.
    sections: tuple[tuple[str, EstimateSection], ...] = ()
    accounting: tuple[str, ...] = ()

    @property
    def fullest(self) -> RankEstimate | None:
        return max(self.ranks, key=lambda r: r.memory.total) if self.ranks else None

    @property
    def slowest(self) -> RankEstimate | None:
        return max(self.ranks, key=lambda r: r.seconds) if self.ranks else None

    @property
    def seconds(self) -> float:
        """Communication time per step (every collective one after the other)."""
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

    def section(self, key: str) -> Any:
        """The data of the plugins' section ``key`` (None when no plugin wrote one)."""
        return next((s.data for _, s in self.sections if s.key == key), None)

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
            "step_time": self.step.to_dict(),
            "accounting": [*ACCOUNTING, *self.accounting],
            "notes": list(self.notes),
            "pipeline": self._pipeline_dict(),
            "accumulation": self._accumulation_dict(),
            "sections": {s.key: s.to_dict() for _, s in self.sections},
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


def _pipeline(plan: ParallelPlan | None, layout: Layout, model: ModelShape,
              workload: Workload) -> tuple[str, EstimatePipeline] | None:
    """The plugin that cuts the model into pipeline stages and what it states; two
    plugins cutting it is an error."""
    if plan is None:
        return None
    cuts = []
    for who, answer in plan.hooks.estimate_pipelines(layout, model, workload):
        if not isinstance(answer, EstimatePipeline):
            raise EstimateError(f"plugin {who!r}: composer_par_estimate_pipeline must return "
                                f"an EstimatePipeline or None; got {type(answer).__name__}")
        cuts.append((who, answer))
    if len(cuts) > 1:
        raise EstimateError("more than one plugin cuts the model into pipeline stages: "
                            + ", ".join(f"{who} over {cut.dim}" for who, cut in cuts))
    return cuts[0] if cuts else None


def _silent_dims(layout: Layout, parts: list[tuple[str, EstimatePart]],
                 collectives: list[Collective], pipeline_dim: str | None) -> list[str]:
    """Notes on the mesh dims of size > 1 whose owner states no terms at all."""
    answered = {who for who, _ in parts}
    busy = {c.dim for c in collectives}
    return [f"{d.name}: {d.plugin} states no estimate of its own (no terms for this mesh dim)"
            for d in layout.dims
            if d.size > 1 and d.plugin and d.plugin not in answered and d.name not in busy
            and d.name != pipeline_dim]


def estimate(
    layout: Layout,
    model: ModelShape,
    workload: Workload,
    *,
    plan: ParallelPlan | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    device_memory: int | None = None,
    device: str | Device | None = None,
    device_tflops: float | None = None,
) -> Estimate:
    """Per-rank memory, per-step communication and step time of ``layout`` training
    ``model``.

    Bandwidths: the arguments, else the layout's topology, else the defaults
    (:data:`DEFAULT_INTRA_NODE_GBPS`, :data:`DEFAULT_INTER_NODE_GBPS`), reported as
    assumed. With ``plan``, its plugins state their own terms (the module docstring);
    without one, only the core's accounting of the layout's roles counts. ``device``:
    the device kind of :mod:`.devices` (default h100), ``device_tflops`` the throughput
    its matmuls achieve (default a share of its peak).
    """
    notes: list[str] = []
    if model.attention_kind is not None and model.attention_kind != workload.attention:
        # The kernel the model's config says it runs decides whether scores are kept.
        workload = attrs.evolve(workload, attention=model.attention_kind)
    # dtypes: the workload's, else the plan's mixed precision, else the model's, else fp32
    dtype = workload.dtype or layout.param_dtype or model.dtype
    if dtype is None:
        dtype = "float32"
        notes.append("dtype float32: neither --dtype nor the plan's mixed precision says "
                     "otherwise (pass --dtype bf16 for 16-bit mixed precision)")
    reduce_dtype = workload.reduce_dtype or (layout.reduce_dtype if workload.dtype is None
                                              else None) or dtype
    mode = workload.activation_checkpoint or layout.activation_checkpoint or "none"
    if workload.activation_checkpoint is not None:
        # A mode given with the workload runs on every block with the mode's own saves,
        # not the plan's.
        layout = attrs.evolve(layout, checkpoint_every=1, checkpoint_matmul_every=1,
                              checkpoint_saves_attention=False,
                              checkpoint_saves_collectives=True)
    # What every plugin is told: the workload with its dtypes and checkpointing resolved.
    work = attrs.evolve(workload, dtype=dtype, reduce_dtype=reduce_dtype,
                        activation_checkpoint=mode)
    cut = _pipeline(plan, layout, model, work)
    pipeline = cut[1] if cut else None
    if pipeline is not None:
        if workload.sync != "last":
            raise EstimateError(
                f"sync {workload.sync!r} with a pipeline: its schedule reduces gradients once "
                "per step, after the last microbatch's backward (sync 'last'), which the "
                "training step takes alone")
        layout = attrs.evolve(layout, pipeline_dim=pipeline.dim)
        notes += [f"{cut[0] if cut else ''}: {n}" for n in pipeline.notes]
    held = held_shape(plan, layout, model)
    parts = plugin_parts(plan, layout, held, work) if plan is not None else []
    for who, part in parts:
        if part.activation_checkpoint and workload.activation_checkpoint is None \
                and part.activation_checkpoint != mode:
            mode = part.activation_checkpoint
            notes.append(f"activation checkpointing {mode}: stated by {who}")
            work = attrs.evolve(work, activation_checkpoint=mode)
            parts = plugin_parts(plan, layout, held, work) if plan is not None else []
            break
    for who, part in parts:
        notes += [f"{who}: {n}" for n in part.notes]
    tp = layout.tensor_parallel_size()
    shard = layout.shard_size()
    intra_gbps, inter_gbps, assumed = bandwidths(layout.topology, intra_node_gbps,
                                                 inter_node_gbps)

    def terms_of(w: Workload) -> tuple[Memory, list[Collective]]:
        answers = parts if w == work else plugin_parts(plan, layout, held, w) if plan else []
        memory = memory_per_rank(layout, held, w, [(who, t) for who, part in answers
                                                   for t in part.memory_terms()],
                                 dtype=dtype, mode=mode, tp=tp, shard=shard)
        return memory, hooked_collectives(plan, layout, held, w, answers)

    ranks: tuple[RankEstimate, ...] = ()
    accumulation: tuple[SyncCost, ...] = ()
    if pipeline is not None and plan is not None:
        ranks = pipeline_ranks(plan, layout, model, pipeline, work, dtype=dtype, mode=mode,
                               tp=tp, shard=shard, intra_gbps=intra_gbps,
                               inter_gbps=inter_gbps)
        fullest = max(ranks, key=lambda r: r.memory.total)
        slowest = max(ranks, key=lambda r: r.seconds)
        memory, traffic = fullest.memory, slowest.traffic
        collectives = [c for t in traffic for c in t.collectives]
    else:
        memory, collectives = terms_of(work)
        traffic = dim_traffic(layout, collectives, intra_gbps, inter_gbps)
        if workload.grad_accum > 1:
            accumulation = sync_costs(layout, work, terms_of)
    notes += _silent_dims(layout, parts, collectives, pipeline.dim if pipeline else None)
    if layout.topology is None and any(d.size > 1 for d in layout.dims):
        notes.append("no topology: every mesh dim is counted as inside a node (give "
                     "--nodes/--devices-per-node)")
    kind = device_kind(device, device_tflops)
    if device is None:
        notes.append(f"device {kind.name}: the step time assumes {kind.title} (give --device)")
    passes = pipeline.microbatches if pipeline is not None else workload.grad_accum
    flops = step_flops(layout, model, workload.seq, workload.micro_batch, passes)
    step = step_time(kind, flops, [t for _, part in parts for t in part.compute], traffic,
                     dtype=dtype,
                     matmul_dtype=workload.matmul_dtype or layout.matmul_dtype or dtype,
                     bubble=pipeline.bubble if pipeline is not None else 0.0)
    sections = tuple((who, s) for who, part in parts for s in part.sections)
    accounting = tuple(line for _, part in parts for line in part.accounting)
    return Estimate(layout, model, workload, dtype, reduce_dtype, mode, memory, traffic,
                    intra_gbps, inter_gbps, assumed, step, tuple(dict.fromkeys(notes)),
                    device_memory, pipeline, ranks, accumulation, sections,
                    tuple(dict.fromkeys(accounting)))


def estimate_plan(
    plan: ParallelPlan,
    model: ModelShape,
    workload: Workload,
    *,
    world_size: int | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    device_memory: int | None = None,
    device: str | Device | None = None,
    device_tflops: float | None = None,
) -> Estimate:
    """:func:`estimate` for a plan: its layout, and its plugins' own terms."""
    layout = Layout.from_plan(plan, world_size)
    return estimate(layout, model, workload, plan=plan, intra_node_gbps=intra_node_gbps,
                    inter_node_gbps=inter_node_gbps, device_memory=device_memory,
                    device=device, device_tflops=device_tflops)
