"""Suggest a plan: enumerate layouts, keep those that fit, rank them by communication time.

Candidates, on ``nodes x devices_per_node`` ranks (mesh dims outermost first:
``dp_replicate``, ``dp_shard``, ``tp``):

* FSDP over every data-parallel rank (``dp_shard`` = world / tp);
* HSDP at each split ``dp_replicate x dp_shard`` (replicate-only when ``dp_shard`` is 1);
* each of them with TP sizes that divide the devices of a node (and the head counts);
* each with activation checkpointing none, selective or full;
* context-parallel layouts (``cp`` between ``dp_shard`` and ``tp``, the ``cp`` plugin):
  cp sizes that divide the devices of a node left by TP (across nodes only when none of
  those fits) and whose ``2 x cp`` divides the sequence, in ``allgather`` mode, and in
  ``alltoall`` mode too where cp divides the head counts each tp rank holds; considered
  only when no layout without CP fits or the activations are the largest part of every
  one that does;
* expert-parallel layouts of a mixture-of-experts model (``ep`` innermost, the ``ep``
  plugin): ep sizes that divide the devices of a node and the expert count, with every
  data-parallel split of the remaining ranks (FSDP2 over ``dp_shard x ep``, HSDP, EP
  alone) and checkpointing mode; the best says why it has ep, against the best layout
  without, and prices the imbalance of tokens per expert as its risk;
* pipeline layouts (``pp`` outermost, the ``pp`` plugin's 1F1B schedule, ``pp x tp``
  microbatches per step) over each of the above on the remaining ranks, with pp sizes
  that divide the node count or that it divides — considered only when no layout
  without a pipeline both fits and keeps its sharded and tensor-parallel collectives
  inside nodes (nothing fits, or every fitting layout runs them over the network,
  which a pipeline replaces with point-to-point sends).

Every candidate is estimated with :mod:`composer_par.estimate` for the same global
batch (``micro_batch x world_size`` sequences per step: a TP layout accumulates ``tp``
micro-batches per data-parallel rank, a pipeline runs ``pp x tp`` microbatches). Those
whose per-rank memory fits the device are ranked by time per step — communication, plus
for a pipeline the compute its bubble leaves idle (``6 x params x tokens`` per rank at an
assumed device throughput, :data:`DEFAULT_DEVICE_TFLOPS`) — then by the least
recomputation (no AC before selective before full), then by memory. The best is printed
as a plan file; the runners-up each with the reason it lost. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate import (
    AC_MODES,
    Estimate,
    EstimateError,
    Layout,
    ModelShape,
    Workload,
    estimate,
    format_bytes,
    format_count,
    format_seconds,
)
from composer_par.mesh import MeshSpec
from composer_par.plugin import Role
from composer_par.topology import Topology

if TYPE_CHECKING:
    from composer_par.findings import Report
    from composer_par.plugin.registry import Registry

_AC_RANK = {m: i for i, m in enumerate(AC_MODES)}

# Achieved 16-bit throughput per device assumed to price a pipeline's bubble (TFLOP/s):
# about 40% of an H100's dense bf16 peak.
DEFAULT_DEVICE_TFLOPS = 400.0
PIPELINE_SCHEDULE = "1F1B"  # the schedule suggest prices: torch-free, least memory of its bubble


@attrs.frozen
class Candidate:
    replicate: int
    shard: int
    tp: int
    ac: str
    pp: int = 1
    cp: int = 1
    cp_mode: str = "allgather"
    ep: int = 1

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.shard

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per step: the data-parallel rank's share of the global
        batch, ``pp x tp`` micro-batches."""
        return self.pp * self.tp

    def label(self) -> str:
        parts: list[str] = [f"PP {self.pp}"] if self.pp > 1 else []
        if self.replicate > 1 and self.shard > 1:
            parts.append(f"HSDP {self.replicate}x{self.shard}")
        elif self.replicate > 1:
            parts.append(f"replicate {self.replicate}")
        elif self.shard > 1:
            parts.append(f"FSDP {self.shard}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}" + (" alltoall" if self.cp_mode == "alltoall" else ""))
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.ac != "none":
            parts.append(f"AC {self.ac}")
        return " + ".join(parts) or "one rank"

    def mesh(self) -> MeshSpec:
        # pp outermost: its point-to-point sends are what crosses nodes best
        dims: list[tuple[str, int]] = [("pp", self.pp)] if self.pp > 1 else []
        if self.replicate > 1:
            dims.append(("dp_replicate", self.replicate))
        if self.shard > 1 or (self.tp > 1 and self.replicate > 1):
            # FSDP2 shards (a size-1 dp_shard lets it replicate TP-split parameters: HSDP
            # alone does not combine with TP)
            dims.append(("dp_shard", self.shard))
        if self.cp > 1:
            # inside dp_shard, outside tp: torchtitan's order, cp's groups within a node
            # when cp x tp fits one
            dims.append(("cp", self.cp))
        if self.ep > 1:
            # innermost with FSDP2's dp_shard: its all-to-alls inside a node (CP803)
            dims.append(("ep", self.ep))
        if self.tp > 1:
            dims.append(("tp", self.tp))
        return MeshSpec.from_pairs(dims or [("dp_shard", 1)])

    def plugins(self, dtype: str, sequence_parallel: bool, seq: int | None = None
                ) -> list[tuple[str, dict[str, Any]]]:
        """(registry name, options) in use() order; ``seq``: the sequence length CP
        checks before launch."""
        mesh = self.mesh()
        out: list[tuple[str, dict[str, Any]]] = []
        if self.pp > 1:
            out.append(("pp", {"schedule": PIPELINE_SCHEDULE,
                               "microbatches": self.microbatches}))
        if self.tp > 1:
            # TP's sequence parallelism does not run under a pipeline yet (docs/pp.md)
            out.append(("tp", {"sequence_parallel": True}
                        if sequence_parallel and self.pp == 1 else {}))
        if self.cp > 1:
            out.append(("cp", {"mode": self.cp_mode, **({"seq_len": seq} if seq else {})}))
        if self.ep > 1:
            out.append(("ep", {}))
        if self.ac != "none":
            out.append(("activation_checkpoint", {"mode": self.ac}))
        if "dp_replicate" in mesh:
            out.append(("hsdp", {}))
        if "dp_shard" in mesh:
            options: dict[str, Any] = {}
            if dtype in ("bfloat16", "float16"):
                options["mixed_precision"] = "bf16" if dtype == "bfloat16" else "fp16"
            out.append(("fsdp2", options))
        out.append(("meta_init", {"seed": 0}))
        return out


