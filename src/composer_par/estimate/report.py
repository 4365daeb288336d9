"""The estimate as text: the accounting printed with every estimate, and its tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_par.estimate.devices import ACHIEVED_SHARE
from composer_par.estimate.memory import optimizer_bytes
from composer_par.estimate.units import bytes_of, format_bytes, format_count, format_seconds
from composer_par.plugin.base import Role
from composer_par.tables import table

if TYPE_CHECKING:
    from composer_par.estimate.estimator import Estimate


ACCOUNTING: tuple[str, ...] = (
    "memory (ZeRO): 16-bit mixed precision = 2 B parameters + 2 B gradients + 12 B optimizer "
    "(fp32 master + AdamW m, v) per parameter; fp32 = 4 + 4 + 8; SGD keeps only the fp32 "
    "master (4 B, 0 in fp32); each divided by the shard dims (with the dims data "
    "parallelism folds in) and, for tensors they split, the model-parallel dims; each "
    "plugin adds its own terms by category (buffers, what it keeps or moves off the device)",
    "activations (Korthikanti et al. 2022), per block, 16-bit: s*b*h*(34 + 5*a*s/h); with TP t: "
    "s*b*h*(10 + 24/t + 5*a*s/(h*t)); sequence parallel divides all by t; selective AC drops "
    "5*a*s/h; full AC keeps 2*s*b*h per block + one block's activations; fp32 doubles; the "
    "attention-score term 5*a*s/h counts only with eager attention (SDPA's flash and "
    "memory-efficient kernels keep no scores); + s*b*vocab*4 for fp32 logits, and at the "
    "start of backward 2*s*b*vocab*4 more (the loss's fp32 gradients); a Llama's blocks "
    "are counted from their structure (docs/estimate.md)",
    "communication: each plugin states its collectives per mesh dim. Bytes are logical "
    "payloads (all-gather: the gathered output; reduce-scatter: the full input; all-reduce: "
    "the tensor; all-to-all: the input)",
    "time: ring collectives (NCCL's), rail optimized: a rank sends X*(n-1)/n for an "
    "all-gather or reduce-scatter of X bytes over n ranks (an all-reduce twice that); when the "
    "group spans k > 1 nodes with m ranks on each, 1/m of that leaves the node through the "
    "rank's own network link, the rest stays inside; an all-to-all of X sends X/n to each "
    "other rank directly: (m-1)/n of X inside the node, (n-m)/n across; seconds = intra "
    "bytes / intra-node bandwidth + inter bytes / inter-node bandwidth (per device), no "
    "latency term",
    "step time: FLOPs per token 6*N (N: active parameters outside the input embedding) + "
    "12*layers*heads*head_dim*seq (attention, torchtitan's count), times the step's tokens, "
    "over the world; matmuls at the throughput the device achieves in the matmul dtype, "
    "attention in the activations' dtype; + the communication nothing hides (overlap none) "
    "+ what overlapping communication exceeds the compute by; divided by 1 - bubble; MFU = "
    "model FLOPs / (step time x the device's dense 16-bit peak)",
)


def _how(base: str, terms: list[tuple[str, Any]]) -> str:
    """A row's HOW: the core's part, then each plugin's term."""
    parts = [base] if base else []
    parts += [f"{'+' if t.bytes >= 0 else '-'} {format_bytes(abs(t.bytes))} "
              f"{who + ': ' if who else ''}{t.why}" for who, t in terms]
    return "; ".join(parts)


