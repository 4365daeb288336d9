"""Why the best layout has what it has, and why each runner-up lost to it; both from the
estimates alone, naming no plugin: a plugin's choice is explained against the layouts
without it (its dim of size 1, the plugin unused) or, on a first-fit axis, against its
faster choices of the same layout."""

from __future__ import annotations

from collections.abc import Sequence

from composer_par.estimate import Estimate, format_bytes, format_seconds
from composer_par.tools.suggest.ranking import Ranked, rank_key, seconds
from composer_par.tools.suggest.space import Pick


def largest_memory(est: Estimate) -> str:
    """The largest part of an estimate's memory, named."""
    mem = est.memory
    parts = {"parameters": mem.params, "gradients": mem.grads, "optimizer states": mem.optimizer,
             "activations": mem.activations, "communication buffers": mem.comm_buffers,
             "loss gradients": mem.loss_gradients, **mem.extra}
    name = max(parts, key=lambda k: parts[k])
    return f"{name} {format_bytes(parts[name])}"


def dominant(est: Estimate) -> str:
    """The mesh dim whose collectives take longest, and where they run."""
    if not est.traffic:
        return "no communication"
    t = max(est.traffic, key=lambda t: t.seconds)
    where = "across nodes" if t.dim.crosses_nodes else "inside a node"
    calls = ", ".join(k.replace("_", "-") + "s" for k in t.calls())
    return f"{t.dim.name}({t.dim.size}) {calls} {where}: {format_seconds(t.seconds)}"


def step_parts(r: Ranked) -> str:
    """A step time by its parts."""
    step = r.estimate.step
    parts = [f"{format_seconds(step.compute_seconds)} compute",
             f"{format_seconds(step.exposed_seconds)} exposed communication"]
    unhidden = step.overlapped_seconds - step.hidden_seconds
    if unhidden > 0:
        parts.append(f"{format_seconds(unhidden)} of overlapping communication beyond it")
    if step.bubble:
        parts.append(f"{format_seconds(step.idle_seconds)} idle in a {step.bubble:.1%} bubble")
    return " + ".join(parts)


def reason_lost(r: Ranked, best: Ranked | None, device_memory: int) -> str:
    """Why ``r`` is not the best."""
    est = r.estimate
    if not r.fits:
        return (f"does not fit: needs {format_bytes(est.memory.total)} > "
                f"{format_bytes(device_memory)} ({largest_memory(est)})")
    if best is None:
        return "its plan file does not validate"
    if seconds(r) > seconds(best):
        return (f"slower: {format_seconds(r.seconds)} vs {format_seconds(best.seconds)} per "
                f"step ({step_parts(r)}); most communication on {dominant(est)}")
    if r.candidate.preference > best.candidate.preference:
        return "as fast, but recomputes more (more checkpointing)"
    if est.memory.total > best.estimate.memory.total:
        return (f"as fast and as much recomputation, more memory "
                f"({format_bytes(est.memory.total)} vs "
                f"{format_bytes(best.estimate.memory.total)})")
    if est.seconds > best.estimate.seconds:
        return (f"as fast, as much recomputation and memory, more communication "
                f"({format_seconds(est.seconds)} vs {format_seconds(best.estimate.seconds)})")
    return "as fast: its plan file does not validate"


def _alternatives(best: Ranked, pick: Pick, results: Sequence[Ranked]) -> list[Ranked]:
    """The layouts that do without ``pick``; for a first-fit axis, the same layout with a
    faster choice there."""
    if pick.axis.first_fit:
        same = best.candidate.key(skip=pick.plugin)
        return [r for r in results if r.candidate.key(skip=pick.plugin) == same
                and (p := r.candidate.pick(pick.plugin)) is not None
                and p.choice.preference < pick.choice.preference]
    return [r for r in results
            if (p := r.candidate.pick(pick.plugin)) is None or p.without]


def why_best(best: Ranked, results: Sequence[Ranked], device_memory: int) -> list[str]:
    """Why the best layout has each of its choices, then the risks its estimate names."""
    est = best.estimate
    step = est.step
    out = [f"best: {best.candidate.label()}: {format_bytes(est.memory.total)} per rank of "
           f"{format_bytes(device_memory)}; {format_seconds(step.seconds)} per step "
           f"({step_parts(best)}), {step.tokens_per_second_per_device:,.0f} tokens/s per "
           f"device, MFU {step.mfu:.1%}"]
    for pick in best.candidate.picks:
        if not pick.choice.used or not pick.choice.label:
            continue
        if pick.axis.dim is not None and pick.size == 1:
            continue
        others = _alternatives(best, pick, results)
        if not others:
            continue
        label = pick.choice.label
        fitting = [r for r in others if r.fits]
        if pick.axis.first_fit:
            need = min(others, key=lambda r: r.estimate.memory.total)
            out.append(f"{label}: with less of it this layout needs "
                       f"{format_bytes(need.estimate.memory.total)} > "
                       f"{format_bytes(device_memory)} ({largest_memory(need.estimate)})")
        elif not fitting:
            smallest = min(others, key=lambda r: r.estimate.memory.total)
            out.append(f"{label}: no layout without it fits; the smallest "
                       f"({smallest.candidate.label()}) needs "
                       f"{format_bytes(smallest.estimate.memory.total)} > "
                       f"{format_bytes(device_memory)} ({largest_memory(smallest.estimate)})")
        else:
            fastest = min(fitting, key=rank_key)
            if seconds(fastest) > seconds(best):
                out.append(f"{label}: faster than the best layout without it "
                           f"({fastest.candidate.label()}: {format_seconds(fastest.seconds)} "
                           f"per step, {step_parts(fastest)}; most communication on "
                           f"{dominant(fastest.estimate)})")
            else:
                out.append(f"{label}: as fast as the best layout without it "
                           f"({fastest.candidate.label()}), with "
                           + ("less recomputation" if fastest.candidate.preference
                              > best.candidate.preference else
                              f"less memory ({format_bytes(est.memory.total)} vs "
                              f"{format_bytes(fastest.estimate.memory.total)})"))
    out += [note.split(": ", 1)[1] for note in est.notes
            if ": risk:" in note and note.split(": ", 1)[1].startswith("risk:")]
    return out


__all__ = ["dominant", "largest_memory", "reason_lost", "step_parts", "why_best"]