@attrs.frozen
class Ranked:
    candidate: Candidate
    estimate: Estimate
    reason: str = ""  # why it lost to the best (empty for the best)
    idle: float = 0.0  # seconds of compute a pipeline's bubble leaves idle per step

    @property
    def fits(self) -> bool:
        return bool(self.estimate.fits)

    @property
    def bubble(self) -> float:
        return self.estimate.pipeline.bubble if self.estimate.pipeline else 0.0

    @property
    def seconds(self) -> float:
        """Time per step the ranking compares: communication, plus the bubble's idle time."""
        return self.estimate.seconds + self.idle

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate
        return {
            "layout": self.candidate.label(), "mesh": self.candidate.mesh().to_dict(),
            "activation_checkpoint": self.candidate.ac, "fits": self.fits,
            "memory_bytes": est.memory.total, "communication_seconds": est.seconds,
            "inter_node_bytes": round(est.inter_bytes), "payload_bytes": est.payload,
            "bubble": self.bubble, "bubble_idle_seconds": self.idle,
            "seconds": self.seconds, "reason": self.reason,
        }


@attrs.frozen
class Suggestion:
    topology: Topology
    device_memory: int
    model: ModelShape
    workload: Workload
    ranked: tuple[Ranked, ...]  # best first; fitting before not fitting
    plan_toml: str | None
    why: tuple[str, ...]  # why the best has what it has
    notes: tuple[str, ...] = ()
    report: Report | None = None  # static validation of the suggested plan file

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
            "best": best.to_dict() if best else None,
            "plan_toml": self.plan_toml,
            "why": list(self.why),
            "estimate": best.estimate.to_dict() if best else None,
            "candidates": [r.to_dict() for r in self.ranked],
            "notes": list(self.notes),
            "report": self.report.to_dict() if self.report is not None else None,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(topology: Topology, model: ModelShape, *, max_tp: int | None = None,
               allow_tp: bool = True, pp: int = 1) -> list[Candidate]:
    """Every layout suggest considers (see the module docstring); with ``pp``, those of a
    pipeline of that size over the remaining ranks."""
    world = topology.world_size // pp
    out = []
    for tp in _divisors(topology.devices_per_node):
        if tp > 1 and not allow_tp:
            continue
        if max_tp is not None and tp > max_tp:
            continue
        if world % tp:
            continue
        if tp > 1 and any(h and h % tp for h in (model.heads, model.kv_heads)):
            continue  # TP must divide the head counts it splits
        data = world // tp
        for replicate in _divisors(data):
            shard = data // replicate
            if data == 1 and tp == 1 and pp == 1:
                continue
            for ac in AC_MODES:
                out.append(Candidate(replicate, shard, tp, ac, pp))
    return out


