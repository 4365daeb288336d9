"""What can be wrong with a CP plan: the rule catalog (:data:`RULES`), the static checks
(CP821, CP825) and the model-aware ones (CP822, CP823, CP824, CP826, CP827)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_par.plugin import Finding, Rule, Severity, carries

if TYPE_CHECKING:
    from composer_par.plugin import MeshSpec, Topology

    from .drivable import Drivable

_CP_PLAN = '[mesh]\ncp = 2\n\n[[plugins]]\nname = "cp"\n'

RULES = (
    Rule("CP821", Severity.ERROR, "the sequence length is not divisible by 2 * cp",
         "use a sequence length that 2 * cp divides (each rank holds two equal chunks), or "
         "a cp size that fits it",
         _CP_PLAN + "seq_len = 4098\n"),
    Rule("CP822", Severity.ERROR, "alltoall mode needs head counts divisible by cp",
         "use mode = \"allgather\" (any head count), or a cp size that divides the head "
         "and K/V-head counts (after tensor parallelism)",
         "ParallelPlan(MeshSpec(cp=4)).use(CP(mode=\"alltoall\")).use(MetaInit())"
         ".validate(llama_with_2_heads)"),
    Rule("CP823", Severity.ERROR, "CP cannot drive a module's attention",
         "build the model with attn_implementation=\"sdpa\" (Hugging Face) or the project's "
         "Llama, or leave cp out of the plan",
         "ParallelPlan(MeshSpec(cp=2)).use(CP()).use(MetaInit())"
         ".validate(hf_llama_with_eager_attention)"),
    Rule("CP824", Severity.ERROR, "the model attends to more than its own causal sequence",
         "use a decoder-only model with causal self-attention, or leave cp out of the plan",
         "ParallelPlan(MeshSpec(cp=2)).use(CP()).use(MetaInit()).validate(t5)"),
    Rule("CP825", Severity.WARNING, "cp crosses nodes",
         "put cp inside a node (list it after the dims that cross nodes in [mesh]), or "
         "accept the inter-node K/V traffic the message gives",
         '[mesh]\ncp = 8\n\n[topology]\nnodes = 2\ndevices_per_node = 4\n\n'
         '[[plugins]]\nname = "cp"\n'),
    Rule("CP826", Severity.ERROR, "ring mode needs CUDA devices",
         "run the plan on CUDA devices, or use mode = \"allgather\" or \"alltoall\" (any "
         "device)",
         "ParallelPlan(MeshSpec(cp=2)).use(CP(mode=\"ring\")).use(MetaInit())"
         ".apply(model)  # on ranks with no CUDA device (gloo on CPU)"),
    Rule("CP827", Severity.ERROR, "transformers would make the router loss of each cp "
         "rank's part of the sequences",
         "set config.output_router_logits = False and call "
         "composer_par.models.hf_router_loss.add_router_loss(model) before apply: "
         "plan.training_step then adds the router loss of whole sequences",
         "ParallelPlan(MeshSpec(cp=2)).use(CP()).use(MetaInit())"
         ".validate(mixtral_with_output_router_logits)"),
)


def sequence_findings(seq_len: int | None, size: int) -> list[Finding]:
    """CP821: each rank holds two equal chunks of every sequence."""
    if seq_len is None or size < 1 or seq_len % (2 * size) == 0:
        return []
    return [Finding(
        "CP821", f"seq_len={seq_len} cannot be cut into 2 * cp = {2 * size} equal chunks "
        f"(rank r holds chunks r and {2 * size - 1} - r)",
        fix=f"use a sequence length that {2 * size} divides (e.g. "
        f"{(seq_len // (2 * size) + 1) * 2 * size}), or a cp size that fits it")]


def router_loss_findings(model: object) -> list[Finding]:
    """CP827: a Hugging Face MoE model set to add its router loss itself
    (``config.output_router_logits``) pools the routing of the tokens it sees, which under
    CP is this rank's part of every sequence: a load-balancing loss of parts, not of the
    sequences, and nothing says so. ``add_router_loss`` totals the routing over cp."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or carries(model):
        return []
    return [Finding(
        "CP827", f"{type(model).__name__} has config.output_router_logits = True: "
        "transformers pools the routing of the tokens each rank holds, so under cp its "
        "router loss is that of each rank's part of the sequences, not of the sequences",
        fix="set config.output_router_logits = False and call "
        "composer_par.models.hf_router_loss.add_router_loss(model) before apply, then "
        "train with plan.training_step: it adds the router loss, totalled over cp")]


