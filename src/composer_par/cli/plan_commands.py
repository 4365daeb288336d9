"""``validate``, ``explain``, ``plugins`` and ``rules``: the static commands.

They never import torch (``validate --model`` and ``explain --svg`` hand over to
:mod:`composer_par.cli.plan_tools`), so they answer in a fraction of a second.
"""

from __future__ import annotations

import argparse

from composer_par.cli import plan_tools
from composer_par.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    PROG,
    Output,
    load_plan_for,
    plan_arguments,
    situation,
)
from composer_par.tables import table


def validate_arguments(parser: argparse.ArgumentParser) -> None:
    plan_arguments(parser)
    plan_tools.validate_arguments(parser)


def run_validate(args: argparse.Namespace, out: Output) -> int:
    if getattr(args, "model", None):  # the dry run (imports torch)
        return plan_tools.run_validate_model(args, out)
    plan, world = load_plan_for(args)
    report = plan.validate(world_size=world)
    code = report.exit_code()
    topology = plan.effective_topology()
    data = {
        "plan": args.plan,
        "world_size": world,
        "mesh": plan.mesh.to_dict(),
        "topology": topology.to_dict() if topology else None,
        "exit_code": code,
        **report.to_dict(),
    }
    body = report.format()
    if not report.findings:
        body = out.paint(body, "ok")
    out.result(data, f"{args.plan}: {situation(plan, world)}\n{out.severities(body)}")
    if world is None:
        out.note("note: the world size is unknown (a mesh size is -1): "
                 "pass --world-size or --nodes/--devices-per-node to check the mesh equation")
    return code


def explain_arguments(parser: argparse.ArgumentParser) -> None:
    plan_arguments(parser)
    plan_tools.explain_arguments(parser)


def run_explain(args: argparse.Namespace, out: Output) -> int:
    from composer_par.plugin.caller import HookError

    plan, world = load_plan_for(args)
    report = plan.validate(world_size=world)
    try:
        explanation = plan.explain(world_size=world)
    except HookError:  # a plugin with a misspelled hook: the report says which (CP211)
        explanation = None
    code = report.exit_code()
    data = {
        "plan": args.plan,
        "world_size": world,
        "exit_code": code,
        "explanation": explanation.to_dict() if explanation else None,
        "report": report.to_dict(),
    }
    parts = [explanation.format()] if explanation else []
    if explanation is not None:
        picture, layout = plan_tools.layout_picture(
            explanation, out, getattr(args, "svg", None), args.plan)
        parts += [picture] if picture else []
        data.update(layout)
    if not report.ok:
        parts.append(f"the plan has {len(report.errors)} error(s):\n"
                     + out.severities(report.format()))
    elif report.findings:
        parts.append(f"{len(report.warnings)} warning(s): run `{PROG} validate` for details")
    out.result(data, "\n".join(parts))
    return code


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """``plugins`` and ``rules`` take only --json."""


def run_plugins(args: argparse.Namespace, out: Output) -> int:
    from composer_par.plugin.registry import Registry

    registry = Registry()
    rows = registry.describe()
    broken = [r for r in rows if "error" in r]
    data = {"plugins": rows, "blocked": sorted(registry.blocked)}
    cells = [
        (r["name"], r["version"] or "-", r["distribution"], ", ".join(r.get("dims", [])) or "-",
         ", ".join(r.get("stages", [])) or "-")
        for r in rows
    ]
    lines = [table(cells, ("NAME", "VERSION", "DISTRIBUTION", "CLAIMS", "STAGES"))
             if rows else "no plugins installed"]
    lines += [out.paint("ERROR", "ERROR") + f" {r['name']}: {r['error']}" for r in broken]
    if registry.blocked:
        lines.append(f"blocked by the environment: {', '.join(sorted(registry.blocked))}")
    out.result(data, "\n".join(lines))
    return EXIT_ERRORS if broken else EXIT_OK


def run_rules(args: argparse.Namespace, out: Output) -> int:
    from composer_par.rules import catalogs, listing, rule_conflicts, sources_text

    # Every installed plugin's catalog and the core's; a code two give different
    # meanings is an error of the installation (exit 1), listed under each meaning.
    entries = catalogs()
    rows = listing(entries)
    conflicts = rule_conflicts(entries)
    data = {
        "rules": [{**rule.to_dict(), "source": sources_text(sources), "sources": sources}
                  for rule, sources in rows],
        "conflicts": [{"code": code, "definitions": [{"source": source, **rule.to_dict()}
                                                     for source, rule in defined]}
                      for code, defined in conflicts.items()],
    }
    cells = [(r.code, r.severity.value, r.title, sources_text(sources)) for r, sources in rows]
    lines = [table(cells, ("CODE", "SEVERITY", "TITLE", "SOURCE"))]
    for code, defined in conflicts.items():
        meanings = "; ".join(f"{source}: {rule.title!r}" for source, rule in defined)
        lines.append(out.paint("ERROR", "ERROR") + f" {code} means different things to "
                     f"different catalogs ({meanings}); such plugins' authors should give "
                     "their codes distinct prefixes")
    out.result(data, "\n".join(lines))
    return EXIT_ERRORS if conflicts else EXIT_OK


__all__ = [
    "explain_arguments",
    "no_arguments",
    "run_explain",
    "run_plugins",
    "run_rules",
    "run_validate",
    "validate_arguments",
]