def format_estimate(est: Estimate, paint: Any = None) -> str:
    """The estimate as text; ``paint(text, style)`` colors (the CLI's Output.paint)."""
    paint = paint or (lambda text, style: text)
    mem, work, layout = est.memory, est.workload, est.layout
    lines = [f"layout: {layout.describe()}", f"model: {est.model.describe()}"]
    mixed = bytes_of(est.dtype) == 2
    precision = (f"{est.dtype} mixed precision (gradients reduced in {est.reduce_dtype})"
                 if mixed else est.dtype)
    ac = est.activation_checkpoint + (f" (every {layout.checkpoint_every} blocks)"
                                      if layout.checkpoint_every > 1 else "")
    lines.append(f"workload: seq {work.seq}, micro-batch {work.micro_batch}"
                 + (f" x {work.grad_accum} accumulated (sync {work.sync!r})"
                    if work.grad_accum > 1 else "")
                 + f", {precision}, {work.optimizer}, activation checkpointing {ac}, "
                 f"attention {work.attention}")
    divided = " / ".join(f"{d.name}({d.size})" for d in layout.dims
                         if d.size > 1 and (d.role is Role.SHARD
                                            or d.name in layout.folded_dims
                                            or d.role is Role.MODEL_PARALLEL))
    fullest, slowest = est.fullest, est.slowest
    line = est.pipeline
    whole = est.model.params
    if fullest is not None and line is not None:
        lines += ["", f"memory per rank (the fullest {line.dim} rank: {line.dim} "
                  f"{fullest.coordinate}, {', '.join(fullest.stages)}):"]
        whole = fullest.params
    else:
        lines += ["", "memory per rank:"]
    pb = 2 if mixed else bytes_of(est.dtype)
    ob = optimizer_bytes(work.optimizer, mixed)
    of_what = "params of its stage(s)" if fullest is not None else "params"
    rows: list[tuple[str, ...]] = [
        ("parameters", format_bytes(mem.params), _how(
            f"{format_count(mem.local_params)} of {format_count(whole)} {of_what} here"
            + (f" (divided by {divided})" if divided else "") + f", {pb} B each",
            mem.by_plugin("params"))),
        ("gradients", format_bytes(mem.grads),
         _how(f"{pb} B per parameter", mem.by_plugin("grads"))),
        ("optimizer states", format_bytes(mem.optimizer),
         _how(f"{work.optimizer}: {ob} B per parameter", mem.by_plugin("optimizer"))),
        ("activations", format_bytes(mem.activations), _how(
            "AC " + ", ".join(f"{m}: {format_bytes(v)}"
                              for m, v in mem.activations_by_mode.items()),
            mem.by_plugin("activations"))),
        ("communication buffers", format_bytes(mem.comm_buffers),
         _how("", mem.by_plugin("buffers"))),
    ]
    if mem.loss_gradients:
        rows.append(("loss gradients", format_bytes(mem.loss_gradients),
                     "at the start of backward: two fp32 copies of the logits"))
    rows += [(name, format_bytes(size), "") for name, size in mem.extra.items()]
    total = format_bytes(mem.total)
    verdict = ""
    if est.device_memory is not None:
        verdict = (paint(f"fits in {format_bytes(est.device_memory)}", "ok") if est.fits
                   else paint(f"does NOT fit in {format_bytes(est.device_memory)}", "ERROR"))
    rows.append(("total", total, verdict))
    lines.append(table(rows, ("COMPONENT", "BYTES", "HOW"), right=(1,), indent="  "))
    if slowest is not None and line is not None:
        lines += ["", f"communication per step and rank (the slowest {line.dim} rank: "
                  f"{line.dim} {slowest.coordinate}):"]
    else:
        lines += ["", "communication per step and rank:"]
    if est.traffic:
        rows = []
        for t in est.traffic:
            where = ("crosses nodes" if t.dim.crosses_nodes
                     else "inside a node" if t.dim.crosses_nodes is False else "?")
            calls = ", ".join(f"{k} x{v}" for k, v in t.calls().items())
            rows.append((f"{t.dim.name}({t.dim.size})", t.dim.role.value if t.dim.role else "-",
                         where, calls, format_bytes(t.payload), format_bytes(t.intra_bytes),
                         format_bytes(t.inter_bytes), format_seconds(t.seconds),
                         format_seconds(t.overlapped_seconds)))
        rows.append(("total", "", "", "", format_bytes(est.payload),
                     format_bytes(sum(t.intra_bytes for t in est.traffic)),
                     format_bytes(est.inter_bytes), format_seconds(est.seconds),
                     format_seconds(sum(t.overlapped_seconds for t in est.traffic))))
        lines.append(table(
            rows, ("MESH DIM", "ROLE", "WHERE", "COLLECTIVES", "PAYLOAD", "INTRA-NODE",
                   "INTER-NODE", "TIME", "OF IT OVERLAPPABLE"), right=(4, 5, 6, 7, 8),
            indent="  "))
    else:
        lines.append("  none (a single rank, or no mesh dim of size > 1)")
    assumed = set(est.bandwidth_assumed)
    lines.append(f"  bandwidth per device: intra-node {est.intra_node_gbps:g} Gbit/s"
                 + (" (assumed)" if "intra_node" in assumed else "")
                 + f", inter-node {est.inter_node_gbps:g} Gbit/s"
                 + (" (assumed)" if "inter_node" in assumed else ""))
    lines += ["", *format_step(est)]
    for _, section in est.sections:
        lines += ["", *section.lines]
    if est.accumulation:
        lines += ["", *format_accumulation(est)]
    if line is not None:
        lines += ["", *format_pipeline(est)]
    lines += ["", "accounting:"] + [f"  - {a}" for a in (*ACCOUNTING, *est.accounting)]
    if line is not None:
        lines += [f"  - {a}" for a in PIPELINE_ACCOUNTING]
    if est.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in est.notes]
    return "\n".join(lines)


