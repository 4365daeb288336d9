"""A TP plan resolved against one model: which module takes which style (patterns
expanded in plan order, the styles' defaults filled in), and every model-aware finding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import Finding

from .auto import auto_plan
from .findings import (
    fit_finding,
    fit_findings,
    head_findings,
    rest_findings,
    tie_findings,
)
from .patterns import generalize, matches, modules_by_name, names_near
from .plan_map import PlanMap
from .styles import EMBEDDING_STYLES, PARAM_STYLES, StyleSpec

if TYPE_CHECKING:
    import torch.nn as nn

    from . import TP


@attrs.define
class Resolution:
    """A TP plan resolved against one model: what apply will do, and what is wrong."""

    entries: list[tuple[str, Any, StyleSpec]]  # (module path, module, spec) in model order
    findings: list[Finding]
    source: str  # "explicit plan", "Hugging Face tp plan", "Llama names", ...
    rest: list[tuple[str, Any]]  # modules owning parameters that no style makes DTensors


def resolve(tp: TP, model: nn.Module, tp_size: int) -> Resolution:
    modules = modules_by_name(model)
    findings: list[Finding] = []
    if isinstance(tp.plan, PlanMap):
        parsed, _ = tp.entries()  # unparsable entries are CP212/CP213, static findings
        source = "explicit plan"
        for pattern, _ in parsed:
            if pattern in modules or any(matches(pattern, n) for n in modules if n):
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
        parsed, source, problem = auto_plan(model, modules, tp.sequence_parallel,
                                            tp.loss_parallel)
        if problem:
            findings.append(Finding("CP408", problem, fix=(
                "give TP(plan={...}) explicitly: module-path patterns mapped to styles "
                "(docs/tp.md)")))
    # Expand: each module takes the first entry that matches it (plan order).
    chosen: dict[str, tuple[str, StyleSpec]] = {}
    for pattern, spec in parsed:
        for name in modules:
            if (name == pattern or (name and matches(pattern, name))):
                if name in chosen and chosen[name][1] != spec:
                    findings.append(fit_finding(
                        f"module {name} is matched by plan[{chosen[name][0]!r}] "
                        f"({chosen[name][1].style}) and plan[{pattern!r}] ({spec.style})",
                        "make the patterns disjoint: one style per module"))
                    continue
                chosen.setdefault(name, (pattern, spec))
    entries = []
    for name in modules:
        if name in chosen:
            pattern, spec = chosen[name]
            spec = _defaults(spec, tp.sequence_parallel, tp.loss_parallel)
            entries.append((name, modules[name], spec))
    findings += fit_findings(entries, tp_size)
    findings += head_findings(model, modules, entries, tp_size)
    rest = leftover(modules, entries)
    if tp.replicate_rest:
        findings += rest_findings(modules, rest)
    findings += tie_findings(modules, entries)
    return Resolution(entries, findings, source, rest)


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
    return spec


def leftover(modules: Mapping[str, Any], entries: list[tuple[str, Any, StyleSpec]]) -> list[
    tuple[str, Any]
]:
    """Modules that own parameters that no style turns into DTensors, in model order."""
    covered = {path for path, _, spec in entries if spec.style in PARAM_STYLES}
    out = []
    for name, module in modules.items():
        if name in covered or any(name.startswith(c + ".") for c in covered if c):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            out.append((name, module))
    return out