def cp_candidates(topology: Topology, model: ModelShape, seq: int, *,
                  max_tp: int | None = None, allow_tp: bool = True,
                  within_node: bool = True) -> list[Candidate]:
    """The context-parallel layouts suggest considers: for each TP size as
    :func:`candidates` takes it, cp sizes that divide the devices of a node TP leaves
    (``within_node``; else the multiples of them that cross nodes) and whose ``2 x cp``
    divides ``seq``; ``allgather`` mode, and ``alltoall`` where cp divides the head and
    K/V-head counts of a tp rank."""
    world, per_node = topology.world_size, topology.devices_per_node
    out = []
    for tp in _divisors(per_node):
        if (tp > 1 and not allow_tp) or (max_tp is not None and tp > max_tp) or world % tp:
            continue
        if tp > 1 and any(h and h % tp for h in (model.heads, model.kv_heads)):
            continue
        node_share = per_node // tp
        sizes = [c for c in _divisors(world // tp) if c > 1 and seq % (2 * c) == 0
                 and (node_share % c == 0) == within_node
                 and (within_node or c % node_share == 0)]
        for cp in sizes:
            modes = ["allgather"]
            if all(h and (h // tp) % cp == 0 for h in (model.heads, model.kv_heads)):
                modes.append("alltoall")
            data = world // (tp * cp)
            for replicate in _divisors(data):
                for mode in modes:
                    for ac in AC_MODES:
                        out.append(Candidate(replicate, data // replicate, tp, ac, cp=cp,
                                             cp_mode=mode))
    return out


def ep_candidates(topology: Topology, model: ModelShape) -> list[Candidate]:
    """The expert-parallel layouts suggest considers for a mixture-of-experts model: ep
    sizes that divide the devices of a node (its all-to-alls inside it) and the expert
    count, ``ep`` innermost, each with every data-parallel split of the remaining ranks
    (FSDP2 over ``dp_shard x ep``, HSDP, or EP alone) and checkpointing mode; no TP."""
    if model.moe is None:
        return []
    world, per_node = topology.world_size, topology.devices_per_node
    out = []
    for ep in _divisors(per_node):
        if ep < 2 or world % ep or model.moe.num_experts % ep:
            continue
        data = world // ep
        for replicate in _divisors(data):
            for ac in AC_MODES:
                out.append(Candidate(replicate, data // replicate, 1, ac, ep=ep))
    return out


def pipeline_sizes(topology: Topology, model: ModelShape) -> list[int]:
    """The pp sizes suggest tries: divisors of the world that divide the node count or
    that it divides (each stage on whole nodes, or each node holding whole stages), at
    most one block per stage."""
    nodes, world = topology.nodes, topology.world_size
    return [d for d in _divisors(world)
            if 1 < d <= model.layers and (nodes % d == 0 or d % nodes == 0)]


def layout_of(candidate: Candidate, topology: Topology, dtype: str,
              sequence_parallel: bool) -> Layout:
    mesh = candidate.mesh()
    roles = {"pp": Role.OTHER, "dp_replicate": Role.REPLICATE, "dp_shard": Role.SHARD,
             "cp": Role.MODEL_PARALLEL, "ep": Role.MODEL_PARALLEL, "tp": Role.MODEL_PARALLEL}
    owners = {"pp": "pp", "dp_replicate": "hsdp", "dp_shard": "fsdp2", "cp": "cp", "ep": "ep",
              "tp": "tp"}
    mixed = dtype in ("bfloat16", "float16")
    return Layout.build(
        mesh, topology, {n: roles[n] for n in mesh.names}, {n: owners[n] for n in mesh.names},
        reshard_after_forward=None,
        param_dtype=dtype if mixed else None,
        reduce_dtype="float32" if mixed else None,
        sequence_parallel=sequence_parallel and candidate.tp > 1 and candidate.pp == 1,
        activation_checkpoint=candidate.ac,
        # data parallelism folds cp and ep in (FSDP2 shards over dp_shard x cp x ep); a
        # cp rank's activations are those of seq / cp tokens; an ep rank holds
        # num_experts / ep experts, sharded over the data-parallel dims without ep
        folded_dims=tuple(d for d, n in (("cp", candidate.cp), ("ep", candidate.ep)) if n > 1),
        sequence_split=candidate.cp,
        experts_dim="ep" if candidate.ep > 1 else None,
    )


def crosses_with_collectives(est: Estimate) -> list[str]:
    """The sharded and tensor-parallel mesh dims of an estimate that cross nodes."""
    return [f"{d.name}({d.size})" for d in est.layout.dims
            if d.size > 1 and d.role in (Role.SHARD, Role.MODEL_PARALLEL) and d.crosses_nodes]


def compute_seconds(model: ModelShape, seq: int, micro_batch: int, ac: str,
                    tflops: float) -> float:
    """One rank's compute per step at ``tflops``: ``6 x params x tokens`` (forward and
    backward) for its ``micro_batch x seq`` tokens' share, + a forward again under full
    activation checkpointing."""
    flops = 6 * model.params * seq * micro_batch * (4 / 3 if ac == "full" else 1)
    return flops / (tflops * 1e12)


def suggest(
    model: ModelShape,
    topology: Topology,
    device_memory: int,
    *,
    seq: int,
    micro_batch: int = 1,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    max_tp: int | None = None,
    attention: str = "sdpa",
    registry: Registry | None = None,
    device_tflops: float = DEFAULT_DEVICE_TFLOPS,
) -> Suggestion:
    """Rank every candidate layout for ``model`` on ``topology`` (see the module doc).

    ``device_tflops``: the achieved throughput per device that prices a pipeline's
    bubble (compute left idle)."""
    from composer_par.estimate import dtype_name

    dtype = dtype_name(dtype)
    notes: list[str] = []
    installed = _installed(registry)
    sequence_parallel = "tp" not in installed or "sequence_parallel" in installed.get("tp", ())
    allow_tp = True
    if installed and "tp" not in installed:
        notes.append("the tp plugin is not installed: layouts with TP are still estimated")
    topology = attrs.evolve(
        topology,
        intra_node_gbps=intra_node_gbps if intra_node_gbps is not None
        else topology.intra_node_gbps,
        inter_node_gbps=inter_node_gbps if inter_node_gbps is not None
        else topology.inter_node_gbps)
    results = []
    for candidate in candidates(topology, model, max_tp=max_tp, allow_tp=allow_tp):
        workload = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype,
                            reduce_dtype="float32" if dtype in ("bfloat16", "float16") else None,
                            optimizer=optimizer, activation_checkpoint=candidate.ac,
                            grad_accum=candidate.tp, sync="every", attention=attention)
        layout = layout_of(candidate, topology, dtype, sequence_parallel)
        est = estimate(layout, model, workload, device_memory=device_memory)
        results.append(Ranked(candidate, est))
    if not results:
        raise EstimateError(f"no layout to consider on {topology.describe()}")
    results += _context_parallel(model, topology, device_memory, results, notes, registry,
                                 installed, seq=seq, micro_batch=micro_batch, dtype=dtype,
                                 optimizer=optimizer, max_tp=max_tp, allow_tp=allow_tp,
                                 attention=attention, sequence_parallel=sequence_parallel)
    results += _expert_parallel(model, topology, device_memory, notes, registry, installed,
                                seq=seq, micro_batch=micro_batch, dtype=dtype,
                                optimizer=optimizer, attention=attention,
                                sequence_parallel=sequence_parallel)
    results += _pipelines(model, topology, device_memory, results, notes, registry,
                          installed, seq=seq, micro_batch=micro_batch, dtype=dtype,
                          optimizer=optimizer, max_tp=max_tp, allow_tp=allow_tp,
                          attention=attention, sequence_parallel=sequence_parallel,
                          device_tflops=device_tflops)
    fitting = sorted((r for r in results if r.fits), key=_rank_key)
    others = sorted((r for r in results if not r.fits), key=lambda r: r.estimate.memory.total)
    ordered = fitting + others
    best = fitting[0] if fitting else None
    ranked = tuple(attrs.evolve(r, reason=_reason(r, best, device_memory)) if r is not best
                   else r for r in ordered)
    plan_toml = None
    report = None
    why: list[str] = []
    if best is not None:
        plan_toml = plan_file(best.candidate, topology, dtype, sequence_parallel, best.estimate,
                              seq=seq, micro_batch=micro_batch)
        why = _why(best, results, device_memory)
        report = _validate(plan_toml, installed, notes)
    else:
        smallest = others[0]
        notes.append(f"no layout fits in {format_bytes(device_memory)}: the smallest "
                     f"({smallest.candidate.label()}) needs "
                     f"{format_bytes(smallest.estimate.memory.total)}; add devices, shorten "
                     "the sequence or the micro-batch")
    return Suggestion(topology, device_memory, model,
                      Workload(seq=seq, micro_batch=micro_batch, dtype=dtype,
                               optimizer=optimizer, attention=attention),
                      ranked, plan_toml, tuple(why), tuple(notes), report)


def _activations_lead(est: Estimate) -> bool:
    """Whether activations are the largest part of an estimate's memory."""
    mem = est.memory
    return mem.activations >= max(mem.params, mem.grads, mem.optimizer, mem.comm_buffers)


def _context_parallel(
    model: ModelShape, topology: Topology, device_memory: int, results: Sequence[Ranked],
    notes: list[str], registry: Registry | None, installed: dict[str, tuple[str, ...]], *,
    seq: int, micro_batch: int, dtype: str, optimizer: str, max_tp: int | None,
    allow_tp: bool, attention: str, sequence_parallel: bool,
) -> list[Ranked]:
    """The context-parallel layouts, estimated through the installed ``cp`` plugin's own
    terms (its attention collectives and K/V buffers), when no layout without CP fits or
    the activations lead the memory of every one that does."""
    fits = [r for r in results if r.fits]
    if fits and not all(_activations_lead(r.estimate) for r in fits):
        return []
    if not model.heads:
        return []
    if "cp" not in installed:
        notes.append("the cp plugin is not installed: context-parallel layouts not "
                     "considered")
        return []
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.registry import Registry

    cp_class: Any = (registry or Registry()).get("cp")  # options are the plugin's own
    why = ("nothing without CP fits" if not fits else
           "activations are the largest part of every layout without CP that fits")
    mixed = dtype in ("bfloat16", "float16")
    out: list[Ranked] = []
    for within_node in (True, False):
        found = cp_candidates(topology, model, seq, max_tp=max_tp, allow_tp=allow_tp,
                              within_node=within_node)
        for candidate in found:
            workload = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype,
                                reduce_dtype="float32" if mixed else None,
                                optimizer=optimizer, activation_checkpoint=candidate.ac,
                                grad_accum=candidate.tp * candidate.cp, sync="every",
                                attention=attention)
            layout = layout_of(candidate, topology, dtype, sequence_parallel)
            plan = ParallelPlan(candidate.mesh()).use(
                cp_class(mode=candidate.cp_mode, seq_len=seq))
            est = estimate(layout, model, workload, plan=plan, device_memory=device_memory)
            out.append(Ranked(candidate, est))
        if any(r.fits for r in out):
            break
    if out:
        notes.append(f"context-parallel layouts considered ({why}): cp sizes that divide "
                     "the devices of a node left by TP first; every layout still processes "
                     "the same sequences per step (cp x tp micro-batches accumulated)")
    return out


def _expert_parallel(
    model: ModelShape, topology: Topology, device_memory: int, notes: list[str],
    registry: Registry | None, installed: dict[str, tuple[str, ...]], *, seq: int,
    micro_batch: int, dtype: str, optimizer: str, attention: str, sequence_parallel: bool,
) -> list[Ranked]:
    """The expert-parallel layouts of a mixture-of-experts model, estimated through the
    installed ``ep`` plugin's own terms (its all-to-alls) and the experts it holds."""
    found = ep_candidates(topology, model)
    if not found:
        return []
    if "ep" not in installed:
        notes.append("the ep plugin is not installed: expert-parallel layouts not considered")
        return []
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.registry import Registry

    reg = registry or Registry()
    mixed = dtype in ("bfloat16", "float16")
    out = []
    for candidate in found:
        workload = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype,
                            reduce_dtype="float32" if mixed else None, optimizer=optimizer,
                            activation_checkpoint=candidate.ac, attention=attention)
        layout = layout_of(candidate, topology, dtype, sequence_parallel)
        plan = ParallelPlan(candidate.mesh())
        for name, options in candidate.plugins(dtype, sequence_parallel, seq):
            if name in ("ep", "fsdp2", "hsdp"):  # the plugins whose terms the estimate asks
                plan.use(reg.get(name)(**options))
        est = estimate(layout, model, workload, plan=plan, device_memory=device_memory)
        out.append(Ranked(candidate, est))
    moe = model.moe
    assert moe is not None
    notes.append(f"expert-parallel layouts considered (top-{moe.top_k} of {moe.num_experts} "
                 "experts): ep sizes that divide the devices of a node and the expert count, "
                 "innermost; their all-to-alls are estimated for uniform routing")
    return out


def _pipelines(
    model: ModelShape, topology: Topology, device_memory: int, results: Sequence[Ranked],
    notes: list[str], registry: Registry | None, installed: dict[str, tuple[str, ...]], *,
    seq: int, micro_batch: int, dtype: str, optimizer: str, max_tp: int | None,
    allow_tp: bool, attention: str, sequence_parallel: bool, device_tflops: float,
) -> list[Ranked]:
    """The pipeline layouts, estimated through the installed ``pp`` plugin's own terms,
    when no layout without a pipeline fits with its collectives inside nodes."""
    sizes = pipeline_sizes(topology, model)
    if not sizes:
        return []
    inside = [r for r in results if r.fits and not crosses_with_collectives(r.estimate)]
    if inside:
        if topology.nodes > 1:
            best = min(inside, key=_rank_key)
            notes.append(f"pipeline layouts not considered: {best.candidate.label()} fits "
                         "and keeps its sharded and tensor-parallel collectives inside nodes "
                         "(a pipeline would idle compute in its bubble to save traffic "
                         "that is already cheap)")
        return []
    if "pp" not in installed:
        notes.append("the pp plugin is not installed: pipeline layouts not considered")
        return []
    from composer_par.plan import ParallelPlan
    from composer_par.plugin.registry import Registry

    pp_class: Any = (registry or Registry()).get("pp")  # options are the plugin's own
    fits = [r for r in results if r.fits]
    why = ("nothing without a pipeline fits" if not fits else
           "every layout without a pipeline that fits runs its sharded or tensor-parallel "
           "collectives across nodes")
    notes.append(f"pipeline layouts considered ({why}): {PIPELINE_SCHEDULE} with pp x tp "
                 f"microbatches; a bubble's idle compute is priced at an assumed "
                 f"{device_tflops:g} TFLOP/s per device")
    out = []
    mixed = dtype in ("bfloat16", "float16")
    for pp in sizes:
        for candidate in candidates(topology, model, max_tp=max_tp, allow_tp=allow_tp, pp=pp):
            workload = Workload(seq=seq, micro_batch=micro_batch, dtype=dtype,
                                reduce_dtype="float32" if mixed else None, optimizer=optimizer,
                                activation_checkpoint=candidate.ac, attention=attention)
            layout = layout_of(candidate, topology, dtype, sequence_parallel)
            plan = ParallelPlan(candidate.mesh()).use(
                pp_class(schedule=PIPELINE_SCHEDULE, microbatches=candidate.microbatches))
            est = estimate(layout, model, workload, plan=plan, device_memory=device_memory)
            if est.pipeline is None:
                continue  # the plugin states no pipeline here (its notes say why)
            bubble = est.pipeline.bubble
            idle = (compute_seconds(model, seq, micro_batch, candidate.ac, device_tflops)
                    * bubble / (1 - bubble)) if bubble < 1 else float("inf")
            out.append(Ranked(candidate, est, idle=idle))
    return out


def _seconds(r: Ranked) -> float:
    """Time per step (communication, + a pipeline's idle bubble) to 3 significant digits:
    closer than that is a tie, broken by the least recomputation, then the least memory."""
    return float(f"{r.seconds:.3g}")


def _rank_key(r: Ranked) -> tuple[float, int, int]:
    return (_seconds(r), _AC_RANK[r.candidate.ac], r.estimate.memory.total)


def _installed(registry: Registry | None) -> dict[str, tuple[str, ...]]:
    """Installed plugin names and their options ({} when the registry cannot be read)."""
    try:
        from composer_par.plugin.registry import Registry

        reg = registry or Registry()
        out = {}
        for name in reg.names():
            try:
                out[name] = reg.get(name).option_names()
            except Exception:
                out[name] = ()
        return out
    except Exception:
        return {}


def _largest_memory(est: Estimate) -> str:
    mem = est.memory
    parts = {"parameters": mem.params, "gradients": mem.grads, "optimizer states": mem.optimizer,
             "activations": mem.activations, "communication buffers": mem.comm_buffers}
    name = max(parts, key=lambda k: parts[k])
    return f"{name} {format_bytes(parts[name])}"


def _dominant(est: Estimate) -> str:
    if not est.traffic:
        return "no communication"
    t = max(est.traffic, key=lambda t: t.seconds)
    where = "across nodes" if t.dim.crosses_nodes else "inside a node"
    calls = ", ".join(k.replace("_", "-") + "s" for k in t.calls())
    return f"{t.dim.name}({t.dim.size}) {calls} {where}: {format_seconds(t.seconds)}"


def _reason(r: Ranked, best: Ranked | None, device_memory: int) -> str:
    est = r.estimate
    if not r.fits:
        return (f"does not fit: needs {format_bytes(est.memory.total)} > "
                f"{format_bytes(device_memory)} ({_largest_memory(est)})")
    assert best is not None
    b = best.estimate
    if _seconds(r) > _seconds(best) and (r.idle or best.idle):
        return (f"slower: {format_seconds(r.seconds)} vs {format_seconds(best.seconds)} per "
                f"step ({_time_parts(r)} vs {_time_parts(best)}); most on {_dominant(est)}")
    if _seconds(r) > _seconds(best):
        return (f"slower: {format_seconds(est.seconds)} vs {format_seconds(b.seconds)} of "
                f"communication per step; most on {_dominant(est)}")
    if _AC_RANK[r.candidate.ac] > _AC_RANK[best.candidate.ac]:
        return (f"same communication, but recomputes more (AC {r.candidate.ac} vs "
                f"{best.candidate.ac}): more compute per step")
    return (f"same communication and checkpointing, more memory "
            f"({format_bytes(est.memory.total)} vs {format_bytes(b.memory.total)})")


def _time_parts(r: Ranked) -> str:
    comm = f"{format_seconds(r.estimate.seconds)} communication"
    if not r.estimate.pipeline:
        return comm
    return f"{comm} + {format_seconds(r.idle)} idle in a {r.bubble:.1%} bubble"


def _why_pipeline(best: Ranked, results: Sequence[Ranked]) -> list[str]:
    """Why the best layout has a pipeline: what the best without one costs or needs."""
    c, est = best.candidate, best.estimate
    line = est.pipeline
    assert line is not None
    without = [r for r in results if r.candidate.pp == 1]
    fitting = [r for r in without if r.fits]
    sends = sum(t.inter_bytes for t in est.traffic if t.dim.name == line.dim)
    ours = (f"this one sends {format_bytes(est.inter_bytes)} across nodes per rank "
            f"({format_bytes(sends)} of it point-to-point), and its {line.title} schedule "
            f"idles {line.bubble:.1%} of each step ({format_seconds(best.idle)})")
    if not fitting:
        smallest = min(without, key=lambda r: r.estimate.memory.total)
        return [f"PP {c.pp}: no layout without a pipeline fits; the smallest "
                f"({smallest.candidate.label()}) needs "
                f"{format_bytes(smallest.estimate.memory.total)} "
                f"({_largest_memory(smallest.estimate)}); each pp rank holds "
                f"{len(line.ranks[0].stages)} stage(s) of about 1/{c.pp} of the blocks; {ours}"]
    fastest = min(fitting, key=_rank_key)
    crossing = ", ".join(crosses_with_collectives(fastest.estimate))
    return [f"PP {c.pp}: less inter-node traffic: the fastest layout without a pipeline "
            f"({fastest.candidate.label()}) runs {crossing} across nodes, "
            f"{format_bytes(fastest.estimate.inter_bytes)} per rank "
            f"({format_seconds(fastest.estimate.seconds)} of communication); {ours}; "
            f"{format_seconds(best.seconds)} vs {format_seconds(fastest.seconds)} per step"]


def _same_cp(a: Candidate, b: Candidate) -> bool:
    return (a.cp, a.cp_mode, a.ep) == (b.cp, b.cp_mode, b.ep)


def _why_context_parallel(best: Ranked, results: Sequence[Ranked],
                          device_memory: int) -> list[str]:
    """Why the best layout has CP: what the layouts without it need or cost."""
    c, est = best.candidate, best.estimate
    without = [r for r in results if r.candidate.cp == 1 and r.candidate.pp == 1]
    ours = (f"each rank holds {est.workload.seq // c.cp} of every sequence's "
            f"{est.workload.seq} tokens (activations "
            f"{format_bytes(est.memory.activations)}), attention across the cp ranks in "
            f"{c.cp_mode} mode")
    fitting = [r for r in without if r.fits]
    if not fitting and without:
        smallest = min(without, key=lambda r: r.estimate.memory.total)
        return [f"CP {c.cp}: no layout without CP fits; the smallest "
                f"({smallest.candidate.label()}) needs "
                f"{format_bytes(smallest.estimate.memory.total)} > "
                f"{format_bytes(device_memory)} ({_largest_memory(smallest.estimate)}); "
                + ours]
    if not fitting:
        return [f"CP {c.cp}: {ours}"]
    fastest = min(fitting, key=_rank_key)
    return [f"CP {c.cp}: faster than the best layout without CP ({fastest.candidate.label()}: "
            f"{format_seconds(fastest.seconds)} per step, activations "
            f"{format_bytes(fastest.estimate.memory.activations)}); " + ours]


#: The ratio of the most loaded ep rank's routed pairs to the mean that suggest prices
#: as the imbalance risk of an expert-parallel layout.
IMBALANCE = 2.0


def imbalance_risk(est: Estimate, factor: float = IMBALANCE) -> str:
    """What tokens-per-expert imbalance costs an expert-parallel estimate: the rank whose
    experts receive ``factor`` times the mean pairs moves that many in its combine
    (forward) and dispatch (backward) and computes that many, and every rank waits."""
    ex = est.experts
    if ex is None:
        return ""
    ep = next(t for t in est.traffic if t.dim.name == ex.dim)
    received = sum(r.payload for r in ex.all_to_all
                   if r.why.startswith(("combine, forward", "dispatch, backward")))
    share = received / ex.all_to_all_bytes if ex.all_to_all_bytes else 0.0
    slower = ep.seconds * (1 + share * (factor - 1))
    return (f"risk: tokens-per-expert imbalance. The estimate assumes uniform routing; the "
            f"ep rank whose experts receive the most pairs sets the pace of every rank: at "
            f"{factor:g}x the mean, its all-to-alls take {format_seconds(slower)} instead of "
            f"{format_seconds(ep.seconds)} per step and its expert compute {factor:g}x; "
            "watch routing_stats (rank_max / rank_mean) and the router's balancing loss")


def _why_expert_parallel(best: Ranked, results: Sequence[Ranked],
                         device_memory: int) -> list[str]:
    """Why the best layout has EP (against FSDP2 alone), and its imbalance risk."""
    c, est = best.candidate, best.estimate
    ex = est.experts
    if ex is None:
        return []
    shard = (f", sharded over the {ex.experts_shard} data-parallel rank(s) without ep"
             if ex.experts_shard > 1 else "")
    ep = next(t for t in est.traffic if t.dim.name == ex.dim)
    ours = (f"each rank holds {ex.experts_per_rank} of every MoE block's "
            f"{est.model.moe.num_experts if est.model.moe else '?'} experts{shard}, "
            f"{format_count(ex.dense_params + ex.experts_params)} parameters in all; the "
            f"all-to-alls move {format_bytes(ex.all_to_all_bytes)} per step inside a node "
            f"({format_seconds(ep.seconds)})")
    without = [r for r in results if r.candidate.ep == 1 and r.candidate.pp == 1]
    fitting = [r for r in without if r.fits]
    if not fitting:
        smallest = min(without, key=lambda r: r.estimate.memory.total, default=None)
        lead = (f"EP {c.ep}: no layout without EP fits; the smallest "
                f"({smallest.candidate.label()}) needs "
                f"{format_bytes(smallest.estimate.memory.total)} > "
                f"{format_bytes(device_memory)}; " if smallest else f"EP {c.ep}: ")
        out = [lead + ours]
    else:
        fastest = min(fitting, key=_rank_key)
        out = [f"EP {c.ep}: faster than the best layout without EP "
               f"({fastest.candidate.label()}: {format_seconds(fastest.seconds)} per step, "
               f"{format_bytes(fastest.estimate.inter_bytes)} across nodes per rank, where "
               "every rank gathers every expert); " + ours]
    return [*out, imbalance_risk(est)]


def _why(best: Ranked, results: Sequence[Ranked], device_memory: int) -> list[str]:
    """Why the best layout has PP, TP, HSDP, activation checkpointing (or not)."""
    c, est = best.candidate, best.estimate
    out = [f"best: {c.label()}: {format_bytes(est.memory.total)} per rank of "
           f"{format_bytes(device_memory)}, {format_seconds(est.seconds)} of communication per "
           f"step ({format_bytes(est.inter_bytes)} across nodes per rank)"]
    if est.pipeline is not None:
        out += _why_pipeline(best, results)
    if c.cp > 1:
        out += _why_context_parallel(best, results, device_memory)
    if c.ep > 1:
        out += _why_expert_parallel(best, results, device_memory)
    # the other choices against layouts with the same pipeline size
    results = [r for r in results if r.candidate.pp == c.pp]
    if c.tp > 1:
        without = [r for r in results if r.candidate.tp == 1]
        if without and not any(r.fits for r in without):
            smallest = min(without, key=lambda r: r.estimate.memory.total)
            out.append(f"TP {c.tp}: no layout without TP fits; the smallest "
                       f"({smallest.candidate.label()}) needs "
                       f"{format_bytes(smallest.estimate.memory.total)} "
                       f"({_largest_memory(smallest.estimate)}); TP splits the blocks' "
                       "parameters and (with sequence parallel) their activations")
        else:
            fastest = min((r for r in without if r.fits), key=_rank_key, default=None)
            if fastest is not None:
                out.append(f"TP {c.tp}: less communication than the best layout without TP "
                           f"({fastest.candidate.label()}: "
                           f"{format_seconds(fastest.estimate.seconds)})")
    if c.replicate > 1 and c.shard > 1:
        fsdp = [r for r in results if r.candidate.tp == c.tp and r.candidate.replicate == 1
                and r.candidate.ac == c.ac and _same_cp(r.candidate, c)]
        if fsdp:
            f = fsdp[0].estimate
            out.append(f"HSDP {c.replicate}x{c.shard}: all-gathers and reduce-scatters stay in "
                       f"groups of {c.shard}; only the gradient all-reduce crosses the "
                       f"{c.replicate} replicas ({format_bytes(est.inter_bytes)} across nodes "
                       f"per rank vs {format_bytes(f.inter_bytes)} for FSDP over all "
                       f"{c.data_parallel}: {format_seconds(f.seconds)})")
    elif c.replicate == 1 and c.shard > 1:
        hsdp = [r for r in results if r.candidate.tp == c.tp and r.candidate.replicate > 1
                and r.candidate.ac == c.ac and _same_cp(r.candidate, c)]
        if hsdp:
            if all(not r.fits for r in hsdp):
                out.append(f"FSDP {c.shard}: no HSDP split fits (a replica group would hold "
                           f"{format_bytes(min(r.estimate.memory.total for r in hsdp))} per "
                           "rank at best)")
            else:
                out.append(f"FSDP {c.shard}: faster than every HSDP split that fits")
    if c.ac != "none":
        lighter = [r for r in results
                   if attrs.evolve(r.candidate, ac="none") == attrs.evolve(c, ac="none")
                   and _AC_RANK[r.candidate.ac] < _AC_RANK[c.ac]]
        if lighter:
            need = min(r.estimate.memory.total for r in lighter)
            out.append(f"AC {c.ac}: with less checkpointing this layout needs "
                       f"{format_bytes(need)} > {format_bytes(device_memory)} "
                       f"(activations {format_bytes(lighter[0].estimate.memory.activations)})")
    return out


def plan_file(candidate: Candidate, topology: Topology, dtype: str, sequence_parallel: bool,
              est: Estimate | None = None, *, seq: int | None = None,
              micro_batch: int | None = None) -> str:
    """The candidate as a plan file (TOML), with the estimate as comments."""
    from composer_par.planfile import toml_key, toml_value

    lines = [f"# suggested by composer-par suggest: {candidate.label()}"]
    if est is not None:
        lines.append(f"# per rank: {format_bytes(est.memory.total)}; communication "
                     f"{format_seconds(est.seconds)} per step"
                     + (f" (seq {seq}, micro-batch {micro_batch})" if seq else ""))
    lines.append("[mesh]")
    lines += [f"{toml_key(n)} = {s}" for n, s in candidate.mesh().dims]
    lines += ["", "[topology]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in topology.to_dict().items()]
    for name, options in candidate.plugins(dtype, sequence_parallel, seq):
        lines += ["", "[[plugins]]", f"name = {toml_value(name)}"]
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in options.items()]
    return "\n".join(lines) + "\n"


def _validate(plan_toml: str, installed: dict[str, tuple[str, ...]],
              notes: list[str]) -> Report | None:
    import tomllib

    names = [p["name"] for p in tomllib.loads(plan_toml).get("plugins", [])]
    missing = [n for n in names if n not in installed]
    if missing:
        notes.append(f"not installed here, so the plan file was not validated: "
                     f"{', '.join(missing)}")
        return None
    from composer_par.plan import ParallelPlan
    from composer_par.planfile import PlanFileError

    try:
        plan = ParallelPlan.from_toml(plan_toml)
    except PlanFileError as exc:
        notes.append("the suggested plan file does not read back: "
                     + "; ".join(f.message for f in exc.report.findings))
        return exc.report
    return plan.validate(world_size=plan.world_size())


def format_suggestion(s: Suggestion, *, top: int = 10, paint: Any = None) -> str:
    paint = paint or (lambda text, style: text)
    lines = [f"suggest: {s.model.describe()} on {s.topology.describe()}, "
             f"{format_bytes(s.device_memory)} per device",
             f"workload: seq {s.workload.seq}, micro-batch {s.workload.micro_batch} per "
             f"data-parallel rank, {s.workload.dtype}, {s.workload.optimizer}; every layout "
             f"processes {s.workload.micro_batch * s.topology.world_size} sequences per step "
             "(TP layouts accumulate tp micro-batches, CP layouts cp x tp, pipelines run "
             "pp x tp microbatches)",
             f"considered {len(s.ranked)} layouts, {sum(r.fits for r in s.ranked)} fit"]
    if s.best is not None:
        lines += ["", paint("best plan:", "ok")] + [f"  {w}" for w in s.why]
        lines += ["", "```toml", s.plan_toml.rstrip("\n") if s.plan_toml else "", "```"]
        if s.report is not None and s.report.findings:
            lines += ["validation of this plan file:"] + [
                "  " + line for line in s.report.format().splitlines()]
    rows = []
    pipelines = any(r.estimate.pipeline is not None for r in s.ranked)
    for index, r in enumerate(s.ranked[: top + 1]):
        est = r.estimate
        bubble = ((f"{r.bubble:.1%}" if est.pipeline is not None else "-",) if pipelines
                  else ())
        rows.append((str(index + 1), r.candidate.label(), format_bytes(est.memory.total),
                     "yes" if r.fits else "no", format_seconds(est.seconds), *bubble,
                     format_bytes(est.inter_bytes), r.reason or "best"))
    from composer_par.tables import table

    lines += ["", "candidates (best first):"]
    bubble_header = ("BUBBLE",) if pipelines else ()
    lines.append(table(
        rows, ("#", "LAYOUT", "MEMORY/RANK", "FITS", "COMM/STEP", *bubble_header,
               "INTER-NODE/RANK", "WHY NOT"),
        right=(0, 2, 4, 5, 6) if pipelines else (0, 2, 4, 5), indent="  "))
    if len(s.ranked) > top + 1:
        lines.append(f"  ... {len(s.ranked) - top - 1} more (--top N shows more; --json has all)")
    if s.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in s.notes]
    return "\n".join(lines)


__all__ = ["DEFAULT_DEVICE_TFLOPS", "Candidate", "Ranked", "Suggestion", "candidates",
           "compute_seconds", "cp_candidates", "crosses_with_collectives", "ep_candidates",
           "format_suggestion", "imbalance_risk", "pipeline_sizes", "plan_file", "suggest"]
