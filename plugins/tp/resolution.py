"""A TP plan resolved against one model: which module (or parameter) takes which style
(patterns expanded in plan order, the styles' defaults filled in), the tied parameters
to keep tied, and every model-aware finding."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import Finding

from .auto import (
    HF_FORWARD_SOURCES,
    HF_SOURCE,
    NAME_SOURCES,
    OUTPUT_NAMES,
    Fallback,
    auto_plan,
    with_rope_dim,
)
from .findings import (
    fallback_findings,
    fit_finding,
    fit_findings,
    head_findings,
    latent_findings,
    parameter_findings,
    refused_style_findings,
    rest_findings,
    sharded_neighbour_findings,
    tie_findings,
)
from .heads import LocalHeads, local_head_counts
from .patterns import generalize, matches, modules_by_name, names_near, parameters_by_name
from .plan_map import PlanMap
from .regions import shared_input_regions
from .sequence import hf_sequence_parallel
from .styles import (
    EMBEDDING_STYLES,
    LOCAL_FORWARD_STYLES,
    PACKED_STYLES,
    PARAM_STYLES,
    SHARDED_OUTPUT_STYLES,
    StyleSpec,
)

if TYPE_CHECKING:
    import torch.nn as nn

    from . import TP

Entry = tuple[str, Any, StyleSpec]  # (module path, module, spec)
ParamEntry = tuple[str, Any, str, StyleSpec]  # (parameter path, owner, attribute, spec)


@attrs.define
class Resolution:
    """A TP plan resolved against one model: what apply will do, and what is wrong."""

    entries: list[Entry]  # module entries in model order
    findings: list[Finding]
    source: str  # "explicit plan", "Hugging Face tp plan", "Llama names", ...
    rest: list[tuple[str, Any]]  # modules owning parameters that no style makes DTensors
    params: list[ParamEntry] = attrs.Factory(list)  # parameter entries (MoE expert weights)
    # Tied parameters every owner splits the same way: one parameter again after apply.
    ties: list[list[tuple[Any, str]]] = attrs.Factory(list)
    fallbacks: tuple[Fallback, ...] = ()
    # Head-count attributes set to their rank's count after apply (the name fallback).
    local_heads: list[LocalHeads] = attrs.Factory(list)


def resolve(tp: TP, model: nn.Module, tp_size: int, *, starts: bool = True,
            ends: bool = True) -> Resolution:
    """``starts``/``ends``: whether ``model`` begins / ends the whole model (False for a
    pipeline stage after the first / before the last; see :func:`.auto.auto_plan`)."""
    modules = modules_by_name(model)
    parameters = parameters_by_name(modules)
    findings: list[Finding] = []
    fallbacks: tuple[Fallback, ...] = ()
    auto_refused = False  # the auto plan is refused already (CP408): one reason is enough
    if isinstance(tp.plan, PlanMap):
        parsed, _ = tp.entries()  # unparsable entries are CP212/CP213, static findings
        source = "explicit plan"
        for pattern, _ in parsed:
            if pattern in modules or any(matches(pattern, n) for n in modules if n) or any(
                    matches(pattern, n) for n in parameters):
                continue
            near = list(dict.fromkeys(generalize(n) for n in names_near(model, modules, pattern)))
            findings.append(Finding(
                "CP408",
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}"
                + (f"; nearest module names: {', '.join(near)}" if near else ""),
                fix="patterns match module paths component by component ('*' is one "
                "component, e.g. 'layers.*.attention.wq'); print [n for n, _ in "
                "model.named_modules()] to see them",
            ))
    else:
        auto = auto_plan(model, modules, parameters, tp.sequence_parallel, tp.loss_parallel,
                         starts=starts, ends=ends)
        parsed, source, fallbacks = auto.entries, auto.source, auto.fallbacks
        auto_refused = auto.problem is not None
        if auto.problem:
            findings.append(Finding("CP408", auto.problem, fix=(
                "give TP(plan={...}) explicitly: module-path patterns mapped to styles "
                "(docs/tp.md)")))
        findings += fallback_findings(fallbacks, source)
        findings += refused_style_findings(auto.refused)
    parsed = [(pattern, with_rope_dim(spec, model)) for pattern, spec in parsed]
    # Expand: each module (parameter) takes the first entry that matches it (plan order).
    chosen: dict[str, tuple[str, StyleSpec]] = {}
    chosen_params: dict[str, tuple[str, StyleSpec]] = {}
    for pattern, spec in parsed:
        for table, names in ((chosen, modules), (chosen_params, parameters)):
            for name in names:
                if not (name == pattern or (name and matches(pattern, name))):
                    continue
                if name in table and table[name][1] != spec:
                    findings.append(fit_finding(
                        f"{'module' if table is chosen else 'parameter'} {name} is matched by "
                        f"plan[{table[name][0]!r}] ({table[name][1].style}) and "
                        f"plan[{pattern!r}] ({spec.style})",
                        "make the patterns disjoint: one style per module"))
                    continue
                table.setdefault(name, (pattern, spec))
    specs = {name: chosen[name][1] for name in modules if name in chosen}
    if source in HF_FORWARD_SOURCES and tp.sequence_parallel and specs and not auto_refused:
        specs, problem = hf_sequence_parallel(specs, modules, starts=starts, ends=ends,
                                              plan=HF_FORWARD_SOURCES[source])
        if problem:
            findings.append(Finding("CP408", problem, fix=(
                "set sequence_parallel = false, or give TP(plan={...}) explicitly with the "
                "norms mapped to \"sequence_parallel\" (docs/tp.md)")))
    if source != "explicit plan" and not tp.sequence_parallel:
        # Column-parallel layers on one replicated input: their gradients summed once.
        specs = shared_input_regions(specs, modules)
    # Loss parallel keeps the output head's logits sharded: the gathered projections at
    # the top of the model (Phi-3 gathers its fused qkv_proj inside attention too).
    gathered = [n for n in modules if n in specs and specs[n].style == "colwise_gather"]
    heads = {n for n in gathered if "." not in n or n.rsplit(".", 1)[-1] in OUTPUT_NAMES}
    heads = heads or set(gathered)
    entries: list[Entry] = [
        (name, modules[name], _defaults(specs[name], tp.sequence_parallel,
                                        tp.loss_parallel and name in heads))
        for name in modules if name in specs]
    params: list[ParamEntry] = [
        (name, *parameters[name], _defaults(chosen_params[name][1], False, False))
        for name in parameters if name in chosen_params]
    rest = leftover(modules, entries, params)
    entries, rest, neighbours = _sharded_neighbours(entries, rest,
                                                    own_plan=source == HF_SOURCE)
    position = {name: i for i, name in enumerate(modules)}
    entries.sort(key=lambda e: position[e[0]])
    findings += sharded_neighbour_findings(neighbours)
    findings += fit_findings(entries, tp_size)
    findings += latent_findings(entries)
    findings += parameter_findings(params, entries, tp_size)
    findings += head_findings(model, modules, entries, tp_size, params)
    local_heads: list[LocalHeads] = []
    if source in NAME_SOURCES:
        # A model's own tp plan comes with a forward written for it; recognized names
        # say nothing about how the attention reshapes its heads.
        local_heads, refused = local_head_counts(modules, entries, tp_size)
        findings += refused
    if tp.replicate_rest:
        findings += rest_findings(modules, rest, entries)
    tied, ties = tie_findings(model, entries, params, rest, tp.replicate_rest)
    findings += tied
    return Resolution(entries, findings, source, rest, params, ties, fallbacks, local_heads)


def _defaults(spec: StyleSpec, sequence_parallel: bool, loss_parallel: bool) -> StyleSpec:
    """The style's layouts where the entry gave none; sequence/loss parallel change them."""
    seq = "shard(1)"
    if spec.style in ("colwise", "colwise_gather"):
        out = "replicate" if spec.style == "colwise_gather" else "shard(-1)"
        local = True
        if spec.style == "colwise_gather" and loss_parallel:
            out, local = "shard(-1)", False
        return spec.with_defaults(input_layouts=(seq if sequence_parallel else "replicate",),
                                  output_layouts=(out,), use_local_output=local)
    if spec.style == "rowwise":
        return spec.with_defaults(input_layouts=("shard(-1)",),
                                  output_layouts=(seq if sequence_parallel else "replicate",),
                                  use_local_output=True)
    if spec.style in EMBEDDING_STYLES:
        return spec.with_defaults(input_layouts=("replicate",),
                                  output_layouts=(seq if sequence_parallel else "replicate",),
                                  use_local_output=True)
    if spec.style == "sequence_parallel":
        return spec.with_defaults(sequence_dim=1, use_local_output=False)
    if spec.style == "prepare_input":
        return spec.with_defaults(use_local_output=False)
    if spec.style == "prepare_output":
        return spec.with_defaults(use_local_output=True)
    if spec.style in PACKED_STYLES:
        return spec.with_defaults(split_factor=2)
    return spec


