"""Estimate every candidate layout, keep those that fit, rank them by predicted step time."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate import (
    Estimate,
    EstimateError,
    ModelShape,
    Workload,
    dtype_name,
    estimate_plan,
    format_bytes,
)
from composer_par.tools.suggest.space import Candidate, families, plugin_axes
from composer_par.topology import Topology

if TYPE_CHECKING:
    from composer_par.findings import Report
    from composer_par.plugin.registry import Registry


@attrs.frozen
class Ranked:
    candidate: Candidate
    estimate: Estimate
    reason: str = ""  # why it lost to the best (empty for the best)

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits)

    @property
    def seconds(self) -> float:
        """The predicted step time the ranking compares."""
        return self.estimate.step.seconds

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate
        return {
            **self.candidate.to_dict(), "fits": self.fits,
            "memory_bytes": est.memory.total, "communication_seconds": est.seconds,
            "inter_node_bytes": round(est.inter_bytes), "payload_bytes": est.payload,
            "bubble": est.pipeline.bubble if est.pipeline else 0.0,
            "step_seconds": self.seconds, "compute_seconds": est.step.compute_seconds,
            "exposed_communication_seconds": est.step.exposed_seconds,
            "idle_seconds": est.step.idle_seconds,
            "tokens_per_second_per_device": est.step.tokens_per_second_per_device,
            "mfu": est.step.mfu, "reason": self.reason,
        }


@attrs.frozen
class Suggestion:
    topology: Topology
    device_memory: int
    model: ModelShape
    workload: Workload
    global_batch: int
    ranked: tuple[Ranked, ...]  # best first; fitting before not fitting
    plan_toml: str | None
    why: tuple[str, ...]  # why the best has what it has
    notes: tuple[str, ...] = ()
    report: Report | None = None  # static validation of the suggested plan file
    # the layouts gone through: estimated (``ranked``), or passed over unestimated (a
    # leaner choice of a layout than one that fits)
    layouts: int = 0

    @property
    def best(self) -> Ranked | None:
        return self.ranked[0] if self.ranked and self.ranked[0].fits else None

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "ok": best is not None,
            "topology": self.topology.to_dict(),
            "device_memory": self.device_memory,
            "model": self.model.to_dict(),
            "workload": self.workload.to_dict(),
            "global_batch": self.global_batch,
            "layouts": self.layouts,
            "best": best.to_dict() if best else None,
            "plan_toml": self.plan_toml,
            "why": list(self.why),
            "estimate": best.estimate.to_dict() if best else None,
            "candidates": [r.to_dict() for r in self.ranked],
            "notes": list(self.notes),
            "report": self.report.to_dict() if self.report is not None else None,
        }


def seconds(r: Ranked) -> float:
    """The step time to 3 significant digits: closer than that is a tie, broken by the
    layouts' preference (less recomputation), then by memory, then by the communication
    (hidden or not: it still takes links and power)."""
    return float(f"{r.seconds:.3g}")


def rank_key(r: Ranked) -> tuple[float, int, int, float]:
    return (seconds(r), r.candidate.preference, r.estimate.memory.total, r.estimate.seconds)


def _plan(candidate: Candidate, topology: Topology, registry: Registry,
          made: dict[str, Any]) -> Any:
    """The candidate's plan. Layouts with the same plugin options (``made``: the first
    plan of each) share its plugin objects and hook caller: only their meshes differ."""
    from composer_par.plan import ParallelPlan

    plan = ParallelPlan(candidate.mesh(), topology=topology)
    key = repr(candidate.plugins())
    first = made.get(key)
    if first is None:
        for name, options in candidate.plugins():
            plan.use(registry.get(name)(**options))
        made[key] = plan
    else:
        for plugin in first.plugins:
            plan.use(plugin)
        plan.share_hooks(first)
    return plan


def estimate_family(family: Sequence[Candidate], estimate_one: Callable[[Candidate], Ranked],
                    notes: list[str]) -> list[Ranked]:
    """A family's layouts estimated from the fastest choice of its first-fit axes to the
    first that fits (a leaner choice is never faster)."""
    out: list[Ranked] = []
    for candidate in family:
        try:
            ranked = estimate_one(candidate)
        except EstimateError as exc:
            notes.append(f"{candidate.label()}: not estimated ({exc})")
            break
        out.append(ranked)
        if ranked.fits:
            break
    return out


def suggest(
    model: ModelShape,
    topology: Topology,
    device_memory: int,
    *,
    seq: int,
    micro_batch: int = 1,
    global_batch: int | None = None,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    max_sizes: Mapping[str, int] | None = None,
    attention: str = "sdpa",
    registry: Registry | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    device: str | None = None,
    device_tflops: float | None = None,
    matmul_dtype: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Suggestion:
    """Rank every layout the installed plugins offer for ``model`` on ``topology`` by
    predicted step time (see the package docstring).

    ``global_batch``: sequences per step (default ``micro_batch`` x the world size);
    ``max_sizes``: the largest size to try per mesh dim; ``options``: per plugin, the
    options it is made with (its suggest axes follow them); ``device`` /
    ``device_tflops`` / ``matmul_dtype``: the step-time model's device, achieved
    throughput and matmul precision; ``progress(done, total)``: called as the layouts
    are gone through (``total`` of them in all)."""
    from composer_par.plugin.registry import Registry
    from composer_par.tools.suggest.explain import reason_lost, why_best
    from composer_par.tools.suggest.report import plan_file, validate

    dtype = dtype_name(dtype)
    reg = registry or Registry()
    notes: list[str] = []
    batch = global_batch if global_batch is not None else micro_batch * topology.world_size
    topology = attrs.evolve(
        topology,
        intra_node_gbps=intra_node_gbps if intra_node_gbps is not None
        else topology.intra_node_gbps,
        inter_node_gbps=inter_node_gbps if inter_node_gbps is not None
        else topology.inter_node_gbps)
    mixed = dtype in ("bfloat16", "float16")
    base = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype,
                    reduce_dtype="float32" if mixed else None, optimizer=optimizer,
                    attention=attention, matmul_dtype=matmul_dtype)
    axes = plugin_axes(reg, options or {}, model, topology, base, notes)

    made: dict[str, Any] = {}

    def estimate_one(candidate: Candidate) -> Ranked:
        accumulate = 1 if candidate.runs_passes else candidate.passes
        work = attrs.evolve(base, grad_accum=accumulate,
                            sync="every" if accumulate > 1 else "last")
        return Ranked(candidate, estimate_plan(
            _plan(candidate, topology, reg, made), model, work, world_size=topology.world_size,
            device_memory=device_memory, device=device or "h100",
            device_tflops=device_tflops))

    space = list(families(axes, topology, model, base, batch, max_sizes or {}))
    total = sum(len(family) for family in space)
    results: list[Ranked] = []
    done = 0
    for family in space:
        results += estimate_family(family, estimate_one, notes)
        done += len(family)
        if progress is not None:
            progress(done, total)
    if not results:
        raise EstimateError(f"no layout to consider on {topology.describe()}")
    fitting = sorted((r for r in results if r.fits), key=rank_key)
    others = sorted((r for r in results if not r.fits), key=lambda r: r.estimate.memory.total)
    report = None
    plan_toml = None
    why: list[str] = []
    # the best is the fastest layout whose plan file validates without errors
    for index, r in enumerate(fitting):
        text = plan_file(r.candidate, topology, r.estimate, seq=seq, micro_batch=micro_batch)
        found = validate(text, notes)
        if found is None or found.ok:
            fitting.insert(0, fitting.pop(index))
            plan_toml, report = text, found
            break
        notes.append(f"{r.candidate.label()}: its plan file does not validate ("
                     + "; ".join(f"{f.code}" for f in found.errors) + "): passed over")
    else:
        fitting = []
    ordered = fitting + sorted((r for r in results if r.fits and r not in fitting),
                               key=rank_key) + others
    best = ordered[0] if plan_toml is not None else None
    ranked = tuple(attrs.evolve(r, reason=reason_lost(r, best, device_memory))
                   if r is not best else r for r in ordered)
    if best is not None:
        why = why_best(best, results, device_memory)
    else:
        smallest = others[0] if others else ordered[0]
        notes.append(f"no layout fits in {format_bytes(device_memory)}: the smallest "
                     f"({smallest.candidate.label()}) needs "
                     f"{format_bytes(smallest.estimate.memory.total)}; add devices, shorten "
                     "the sequence or the micro-batch")
    return Suggestion(topology, device_memory, model, base, batch, ranked, plan_toml,
                      tuple(why), tuple(dict.fromkeys(notes)), report, total)


__all__ = ["Ranked", "Suggestion", "rank_key", "seconds", "suggest"]