def kv_bytes_per_layer(kv_width: int | None, seq_len: int | None, size: int,
                       dtype_bytes: int = 4) -> int | None:
    """The bytes one rank receives in one layer's K/V all-gather for one sequence: K and
    V of the ``size - 1`` other ranks' tokens."""
    if kv_width is None or seq_len is None:
        return None
    return 2 * kv_width * dtype_bytes * seq_len * (size - 1) // size


def node_findings(dim: str, mesh: MeshSpec, topology: Topology | None, mode: str,
                  seq_len: int | None = None) -> list[Finding]:
    """CP825: a cp group spanning nodes moves every layer's K/V over the slow links."""
    if topology is None or dim not in mesh or mesh.size(dim) < 2 or not mesh.is_resolved:
        return []
    if mesh.world_size != topology.world_size or not topology.crosses_nodes(mesh, dim):
        return []
    size = mesh.size(dim)
    tokens = (f"{seq_len * (size - 1) // size} tokens" if seq_len
              else "sequence * (cp - 1) / cp tokens")
    what = (f"the K and V of {tokens} (2 x K/V width values per token, "
            f"{kv_bytes_per_layer(1, seq_len, size)} bytes per unit of K/V width in fp32)"
            if seq_len else f"the K and V of {tokens} (2 x K/V width values per token)")
    if mode == "alltoall":
        what = "its queries, keys, values and outputs (four all-to-alls)"
    return [Finding(
        "CP825", f"{dim}({size}) spans nodes ({topology.devices_per_node} devices per node): "
        f"in {mode} each rank receives, per layer and sequence, {what} over the links "
        "between nodes, in forward and again in backward",
        fix=f"list {dim} after the dims that cross nodes in [mesh] so that its ranks share "
        "a node, or shrink it to the devices per node")]


def head_findings(found: Drivable, size: int, tp_size: int) -> list[Finding]:
    """CP822: Ulysses hands each rank heads / cp whole heads of every tensor it trades."""
    out = []
    for label, count in (("attention head", found.heads), ("K/V-head", found.kv_heads)):
        if not count or count % tp_size:
            continue
        local = count // tp_size
        if local % size:
            where = f" ({count} / tp({tp_size}) = {local} per tp rank)" if tp_size > 1 else ""
            out.append(Finding(
                "CP822", f"mode = \"alltoall\" needs the {label} count divisible by "
                f"cp({size}); the model has {count}{where}",
                fix="use mode = \"allgather\", or a cp size that divides "
                f"{local}"))
            break
    return out


def drive_findings(found: Drivable) -> list[Finding]:
    """CP823 (no seam to drive) and CP824 (not causal self-attention), naming the
    module."""
    out = []
    for path, why in found.refused:
        code = "CP824" if ("causal" in why or "encoder" in why) else "CP823"
        out.append(Finding(code, f"{path or 'the model'}: {why}", fix=(
            "use a decoder-only model with causal self-attention, or leave cp out"
            if code == "CP824" else
            "build the model with attn_implementation=\"sdpa\", or leave cp out")))
    if found.kind == "none" and not found.refused:
        out.append(Finding("CP823", "no attention CP can drive was found in the model",
                           fix="use the project's Llama or a Hugging Face decoder with "
                           "attn_implementation=\"sdpa\", or leave cp out"))
    return out


def ring_findings(found: Drivable, cuda: bool | None) -> list[Finding]:
    """``ring`` mode: torch's ring masks causally only (CP823 for sliding-window layers),
    and its kernels are CUDA's (CP826; ``cuda`` is None where the plan is validated away
    from the ranks that run it, which may have the devices this machine lacks)."""
    out = []
    if found.sliding_window:
        out.append(Finding(
            "CP823", "mode = \"ring\" cannot drive the model's sliding-window attention "
            "layers: torch's ring attention masks causally and nothing else",
            fix="use mode = \"allgather\" (sliding windows are masked by global position)"))
    if cuda is False:
        out.append(Finding(
            "CP826", "mode = \"ring\" runs torch's ring attention, whose kernels (flash, "
            "memory-efficient, cuDNN SDPA) are CUDA's, and this rank has no CUDA device",
            fix="run the plan on CUDA devices, or use mode = \"allgather\" (exact, any "
            "device)"))
    return out


__all__ = ["RULES", "drive_findings", "head_findings", "kv_bytes_per_layer", "node_findings",
           "ring_findings", "sequence_findings"]
