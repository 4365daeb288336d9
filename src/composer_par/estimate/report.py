"""The estimate as text: the accounting printed with every estimate, and its tables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_par.estimate.memory import optimizer_bytes
from composer_par.estimate.units import bytes_of, format_bytes, format_count, format_seconds
from composer_par.plugin.base import Role
from composer_par.tables import table

if TYPE_CHECKING:
    from composer_par.estimate.estimator import Estimate


ACCOUNTING: tuple[str, ...] = (
    "memory (ZeRO): 16-bit mixed precision = 2 B parameters + 2 B gradients + 12 B optimizer "
    "(fp32 master + AdamW m, v) per parameter; fp32 = 4 + 4 + 8; SGD keeps only the fp32 "
    "master (4 B, 0 in fp32); each divided by the shard dim and, for tensors it splits, the "
    "tensor-parallel dim",
    "activations (Korthikanti et al. 2022), per block, 16-bit: s*b*h*(34 + 5*a*s/h); with TP t: "
    "s*b*h*(10 + 24/t + 5*a*s/(h*t)); sequence parallel divides all by t; selective AC drops "
    "5*a*s/h; full AC keeps 2*s*b*h per block + one block's activations; fp32 doubles; the "
    "attention-score term 5*a*s/h counts only with eager attention (SDPA's flash and "
    "memory-efficient kernels keep no scores); + s*b*vocab*4 for fp32 logits",
    "FSDP: all-gather every parameter group (each block, then the root) in forward, again in "
    "backward when resharded after forward; reduce-scatter gradients. HSDP: all-reduce the "
    "gradient shard over the replicate dim (alone: the whole gradient). TP: 2 forward + 2 "
    "backward s*b*h activation collectives per block (+2 per recomputed block; without "
    "sequence parallel, one backward all-reduce per column-parallel Linear: 5 in a Llama "
    "block), +1 at the embedding and +1 at the output head each way, + the gathered logits "
    "without loss parallel. Bytes are logical payloads (all-gather: the gathered output; "
    "reduce-scatter: the full input; all-reduce: the tensor)",
    "time: ring collectives (NCCL's), rail optimized: a rank sends X*(n-1)/n for an "
    "all-gather or reduce-scatter of X bytes over n ranks (an all-reduce twice that); when the "
    "group spans k > 1 nodes with m ranks on each, 1/m of that leaves the node through the "
    "rank's own network link, the rest stays inside; an all-to-all of X sends X/n to each "
    "other rank directly: (m-1)/n of X inside the node, (n-m)/n across; seconds = intra "
    "bytes / intra-node bandwidth + inter bytes / inter-node bandwidth (per device), "
    "summed over collectives: no overlap with each other or with compute, no latency term",
)


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
    tp = layout.tensor_parallel_size()
    shard = layout.shard_size()
    divided = " / ".join(f"{d.name}({d.size})" for d in layout.dims
                         if d.size > 1 and d.role in (Role.SHARD, Role.MODEL_PARALLEL))
    fullest, slowest = est.fullest, est.slowest
    line = est.pipeline
    whole = est.model.params
    grads_how = f"{bytes_of(est.dtype) if not mixed else 2} B per parameter"
    if fullest is not None and line is not None:
        lines += ["", f"memory per rank (the fullest {line.dim} rank: {line.dim} "
                  f"{fullest.coordinate}, {', '.join(fullest.stages)}):"]
        whole = fullest.params
        if fullest.accumulates:
            shards = " / ".join(f"{d.name}({d.size})" for d in layout.dims_with(Role.SHARD))
            grads_how = (f"{bytes_of(est.reduce_dtype)} B per parameter, not divided by "
                         f"{shards}: accumulated over the microbatches until the step's one "
                         "reduce-scatter")
    else:
        lines += ["", "memory per rank:"]
        if shard > 1 and work.grad_accum > 1 and work.sync == "last":
            shards = " / ".join(f"{d.name}({d.size})" for d in layout.dims_with(Role.SHARD))
            grads_how = (f"{bytes_of(est.reduce_dtype)} B per parameter, not divided by "
                         f"{shards}: kept unsharded between the {work.grad_accum} "
                         "micro-batches until the step's one reduce-scatter (sync 'last')")
    pb = 2 if mixed else bytes_of(est.dtype)
    ob = optimizer_bytes(work.optimizer, mixed)
    of_what = "params of its stage(s)" if fullest is not None else "params"
    rows: list[tuple[str, ...]] = [
        ("parameters", format_bytes(mem.params),
         f"{format_count(mem.local_params)} of {format_count(whole)} {of_what} here"
         + (f" (divided by {divided})" if divided else "") + f", {pb} B each"),
        ("gradients", format_bytes(mem.grads), grads_how),
        ("optimizer states", format_bytes(mem.optimizer),
         f"{work.optimizer}: {ob} B per parameter"),
        ("activations", format_bytes(mem.activations),
         "AC " + ", ".join(f"{m}: {format_bytes(v)}" for m, v in mem.activations_by_mode.items())),
        ("communication buffers", format_bytes(mem.comm_buffers),
         ("the stage(s)' parameters, gathered after backward until the step ends"
          if fullest is not None and fullest.accumulates else "unsharded groups in flight")
         if shard > 1 else ("activation buffers" if tp > 1 else "")),
    ]
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
                         format_bytes(t.inter_bytes), format_seconds(t.seconds)))
        rows.append(("total", "", "", "", format_bytes(est.payload),
                     format_bytes(sum(t.intra_bytes for t in est.traffic)),
                     format_bytes(est.inter_bytes), format_seconds(est.seconds)))
        lines.append(table(
            rows, ("MESH DIM", "ROLE", "WHERE", "COLLECTIVES", "PAYLOAD", "INTRA-NODE",
                   "INTER-NODE", "TIME"), right=(4, 5, 6, 7), indent="  "))
    else:
        lines.append("  none (a single rank, or no mesh dim of size > 1)")
    assumed = set(est.bandwidth_assumed)
    lines.append(f"  bandwidth per device: intra-node {est.intra_node_gbps:g} Gbit/s"
                 + (" (assumed)" if "intra_node" in assumed else "")
                 + f", inter-node {est.inter_node_gbps:g} Gbit/s"
                 + (" (assumed)" if "inter_node" in assumed else ""))
    if est.experts is not None:
        lines += ["", *format_experts(est)]
    if est.accumulation:
        lines += ["", *format_accumulation(est)]
    if line is not None:
        lines += ["", *format_pipeline(est)]
    lines += ["", "accounting:"] + [f"  - {a}" for a in ACCOUNTING]
    if line is not None:
        lines += [f"  - {a}" for a in PIPELINE_ACCOUNTING]
    if est.experts is not None:
        lines += [f"  - {a}" for a in EXPERTS_ACCOUNTING]
    if est.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in est.notes]
    return "\n".join(lines)


EXPERTS_ACCOUNTING: tuple[str, ...] = (
    "expert parallelism: each ep rank holds num_experts / ep experts of every MoE block, "
    "sharded by the data-parallel plugin over its dims without ep (the dense parameters "
    "over them and ep); per MoE block and micro-batch of T tokens a rank routes T*top_k "
    "pairs of hidden*dtype bytes: all-to-all inputs dispatch forward and combine backward "
    "its own pairs, combine forward and dispatch backward the pairs its experts receive "
    "(as many under uniform routing), and num_experts int64 counts before each dispatch; "
    "checkpointing (full or selective) runs the counts, dispatch and combine again",
)


PIPELINE_ACCOUNTING: tuple[str, ...] = (
    "pipeline: each rank's memory and communication are its own stages' (the tables above "
    "show the fullest and the slowest rank); activations: one microbatch's per stage (its "
    "blocks, the logits on the last), times the microbatches of each stage the rank holds "
    "at its heaviest moment of the schedule's timeline (+ one block recomputed under full "
    "AC); under FSDP the stage keeps its gradients unsharded in the reduce dtype and its "
    "parameters gathered after backward until the step's one reduce-scatter; "
    "point-to-point: seq*micro-batch*hidden activations forward and as many gradient bytes "
    "backward per microbatch and stage boundary between ranks (none between two stages of "
    "one rank), each over the network when the peer is on another node; the bubble idles "
    "each rank and is not in the communication time",
)


def format_experts(est: Estimate) -> list[str]:
    """The expert-parallel section: the experts a rank holds, its parameters (dense and
    experts), and the all-to-alls per step, per MoE block and by where their bytes go."""
    ex = est.experts
    assert ex is not None and est.model.moe is not None
    moe = est.model.moe
    shards = " / ".join(f"{d.name}({d.size})" for d in est.layout.dims
                        if d.role is Role.SHARD and d.size > 1)
    further = (f", each sharded over {ex.experts_shard} rank(s) by {shards} (not {ex.dim})"
               if ex.experts_shard > 1 else "")
    lines = [f"expert parallelism over {ex.dim}({ex.size}): {ex.experts_per_rank} of "
             f"{moe.num_experts} experts per rank in each of {moe.moe_layers} MoE "
             f"block(s){further}",
             f"  parameters per rank: {format_count(ex.dense_params)} dense + "
             f"{format_count(ex.experts_params)} experts = "
             f"{format_count(ex.dense_params + ex.experts_params)} (of "
             f"{format_count(est.model.params)}); {format_count(ex.active_params)} active "
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