def leftover(modules: Mapping[str, Any], entries: list[Entry],
             params: list[ParamEntry] | None = None) -> list[tuple[str, Any]]:
    """Modules that own parameters that no style turns into DTensors, in model order."""
    covered = {path for path, _, spec in entries
               if spec.style in PARAM_STYLES or spec.style in LOCAL_FORWARD_STYLES}
    split = defaultdict(set)
    for _, owner, attr, _ in params or ():
        split[id(owner)].add(attr)
    out = []
    for name, module in modules.items():
        if name in covered or any(name.startswith(c + ".") for c in covered if c):
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and not set(own) <= split[id(module)]:
            out.append((name, module))
    return out


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _vectors(module: Any) -> bool:
    """Whether ``module``'s own parameters are norm-like: vectors of scales and shifts (or
    an activation's scalars), not a projection's matrix."""
    return all(p.ndim <= 1 for p in module.parameters(recurse=False))


def _sharded_neighbours(entries: list[Entry], rest: list[tuple[str, Any]], *,
                        own_plan: bool) -> tuple[
    list[Entry], list[tuple[str, Any]], list[tuple[str, Any]]
]:
    """Norm-like modules no entry names that sit beside column-split projections in the
    same parent (Qwen3's q_norm beside q_proj, Apertus's XIELU activation between its MLP's
    up_proj and down_proj): they run on their rank's part of a sharded activation, so their
    inputs are not the same on every tp rank and their gradients must be summed over tp
    ('replicate_grad_allreduce'). Every other module left over is replicated with its
    inputs declared identical.

    ``own_plan``: the plan is the model's own Hugging Face tp plan, whose forward may run a
    norm it leaves out on a projection it leaves whole (DeepSeek's q_a_layernorm, on the
    output of q_a_proj): there a module is moved only where its parent leaves no
    projection whole."""
    # A latent attention's norms run on its replicated latent (the output of its
    # mla_kv_a_proj), not on the split heads beside them.
    latent = {_parent(path) for path, _, spec in entries if spec.style == "mla_kv_a_proj"}
    parents = {_parent(path) for path, _, spec in entries
               if spec.style in SHARDED_OUTPUT_STYLES} - latent
    if own_plan:
        parents -= {_parent(name) for name, module in rest if not _vectors(module)}
    moved, kept = [], []
    for name, module in rest:
        children = any(True for n, m in module.named_modules() if n and any(
            True for _ in m.parameters(recurse=False)))
        # Norm-like only: a Linear left out beside the split projections (a gate) takes
        # the replicated input.
        if name and _parent(name) in parents and not children and _vectors(module):
            moved.append((name, module))
        else:
            kept.append((name, module))
    if not moved:
        return entries, rest, []
    added = [(n, m, StyleSpec("replicate_grad_allreduce")) for n, m in moved]
    return [*entries, *added], kept, moved
