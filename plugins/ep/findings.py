"""EP's rule catalog (CP801-CP819) and the model-aware checks. No torch import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_par.plugin import Finding, Rule, Severity

if TYPE_CHECKING:
    from composer_par.plugin import MeshSpec, Topology

    from .discovery import ExpertsSite

RULES = (
    Rule("CP801", Severity.ERROR, "the experts do not divide among the ep ranks",
         "make the ep size a divisor of the number of experts (each ep rank holds "
         "num_experts / ep whole experts)",
         "ParallelPlan(MeshSpec(ep=4)).use(EP()).use(MetaInit())"
         ".validate(moe_llama_with_6_experts, world_size=4)"),
    Rule("CP802", Severity.ERROR, "EP finds no experts module in the model",
         "use EP with a mixture-of-experts model whose experts are fused as [num_experts, "
         "...] parameters and whose experts forward takes (hidden_states, top_k_index, "
         "top_k_weights), as transformers 5.x and composer_par.models.moe_llama do",
         "ParallelPlan(MeshSpec(ep=2)).use(EP()).use(MetaInit()).validate(dense_llama)"),
    Rule("CP803", Severity.WARNING, "the ep mesh dim crosses nodes",
         "list ep after the dims that cross nodes, with a size <= devices_per_node: every "
         "MoE block's token all-to-all is the most bandwidth-hungry collective of a step",
         "ParallelPlan(MeshSpec(ep=4), topology=Topology(nodes=2, devices_per_node=2))"
         ".use(EP()).use(MetaInit()).validate(moe_llama)"),
    Rule("CP804", Severity.INFO, "a capacity factor drops routed tokens",
         "leave capacity_factor unset for dropless expert parallelism (training as one "
         "process does), or keep it to bound each expert's work",
         "[mesh]\nep = 2\n\n[[plugins]]\nname = \"ep\"\ncapacity_factor = 1.25\n\n"
         "[[plugins]]\nname = \"meta_init\"\n"),
    Rule("CP805", Severity.ERROR, "the experts' intermediate size does not divide among "
         "the expert-tp ranks",
         "make the expert_tp mesh dim's size a divisor of each expert's intermediate size "
         "(expert tensor parallelism splits it), or leave expert_tp unset (whole experts "
         "on every tp rank)",
         "ParallelPlan(MeshSpec(ep=2, tp=2)).use(EP(expert_tp=True)).use(TP()).use(MetaInit())"
         ".validate(moe_llama_with_expert_hidden_33, world_size=4)"),
    Rule("CP806", Severity.ERROR, "expert tensor parallelism cannot split the experts",
         "give expert_tp a mesh dim the mesh has (the tp dim); expert tensor parallelism "
         "splits experts whose parameters it knows by name (w1/w3/w2, gate_up_proj/"
         "up_proj/down_proj and their _bias): for others leave expert_tp unset",
         "ParallelPlan(MeshSpec(ep=2)).use(EP(expert_tp=True)).use(MetaInit())"
         ".validate(moe_llama, world_size=2)"),
)

#: Logical all-to-all passes per routed (token, slot) pair and MoE block in a training
#: step: dispatch and combine in forward, their transposes in backward.
PASSES = 4


def divisibility_findings(sites: list[ExpertsSite], ep: int, dim: str) -> list[Finding]:
    """CP801 for each experts module whose expert count ``ep`` does not divide."""
    found = []
    for site in sites:
        if site.num_experts % ep:
            near = [d for d in range(1, site.num_experts + 1) if site.num_experts % d == 0]
            found.append(Finding(
                "CP801", f"{site.path} holds {site.num_experts} experts, which "
                f"{dim}({ep}) does not divide: each ep rank must hold whole experts",
                fix=f"make {dim} one of {near}"))
    return found


def no_experts_finding(model_name: str, dim: str, plan_entries: list[str]) -> Finding:
    """CP802: nothing to distribute over ``dim``."""
    named = (f"; its _ep_plan names {', '.join(plan_entries[:3])}, whose modules are not "
             "fused experts taking (hidden_states, top_k_index, top_k_weights)"
             if plan_entries else "")
    return Finding(
        "CP802", f"{model_name} has no experts module for EP to distribute over {dim}"
        f"{named}",
        fix="use EP with a mixture-of-experts model (experts fused as [num_experts, ...] "
        "parameters, as transformers 5.x and composer_par.models.moe_llama store them), or "
        f"remove EP and the {dim} mesh dim")


def crossing_finding(mesh: MeshSpec, topology: Topology, dim: str,
                     sites: list[ExpertsSite]) -> Finding | None:
    """CP803 when ``dim`` spans nodes: the bytes each routed token slot moves per step."""
    if not mesh.is_resolved or mesh.world_size != topology.world_size:
        return None
    if not topology.crosses_nodes(mesh, dim):
        return None
    ep = mesh.size(dim)
    hidden = max((s.hidden for s in sites), default=0)
    dtype_bytes = max((s.element_bytes for s in sites), default=4)
    per_pair = PASSES * hidden * dtype_bytes * len(sites) * (ep - 1) / ep
    return Finding(
        "CP803", f"mesh dim {dim}({ep}) spans {topology.nodes_spanned(mesh, dim)} nodes on "
        f"{topology.describe()}: each routed (token, slot) pair moves about "
        f"{per_pair:,.0f} bytes per step through all-to-all ({PASSES} passes x hidden "
        f"{hidden} x {dtype_bytes} bytes x {len(sites)} MoE block(s) x {ep - 1}/{ep} "
        "leaving the rank), much of it over the inter-node links",
        fix=f"list {dim} after the dims that cross nodes, with a size <= devices_per_node "
        f"({topology.devices_per_node})")


def capacity_finding(factor: float) -> Finding:
    """CP804: pairs beyond each expert's capacity are dropped."""
    return Finding(
        "CP804", f"capacity_factor={factor:g}: each rank sends each expert at most "
        f"ceil({factor:g} x routed pairs / num_experts) pairs and drops the rest, which add "
        "nothing to their tokens' output: training differs from one process whenever the "
        "routing is that uneven (routing_stats counts the drops)",
        fix="leave capacity_factor unset for dropless expert parallelism, or keep it to "
        "bound each expert's work")