def format_step(est: Estimate) -> list[str]:
    """The step-time section: compute, communication, bubble; tokens/s and MFU."""
    step = est.step
    dev = step.device
    rate = (f"{dev.achieved_tflops:g} TFLOP/s given" if dev.achieved_tflops is not None
            else f"{ACHIEVED_SHARE:.0%} of its {step.matmul_dtype} peak "
            f"{dev.peak(step.matmul_dtype):g} TFLOP/s")
    lines = [f"step time per rank on {dev.title} (matmuls in {step.matmul_dtype}: {rate}):"]
    rows = [("compute", format_seconds(step.compute_seconds),
             f"{format_count(step.flops.per_rank)}FLOP model + "
             f"{format_count(step.extra_flops)}FLOP recomputed per rank "
             f"({format_count(step.flops.per_token)}FLOP per token, "
             f"{format_count(step.flops.tokens)} tokens per step)"),
            ("communication, exposed", format_seconds(step.exposed_seconds),
             "collectives nothing hides"),
            ("communication, overlapped", format_seconds(step.overlapped_seconds),
             f"{format_seconds(step.hidden_seconds)} of it hidden behind compute")]
    if step.bubble:
        rows.append(("pipeline bubble", format_seconds(step.idle_seconds),
                     f"{step.bubble:.1%} of the step idle"))
    rows.append(("step", format_seconds(step.seconds),
                 f"{step.tokens_per_second_per_device:,.0f} tokens/s per device, "
                 f"MFU {step.mfu:.1%}"))
    lines.append(table(rows, ("PART", "TIME", "HOW"), right=(1,), indent="  "))
    return lines


PIPELINE_ACCOUNTING: tuple[str, ...] = (
    "pipeline: each rank's memory and communication are its own stages' (the tables above "
    "show the fullest and the slowest rank), every plugin's terms asked per stage; "
    "activations: one microbatch's per stage (its blocks, the logits on the last), times the "
    "microbatches of each stage the rank holds at its heaviest moment of the schedule's "
    "timeline (+ one block recomputed under full AC); point-to-point: the sends the cutting "
    "plugin states, each over the network when the peer is on another node; the bubble "
    "idles each rank (step time)",
)


def format_accumulation(est: Estimate) -> list[str]:
    """Every sync policy of the training step's accumulation: gradient memory per rank,
    gradient reductions per optimizer step."""
    work = est.workload
    lines = [f"gradient accumulation: {work.grad_accum} micro-batches per optimizer step, "
             f"each sync policy (the estimate above is sync {work.sync!r}):"]
    rows = []
    for cost in est.accumulation:
        rows.append((repr(cost.sync), format_bytes(cost.grads),
                     "unsharded" if cost.unsharded else "sharded",
                     str(cost.reduce_scatter_calls), format_bytes(cost.reduce_scatter_bytes),
                     str(cost.all_reduce_calls), format_bytes(cost.all_reduce_bytes)))
    lines.append(table(rows, ("SYNC", "GRADIENTS", "HELD", "REDUCE-SCATTERS", "PAYLOAD",
                              "ALL-REDUCES", "PAYLOAD"), right=(1, 3, 4, 5, 6),
                       indent="  "))
    lines.append("  (GRADIENTS: bytes per rank between micro-batches; reduce-scatters over "
                 "the shard dims and all-reduces over the replicate dims, of the gradients, "
                 "per optimizer step)")
    return lines


def format_pipeline(est: Estimate) -> list[str]:
    """The pipeline section: the schedule, the bubble, and every pipeline rank."""
    line = est.pipeline
    assert line is not None
    dim = line.dim
    lines = [f"pipeline over {dim}: {line.title}; bubble {line.bubble:.1%} of each rank's "
             "step (idle)"]
    rows = []
    for r in est.ranks:
        rows.append((f"{dim} {r.coordinate}", ", ".join(s.removeprefix("stage ")
                                                        for s in r.stages),
                     str(r.blocks), format_count(r.params), str(r.in_flight),
                     format_bytes(r.memory.activations), format_bytes(r.memory.total),
                     format_bytes(r.send_intra_bytes), format_bytes(r.send_inter_bytes),
                     format_seconds(r.seconds)))
    lines.append(table(rows, ("RANK", "STAGES", "BLOCKS", "PARAMS", "IN FLIGHT",
                              "ACTIVATIONS", "MEMORY", "P2P INTRA", "P2P INTER", "COMM TIME"),
                       right=(2, 3, 4, 5, 6, 7, 8, 9), indent="  "))
    size = est.layout.mesh.size(dim)
    groups = max(1, est.layout.mesh.world_size // max(1, size))
    intra = sum(r.send_intra_bytes for r in est.ranks)
    inter = sum(r.send_inter_bytes for r in est.ranks)
    lines.append(f"  point-to-point per step: {format_bytes(intra)} inside nodes and "
                 f"{format_bytes(inter)} between nodes per pipeline ({size} ranks); "
                 f"{groups} pipeline(s): {format_bytes(intra * groups)} and "
                 f"{format_bytes(inter * groups)} in all")
    lines.append("  (P2P: bytes each rank sends per step; IN FLIGHT: the most "
                 "stage-microbatches whose activations it holds at once)")
    return lines
