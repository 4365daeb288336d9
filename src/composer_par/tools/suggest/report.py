"""The best layout as a plan file, checked by the plan's own static validation, and the
suggestion as text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from composer_par.estimate import Estimate, format_bytes, format_seconds
from composer_par.tables import table
from composer_par.tools.suggest.space import Candidate
from composer_par.topology import Topology

if TYPE_CHECKING:
    from composer_par.findings import Report
    from composer_par.tools.suggest.ranking import Suggestion


def plan_file(candidate: Candidate, topology: Topology, est: Estimate | None = None, *,
              seq: int | None = None, micro_batch: int | None = None) -> str:
    """The candidate as a plan file (TOML), with the estimate as comments."""
    from composer_par.planfile import toml_key, toml_value

    lines = [f"# suggested by composer-par suggest: {candidate.label()}"]
    if est is not None:
        step = est.step
        lines.append(f"# per rank: {format_bytes(est.memory.total)}; step "
                     f"{format_seconds(step.seconds)}, "
                     f"{step.tokens_per_second_per_device:,.0f} tokens/s per device, MFU "
                     f"{step.mfu:.1%}"
                     + (f" (seq {seq}, micro-batch {micro_batch}" if seq else "")
                     + (f", {candidate.passes} per data shard and step)" if seq else ""))
    lines.append("[mesh]")
    lines += [f"{toml_key(n)} = {s}" for n, s in candidate.mesh().dims]
    lines += ["", "[topology]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in topology.to_dict().items()]
    for name, options in candidate.plugins():
        lines += ["", "[[plugins]]", f"name = {toml_value(name)}"]
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in options.items()]
    return "\n".join(lines) + "\n"


def validate(plan_toml: str, notes: list[str]) -> Report | None:
    """The plan file's static validation (None, with a note, when a plugin it names is
    not installed here)."""
    import tomllib

    from composer_par.plan import ParallelPlan
    from composer_par.planfile import PlanFileError
    from composer_par.plugin.registry import Registry

    names = [p["name"] for p in tomllib.loads(plan_toml).get("plugins", [])]
    missing = [n for n in names if n not in Registry().names()]
    if missing:
        notes.append(f"not installed here, so the plan file was not validated: "
                     f"{', '.join(missing)}")
        return None
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
             f"workload: seq {s.workload.seq}, micro-batch {s.workload.micro_batch}, "
             f"{s.workload.dtype}, {s.workload.optimizer}; every layout processes "
             f"{s.global_batch} sequences per step (each data shard its share in "
             "micro-batches: accumulated, or a pipeline's microbatches)",
             f"considered {len(s.ranked)} layouts, {sum(r.fits for r in s.ranked)} fit; "
             "ranked by predicted step time"
             + (f" ({s.layouts - len(s.ranked)} more not estimated: leaner choices of a "
                "layout than one that fits)" if s.layouts > len(s.ranked) else "")]
    if s.best is not None:
        lines += ["", paint("best plan:", "ok")] + [f"  {w}" for w in s.why]
        lines += ["", "```toml", s.plan_toml.rstrip("\n") if s.plan_toml else "", "```"]
        if s.report is not None and s.report.findings:
            lines += ["validation of this plan file:"] + [
                "  " + line for line in s.report.format().splitlines()]
    rows = []
    for index, r in enumerate(s.ranked[: top + 1]):
        est = r.estimate
        rows.append((str(index + 1), r.candidate.label(), format_bytes(est.memory.total),
                     "yes" if r.fits else "no", format_seconds(r.seconds),
                     f"{est.step.tokens_per_second_per_device:,.0f}", f"{est.step.mfu:.1%}",
                     format_seconds(est.seconds), format_bytes(est.inter_bytes),
                     r.reason or "best"))
    lines += ["", "candidates (best first):"]
    lines.append(table(
        rows, ("#", "LAYOUT", "MEMORY/RANK", "FITS", "STEP", "TOKENS/S/DEV", "MFU", "COMM",
               "INTER-NODE/RANK", "WHY NOT"), right=(0, 2, 4, 5, 6, 7, 8), indent="  "))
    if len(s.ranked) > top + 1:
        lines.append(f"  ... {len(s.ranked) - top - 1} more (--top N shows more; --json has all)")
    if s.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in s.notes]
    return "\n".join(lines)


__all__ = ["format_suggestion", "plan_file", "validate"]