def expert_tp_findings(sites: list[ExpertsSite], mesh: MeshSpec, dim: str) -> list[Finding]:
    """CP806 when the mesh lacks ``dim`` or a site's parameters are not ones expert
    tensor parallelism knows; CP805 when ``dim``'s size does not divide a site's
    intermediate size."""
    from .expert_tp import expert_splits, intermediate_size

    if dim not in mesh:
        return [Finding(
            "CP806", f"expert_tp names mesh dim {dim!r}, which the mesh "
            f"({', '.join(mesh.names) or 'empty'}) lacks: nothing to split the experts over",
            fix=f"add {dim} to the mesh (the tp dim TP claims), or leave expert_tp unset")]
    size = mesh.size(dim)
    found = []
    for site in sites:
        splits = expert_splits(site)
        width = intermediate_size(site, splits) if splits is not None else None
        if splits is None or width is None:
            found.append(Finding(
                "CP806", f"{site.path} ({type(site.module).__name__}) holds "
                f"{', '.join(site.names)}: expert tensor parallelism knows which to split "
                "column-wise and which row-wise only for w1/w3/w2 and gate_up_proj/up_proj/"
                "down_proj (and their _bias)",
                fix="leave expert_tp unset: each ep rank's experts then stay whole on every "
                f"{dim} rank"))
        elif size > 0 and width % size:
            near = [d for d in range(1, width + 1) if width % d == 0 and d <= 64]
            found.append(Finding(
                "CP805", f"{site.path}'s experts have intermediate size {width}, which "
                f"{dim}({size}) does not divide: expert tensor parallelism gives each {dim} "
                "rank an equal part of every expert",
                fix=f"make {dim} one of {near}, or leave expert_tp unset"))
    return found
