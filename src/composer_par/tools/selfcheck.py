"""``composer-par selfcheck``: the pre-flight ladder before a long run.

Rung 1 trains the model in one process with no parallelism: the baseline. Each further
rung lays the plan onto that many local ranks (torch's elastic launcher; CUDA + NCCL
where there are GPUs, else CPU + gloo) and trains the same steps on the same global
batches, with the seeds fixed and deterministic algorithms on. A rung passes when, against
the baseline and within fp32 tolerance:

* every rank built the same plan (a plan that differs per rank, e.g. a seed taken from
  the rank, is named with the first line that differs);
* every rank's full parameters after apply equal the baseline's (the worst parameter
  named with its rank);
* the data-parallel ranks read each sample of a step once: none twice, none missed
  (ranks that differ only in model-parallel mesh dims read the same ones);
* the loss of every step equals the baseline's;
* every rank's full parameters after the last step equal the baseline's.

Like is compared with like. The baseline runs the plan's precision policy (the
parameter dtype its data-parallel plugin computes in, as the plan's estimate settings
state it: parameters kept in float32, forwards on copies in that dtype), and where a
rung's ranks each take a loss per micro-batch (a router's balancing loss) or compute in a
lower precision, the baseline is run again for that rung with one micro-batch per data
shard, in shard order. Tolerances are per compute dtype (:data:`TOLERANCES`) and stated
in the report; initial parameters, stored in float32 whatever the compute dtype, are
compared at float32's.

Before the first multi-rank rung, rung 1 runs the reduction check of ``validate --model``
(:mod:`composer_par.reduction_check`) on the plan as laid on every later rung, in this
process, over torch's fake process group: a gradient that needs a sum over a mesh dim
and gets none (or gets two) stops the ladder there, naming the parameter and the dim.

It also reports, never judges: each rank's peak memory against ``estimate``'s figure for
that layout (the ratio), the median step time after the warm-up steps, and the share of
the last step spent in collectives (``torch.profiler``) with the top collectives.

Plans are folded onto a rung's rank count (:func:`fold_mesh`): the mesh dims that fit are
kept, outermost first; the others are folded to 1, and ranks left over widen the
innermost data-parallel mesh dim. Each fold is said.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.tools.compare import ATOL, RTOL

if TYPE_CHECKING:
    import torch

    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan

# The order the checks run in: the first that fails names the rung's failure.
CHECKS = ("plan", "initial parameters", "samples", "losses", "final parameters")

#: (rtol, atol) of the losses and final parameters by the dtype a plan computes in.
#: float32's are the parity tests'. In bfloat16 (8 bits of mantissa) every activation
#: and gradient is rounded to 2**-9 relative; the rungs and the baseline round at the
#: same places but sum the data shards' gradients in another order, which moves a
#: rounding now and then by one unit: torch.testing's bfloat16 rtol (1.6e-2), and an atol
#: for the parameters near zero that such a unit moves (lr times a gradient's unit).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (RTOL, ATOL),
    "bfloat16": (1.6e-2, 1e-4),
    "float16": (1e-3, 1e-5),
}


class SelfcheckInputError(ValueError):
    """An input the ladder cannot use (exit 2): the message says which and why."""


# -- the plan of a rung ----------------------------------------------------------------------


def load_plan(spec: str) -> ParallelPlan:
    """A plan file (``plan.toml``) or ``module:function`` returning a ParallelPlan (for
    what a plan file cannot state). Called on every rank: a function runs there."""
    from composer_par.plan import ParallelPlan

    if spec.endswith(".toml") or Path(spec).is_file():
        return ParallelPlan.from_toml(Path(spec))
    from composer_par.tools.dryrun import resolve_factory

    plan = resolve_factory(spec)()
    if not isinstance(plan, ParallelPlan):
        raise SelfcheckInputError(f"{spec}() returned a {type(plan).__name__}, not a "
                                  "ParallelPlan")
    return plan


def fold_mesh(plan: ParallelPlan, ranks: int) -> tuple[MeshSpec, list[str]]:
    """The plan's mesh laid onto ``ranks`` ranks, and one sentence per change."""
    from composer_par.mesh import MeshSpec

    mesh = plan.mesh
    if not mesh.is_resolved:
        try:
            return mesh.resolve(ranks), []
        except ValueError:
            pass
        mesh = MeshSpec(**{n: max(s, 1) for n, s in mesh})
    sizes, folds, left = {}, [], ranks
    for name, size in mesh:
        if left % size == 0:
            sizes[name] = size
            left //= size
        else:
            sizes[name] = 1
            folds.append(f"{name} {size} -> 1 (does not fit beside the dims kept on "
                         f"{ranks} rank(s))")
    if left > 1:
        grow = [n for n in plan.data_parallel_dims() if n in sizes]
        if not grow:
            raise SelfcheckInputError(
                f"the plan's mesh {mesh.equation()} cannot fill {ranks} ranks: it has no "
                "data-parallel mesh dim to widen; give --ranks that its mesh dims divide")
        name = grow[-1]
        folds.append(f"{name} {sizes[name]} -> {sizes[name] * left} (widened to fill "
                     f"{ranks} ranks)")
        sizes[name] *= left
    return MeshSpec(**sizes), folds


def rung_plan(spec: str, ranks: int, *, baseline: bool) -> tuple[ParallelPlan, list[str]]:
    """The plan a rung applies: for the baseline, the plan's MetaInit alone on no mesh
    (one process, no parallelism, the same initial weights: MetaInit is layout invariant);
    otherwise the plan folded onto ``ranks`` ranks."""
    from composer_par.mesh import MeshSpec
    from composer_par.plan import ParallelPlan
    from composer_par.topology import Topology

    plan = load_plan(spec)
    meta_init = plan.plugin("meta_init")
    if meta_init is None:
        raise SelfcheckInputError("selfcheck needs a plan that materializes with MetaInit "
                                  '(add [[plugins]] name = "meta_init"): its initial weights '
                                  "are the same on every layout, so the rungs can be compared")
    if baseline:
        return ParallelPlan(MeshSpec(), timeout=plan.timeout).use(meta_init), []
    mesh, folds = fold_mesh(plan, ranks)
    folded = ParallelPlan(mesh, topology=Topology.single_node(ranks), timeout=plan.timeout)
    for plugin in plan.plugins:
        folded.use(plugin)
    return folded, folds


# -- running the ladder ----------------------------------------------------------------------


@attrs.frozen
class Settings:
    plan: str
    model: str
    ranks: tuple[int, ...]
    steps: int = 4
    warmup: int = 1
    seq_len: int = 16
    batch: int = 8
    lr: float = 0.05
    seed: int = 0
    deterministic: bool = True
    timeout: float = 120.0
    sampler: str | None = None
    # None: by the plan's compute dtype (TOLERANCES)
    rtol: float | None = None
    atol: float | None = None

    def for_ranks(self, ranks: int, **extra: Any) -> dict[str, Any]:
        return {"plan": self.plan, "model": self.model, "ranks": ranks, "steps": self.steps,
                "warmup": self.warmup, "seq_len": self.seq_len, "batch": self.batch,
                "lr": self.lr, "seed": self.seed, "deterministic": self.deterministic,
                "timeout": self.timeout, "sampler": self.sampler, **extra}


def precision_of(spec: str) -> str | None:
    """The dtype the plan's forwards compute in, as its plugins state it to the estimate
    (``param_dtype``, e.g. FSDP2's mixed precision); None: the parameters' own."""
    from composer_par.estimate.layout import merge_settings

    plan = load_plan(spec)
    dtype = merge_settings(plan.hooks.estimate_settings()).get("param_dtype")
    return None if dtype in (None, "float32") else str(dtype)


def tolerances(settings: Settings, dtype: str | None) -> tuple[float, float]:
    """(rtol, atol) of the losses and final parameters: the flags', else the compute
    dtype's."""
    rtol, atol = TOLERANCES.get(dtype or "float32", TOLERANCES["float32"])
    return (settings.rtol if settings.rtol is not None else rtol,
            settings.atol if settings.atol is not None else atol)


def check_settings(settings: Settings) -> None:
    """What can be checked before a process starts: the plan loads, has MetaInit and
    validates on every rung; the global batch splits evenly over each rung's
    data-parallel ranks; the rungs fit the devices. Raises SelfcheckInputError."""
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else None
    for ranks in settings.ranks:
        if devices is not None and ranks > devices:
            raise SelfcheckInputError(f"--ranks {ranks}: only {devices} CUDA device(s) here")
        plan, folds = rung_plan(settings.plan, ranks, baseline=ranks == 1)
        report = plan.validate(world_size=ranks)
        if not report.ok:
            raise SelfcheckInputError(f"the plan on {ranks} rank(s) (after: "
                                      f"{'; '.join(folds) or 'no folds'}) has errors:\n"
                                      + report.format())
        _, count = plan.data_shard(0, ranks)
        if settings.batch % count:
            raise SelfcheckInputError(
                f"--batch {settings.batch} does not split evenly over the {count} "
                f"data-parallel ranks of the rung of {ranks} rank(s)")


def run_rung(settings: Settings, ranks: int, **extra: Any) -> list[dict[str, Any]]:
    """Every rank's record of one rung, in rank order (``extra``: settings of the rank's
    run beyond :class:`Settings`, as a baseline's micro-batches). Raises RungFailed when
    a rank fails, naming each failed rank's error; the launcher's own logs of it are
    held back (one line per failed rank is what the ladder says)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from composer_par.tools.demo import _first_failure
    from composer_par.tools.selfcheck_rank import CUBLAS_WORKSPACE, rung_rank

    # Set before any process starts: cuBLAS reads it when CUDA initializes.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks,
                          run_id=f"selfcheck-{os.getpid()}-{ranks}", rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2)
    try:
        with _launcher_quiet():
            results = elastic_launch(config, rung_rank)(settings.for_ranks(ranks, **extra))
    except ChildFailedError as exc:
        rank, _, message = _first_failure(exc)
        every = [(r, _failure_text(f)) for r, f in sorted(exc.failures.items())]
        raise RungFailed(ranks, rank, message, every) from None
    return [results[r] for r in sorted(results)]


# torch's launcher logs each failed rank's whole traceback (and every sibling it stops):
# the ladder names each failed rank in one line instead.
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing",
                     "torch.distributed.launcher")


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    import logging

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(_LAUNCHER_LOGGERS)]
    loggers += [logging.getLogger(name) for name in _LAUNCHER_LOGGERS]
    levels = [(logger, logger.level) for logger in loggers]
    for logger, _ in levels:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)


def _failure_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    text = str(message).strip()
    if not text:
        text = f"exited with code {failure.exitcode}"
    return text.splitlines()[0]


class RungFailed(Exception):
    def __init__(self, ranks: int, rank: int, message: str,
                 every: list[tuple[int, str]] | None = None) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.ranks, self.rank, self.message = ranks, rank, message
        self.every = every or [(rank, message.splitlines()[0] if message else "")]

    @property
    def model_code(self) -> bool:
        """The model factory raised (the input's fault: exit 2)."""
        return self.message.startswith("ModelCodeError")


# -- the checks ------------------------------------------------------------------------------


@attrs.frozen
class Failure:
    """The first difference of a rung: which check, and where."""

    check: str
    message: str
    step: int | None = None
    parameter: str | None = None
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def check_rung(baseline: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]],
               rtol: float = RTOL, atol: float = ATOL,
               initial: tuple[float, float] = (RTOL, ATOL)
               ) -> list[tuple[str, Failure | None]]:
    """Each check of :data:`CHECKS` with its failure (None: passed). ``rtol``/``atol``
    for the losses and final parameters; ``initial`` for the parameters after apply,
    which are the plan's stored ones (float32) whatever it computes in."""
    base = baseline[0]
    return [
        ("plan", _check_plans(records)),
        ("initial parameters", _check_params(base["initial"], records, "initial", *initial,
                                             None)),
        ("samples", _check_samples(base["samples"], records)),
        ("losses", _check_losses(base["losses"], records[0]["losses"], rtol, atol)),
        ("final parameters", _check_params(base["final"], records, "final", rtol, atol,
                                           len(base["losses"]))),
    ]


def _check_plans(records: Sequence[dict[str, Any]]) -> Failure | None:
    first = records[0]["plan"].splitlines()
    for record in records[1:]:
        lines = record["plan"].splitlines()
        if lines != first:
            at = next((i for i, (a, b) in enumerate(zip(first, lines, strict=False)) if a != b),
                      min(len(first), len(lines)))
            mine = lines[at] if at < len(lines) else "(nothing)"
            theirs = first[at] if at < len(first) else "(nothing)"
            return Failure("plan", f"rank {record['rank']} built another plan than rank 0: "
                           f"line {at + 1} is {mine!r} there and {theirs!r} on rank 0 (a "
                           "plan must not depend on the rank: seeds included)",
                           rank=record["rank"])
    return None


def _check_params(reference: dict[str, torch.Tensor], records: Sequence[dict[str, Any]],
                  which: str, rtol: float, atol: float, step: int | None) -> Failure | None:
    worst: tuple[float, int, str] | None = None  # (excess over the tolerance, rank, name)
    for record in records:
        params = record[which]
        missing = sorted(set(reference) ^ set(params))
        if missing:
            return Failure(f"{which} parameters", f"rank {record['rank']}: parameter names "
                           f"differ from the baseline's: {', '.join(missing[:5])}",
                           rank=record["rank"], parameter=missing[0], step=step)
        for name, ref in reference.items():
            value = params[name]
            if value.shape != ref.shape:
                return Failure(f"{which} parameters", f"rank {record['rank']}: {name} has "
                               f"shape {tuple(value.shape)}, the baseline "
                               f"{tuple(ref.shape)}", rank=record["rank"], parameter=name,
                               step=step)
            diff = (value.double() - ref.double()).abs()
            excess = float((diff - (atol + rtol * ref.double().abs())).max()) \
                if diff.numel() else 0.0
            if excess > 0 and (worst is None or excess > worst[0]):
                worst = (excess, record["rank"], name)
    if worst is None:
        return None
    _, rank, name = worst
    diff = float((records[rank][which][name].double() - reference[name].double()).abs().max())
    when = "after apply" if which == "initial" else f"after step {step}"
    return Failure(f"{which} parameters", f"rank {rank}: parameter {name} differs from the "
                   f"baseline {when} by {diff:.3g} (rtol {rtol:g}, atol {atol:g})",
                   step=step if step is not None else 0, parameter=name, rank=rank)


def _check_samples(baseline: Sequence[Sequence[int]], records: Sequence[dict[str, Any]]
                   ) -> Failure | None:
    by_shard: dict[int, dict[str, Any]] = {}
    for record in records:
        index = record["data_shard"][0]
        first = by_shard.setdefault(index, record)
        if record["samples"] != first["samples"]:
            pairs = zip(record["samples"], first["samples"], strict=False)
            step = next(s for s, (a, b) in enumerate(pairs) if a != b) + 1
            return Failure("samples", f"ranks {first['rank']} and {record['rank']} read data "
                           f"shard {index} but different samples at step {step}",
                           step=step, rank=record["rank"])
    for step, wanted in enumerate(baseline, start=1):
        readers: dict[int, int] = {}
        for index, record in sorted(by_shard.items()):
            for sample_id in record["samples"][step - 1]:
                if sample_id in readers:
                    other = by_shard[readers[sample_id]]["rank"]
                    return Failure("samples", f"sample {sample_id} was read twice at step "
                                   f"{step}: by rank {other} (data shard {readers[sample_id]})"
                                   f" and rank {record['rank']} (data shard {index})",
                                   step=step, rank=record["rank"])
                readers[sample_id] = index
        missed = sorted(set(wanted) - set(readers))
        if missed:
            return Failure("samples", f"{len(missed)} sample(s) of the global batch were read "
                           f"by no rank at step {step} (e.g. sample {missed[0]})", step=step)
    return None


def _check_losses(baseline: Sequence[float], losses: Sequence[float], rtol: float,
                  atol: float) -> Failure | None:
    for step, (ref, got) in enumerate(zip(baseline, losses, strict=False), start=1):
        if not abs(got - ref) <= atol + rtol * abs(ref):
            return Failure("losses", f"the loss of step {step} is {got:.8g}, the baseline's "
                           f"{ref:.8g} (|diff| {abs(got - ref):.3g}; rtol {rtol:g}, "
                           f"atol {atol:g})", step=step)
    return None


# -- the ladder and its report ---------------------------------------------------------------


def summarize(records: Sequence[dict[str, Any]], checks: list[tuple[str, Failure | None]] | None,
              failed: RungFailed | None = None) -> dict[str, Any]:
    """A rung as the JSON document holds it (no tensors)."""
    from composer_par.tools.compare import parameter_summary

    if failed is not None:
        # torch's own words when deterministic mode meets an op without a deterministic
        # implementation: the op is named in the message.
        check = ("model code" if failed.model_code else "determinism"
                 if "does not have a deterministic implementation" in failed.message
                 else "run")
        return {"ranks": failed.ranks, "ok": False, "failure": {
            "check": check, "message": f"rank {failed.rank} failed: {failed.message}",
            "rank": failed.rank, "step": None, "parameter": None},
            "failed_ranks": [{"rank": r, "message": m} for r, m in failed.every]}
    first = records[0]
    failure = next((f for _, f in checks or () if f is not None), None)
    peaks = [r["peak_bytes"] for r in records]
    estimate = first["estimate_bytes"]
    return {
        "ranks": first["ranks"], "ok": failure is None, "baseline": checks is None,
        "mesh": first["mesh"], "folds": first["folds"], "backend": first["backend"],
        "device": first["device"],
        "checks": [{"name": n, "ok": f is None, **({"failure": f.to_dict()} if f else {})}
                   for n, f in checks or ()],
        "failure": failure.to_dict() if failure else None,
        "first_step": 0, "losses": first["losses"],
        "parameters": parameter_summary(first["final"]),
        "peak_bytes": peaks, "estimate_bytes": estimate,
        "memory_ratio": [round(p / estimate, 3) if estimate else None for p in peaks],
        "step_times_s": [r["step_time_s"] for r in records],
        "step_time_s": max(r["step_time_s"] for r in records),
        "comm_share": max(r["comm"].get("share", 0.0) for r in records),
        "top_collectives": records[0]["comm"].get("top", []),
        "determinism": first["determinism"],
    }


def reduction_checks(settings: Settings) -> list[dict[str, Any]]:
    """The reduction check of ``validate --model`` on the plan as laid on every rung
    after the first (its ranks 0 and last, over torch's fake process group, in this
    process): per rung, the status of the step and the problems found."""
    from composer_par.tools.dryrun import dry_run

    out = []
    for ranks in settings.ranks:
        if ranks == 1:
            continue
        plan, _ = rung_plan(settings.plan, ranks, baseline=False)
        result = dry_run(plan, settings.model, world_size=ranks)
        statuses = {r.forward[0] for r in result.ranks if r.forward}
        failures = [r.failure for r in result.ranks if r.failure]
        out.append({
            "ranks": ranks, "mesh": plan.mesh.to_dict(),
            "status": ("failed" if failures or "failed" in statuses else
                       "ran" if statuses == {"ran"} else "not checked"),
            "detail": failures[0] if failures else next(
                (r.forward[1] for r in result.ranks if r.forward), "no step (a pipeline)"),
            "problems": [m for r in result.ranks for m in r.reductions]})
    return out


def _reduction_failure(checked: list[dict[str, Any]]) -> Failure | None:
    for rung in checked:
        if rung["problems"]:
            first = rung["problems"][0]
            # "ERROR CP434: rank R: PARAMETER: ..."
            parts = first.split(": ")
            rank = int(parts[1].split()[1]) if len(parts) > 2 else None
            return Failure("reductions", f"on the layout of rung {rung['ranks']} "
                           f"({_mesh_text(rung['mesh'])}): {first} "
                           f"({len(rung['problems'])} problem(s) in all)",
                           parameter=parts[2] if len(parts) > 2 else None, rank=rank)
    return None


def _mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{n}({s})" for n, s in mesh.items()) or "none"


def run_ladder(settings: Settings, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every rung in turn, stopping at the first that differs; the JSON document."""
    rungs: list[dict[str, Any]] = []
    baselines: dict[int, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    dtype = precision_of(settings.plan)
    rtol, atol = tolerances(settings, dtype)
    exit_code = 0
    for ranks in settings.ranks:
        label = f"rung {ranks} rank(s)" + (" (baseline)" if ranks == 1 else "")
        progress(f"{label}: training {settings.warmup} warm-up + {settings.steps} steps...")
        t0 = time.perf_counter()
        try:
            if ranks != 1:
                compared = _baseline_for(settings, ranks, baselines, dtype, progress)
            records = run_rung(settings, ranks, param_dtype=dtype)
        except RungFailed as exc:
            rung = summarize([], None, exc)
            rungs.append(rung)
            for rank, message in exc.every:
                progress(f"{label}: FAILED on rank {rank}: {message}")
            exit_code = 2 if exc.model_code else 1
            break
        if ranks == 1:
            baselines[1] = records
            checks = None
        else:
            base, note = compared
            checks = check_rung(base, records, rtol, atol)
        rung = summarize(records, checks)
        if ranks == 1:
            progress(f"{label}: checking the gradient reductions of the plan as laid on "
                     "every rung (one step on fake tensors)...")
            checked = reduction_checks(settings)
            failure = _reduction_failure(checked)
            rung["reductions"] = checked
            rung["checks"] = [{"name": "reductions", "ok": failure is None,
                               **({"failure": failure.to_dict()} if failure else {})}]
            if failure is not None:
                rung.update(ok=False, failure=failure.to_dict())
        else:
            rung["compared_with"] = note
        rung["seconds"] = round(time.perf_counter() - t0, 2)
        rungs.append(rung)
        for fold in rung["folds"]:
            progress(f"{label}: folded {fold}")
        progress(f"{label}: {row_text(rung)}")
        if not rung["ok"]:
            exit_code = 1
            break
    failed = next((r for r in rungs if not r["ok"]), None)
    return {
        "ok": failed is None, "exit_code": exit_code,
        "plan": settings.plan, "model": settings.model, "ranks": list(settings.ranks),
        "steps": settings.steps, "warmup": settings.warmup, "seq_len": settings.seq_len,
        "batch": settings.batch, "lr": settings.lr, "optimizer": "sgd",
        "compute_dtype": dtype or "float32", "rtol": rtol, "atol": atol,
        "initial_rtol": RTOL, "initial_atol": ATOL,
        "first_failure": None if failed is None else {"rung": failed["ranks"],
                                                      **failed["failure"]},
        "rungs": rungs, "seconds": round(time.perf_counter() - started, 2),
        "timing_note": (f"step time: median of the {settings.steps} timed steps after "
                        f"{settings.warmup} warm-up step(s) (excluded), the profiled last "
                        "step left out when others are timed; the slowest rank's"),
        "memory_note": ("peak: on CUDA max_memory_allocated, on CPU the growth of the "
                        "resident set over its size before the model was built; against "
                        "estimate's per-rank total for the layout"),
        "tolerance_note": (f"tolerances: losses and final parameters rtol {rtol:g}, atol "
                           f"{atol:g} ({dtype or 'float32'} compute"
                           + (", given" if settings.rtol is not None
                              or settings.atol is not None else "")
                           + f"); initial parameters (float32 storage) rtol {RTOL:g}, atol "
                           f"{ATOL:g}"),
    }


def _baseline_for(settings: Settings, ranks: int, baselines: dict[int, list[dict[str, Any]]],
                  dtype: str | None, progress: Callable[[str], None]
                  ) -> tuple[list[dict[str, Any]], str]:
    """The baseline rung ``ranks`` is compared with, and a sentence saying which: the
    baseline itself, or, where the ranks take a loss per micro-batch (a router's
    balancing loss) or compute below float32, the baseline run again as one micro-batch
    per data shard of that rung (kept for other rungs of as many shards)."""
    base = baselines[1]
    plan, _ = rung_plan(settings.plan, ranks, baseline=False)
    _, shards = plan.data_shard(0, ranks)
    why = [w for w, need in (("its ranks each take a loss per micro-batch",
                              bool(base[0].get("aux_losses"))),
                             (f"it computes in {dtype}", dtype is not None)) if need]
    if shards == 1 or not why:
        return base, "the baseline"
    if shards not in baselines:
        progress(f"rung {ranks} rank(s): {' and '.join(why)}: the baseline again as "
                 f"{shards} micro-batches, one per data shard...")
        baselines[shards] = run_rung(settings, 1, param_dtype=dtype, micro_batches=shards)
    return baselines[shards], (f"the baseline as {shards} micro-batches, one per data shard "
                               f"({' and '.join(why)})")


def row_text(rung: dict[str, Any]) -> str:
    if rung.get("baseline") and rung["ok"]:
        checked = rung.get("reductions") or []
        verdict = "baseline" + (f"; gradient reductions checked on the layouts of "
                                f"{len(checked)} rung(s)" if checked else "")
    elif rung["ok"]:
        verdict = "matches the baseline"
    else:
        verdict = f"DIFFERS: {rung['failure']['check']}: {rung['failure']['message']}"
    return (f"{verdict}; peak {_mib(max(rung['peak_bytes']))} (estimate "
            f"{_mib(rung['estimate_bytes'])}), step {rung['step_time_s'] * 1e3:.1f} ms, "
            f"collectives {rung['comm_share']:.0%}")


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def format_report(doc: dict[str, Any]) -> str:
    from composer_par.tables import table

    cells = []
    for rung in doc["rungs"]:
        if "mesh" not in rung:
            cells.append((rung["ranks"], "-", "FAILED", "-", "-", "-", "-", "-"))
            continue
        mesh = " x ".join(f"{n}({s})" for n, s in rung["mesh"].items()) or "none"
        state = ("DIFFERS" if not rung["ok"] else "baseline" if rung["baseline"] else "ok")
        ratios = [r for r in rung["memory_ratio"] if r is not None]
        cells.append((rung["ranks"], mesh, state, _mib(max(rung["peak_bytes"])),
                      _mib(rung["estimate_bytes"]), f"{max(ratios):.2f}" if ratios else "?",
                      f"{rung['step_time_s'] * 1e3:.1f}", f"{rung['comm_share']:.0%}"))
    lines = [table(cells, ("RANKS", "MESH", "CHECKS", "PEAK/RANK", "ESTIMATE", "RATIO",
                           "STEP MS", "COMM"), right=(0, 3, 4, 5, 6, 7))]
    for rung in doc["rungs"]:
        for top in rung.get("top_collectives", [])[:3]:
            lines.append(f"  rung {rung['ranks']}: {top['name']} x{top['calls']}: "
                         f"{top['seconds'] * 1e3:.2f} ms")
    for rung in doc["rungs"]:
        for checked in rung.get("reductions", []):
            lines.append(f"  gradient reductions on the layout of rung {checked['ranks']} "
                         f"({_mesh_text(checked['mesh'])}): "
                         + (f"{len(checked['problems'])} problem(s)" if checked["problems"]
                            else "every gradient gets the sums it needs"
                            if checked["status"] == "ran"
                            else f"{checked['status']}: {checked['detail']}"))
        if rung.get("compared_with", "the baseline") != "the baseline":
            lines.append(f"  rung {rung['ranks']} compared with {rung['compared_with']}")
    lines.append(doc["tolerance_note"])
    lines.append(doc["timing_note"])
    lines.append(doc["memory_note"])
    settings = doc["rungs"][0].get("determinism") if doc["rungs"] else None
    if settings:
        lines.append("determinism: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    failure = doc["first_failure"]
    if failure is None:
        lines.append(f"every rung matches the baseline ({doc['compute_dtype']} compute: rtol "
                     f"{doc['rtol']:g}, atol {doc['atol']:g})")
    else:
        where = ", ".join(f"{k} {failure[k]}" for k in ("step", "parameter", "rank")
                          if failure.get(k) is not None)
        verb = ("failed" if failure["check"] in ("run", "model code") else
                f"differs: {failure['check']}")
        lines.append(f"rung {failure['rung']} {verb}"
                     + (f" ({where})" if where else "") + f": {failure['message']}")
    return "\n".join(lines)


def write_svg(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Three bar panels, one bar per rung: peak memory per rank (the fullest rank, with
    the estimate as a tick), step time, and the share of the step in collectives."""
    rungs = [r for r in doc["rungs"] if "mesh" in r]
    panels = [
        ("peak memory per rank (MiB)", [max(r["peak_bytes"]) / 2**20 for r in rungs],
         [(r["estimate_bytes"] or 0) / 2**20 for r in rungs]),
        ("step time (ms)", [r["step_time_s"] * 1e3 for r in rungs], None),
        ("share of the step in collectives (%)", [r["comm_share"] * 100 for r in rungs], None),
    ]
    width, panel_h, bar_w, left = 520, 150, 60, 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{panel_h * len(panels) + 20}" font-family="sans-serif" font-size="11">']
    for p, (title, values, ticks) in enumerate(panels):
        top = p * panel_h + 20
        scale = max([*values, *(ticks or []), 1e-9])
        parts.append(f'<text x="{left}" y="{top - 4}" font-weight="bold">{title}</text>')
        base_y = top + panel_h - 40
        parts.append(f'<line x1="{left}" y1="{base_y}" x2="{width - 10}" y2="{base_y}" '
                     'stroke="#444"/>')
        for i, (rung, value) in enumerate(zip(rungs, values, strict=True)):
            x = left + 10 + i * (bar_w + 20)
            h = (panel_h - 60) * value / scale
            color = "#4c78a8" if rung["ok"] else "#e45756"
            parts.append(f'<rect x="{x}" y="{base_y - h:.1f}" width="{bar_w}" height="{h:.1f}" '
                         f'fill="{color}"><title>{value:.3g}</title></rect>')
            parts.append(f'<text x="{x + bar_w / 2}" y="{base_y - h - 3:.1f}" '
                         f'text-anchor="middle">{value:.3g}</text>')
            parts.append(f'<text x="{x + bar_w / 2}" y="{base_y + 14}" '
                         f'text-anchor="middle">{rung["ranks"]} rank(s)</text>')
            if ticks and ticks[i]:
                ty = base_y - (panel_h - 60) * ticks[i] / scale
                parts.append(f'<line x1="{x - 4}" y1="{ty:.1f}" x2="{x + bar_w + 4}" '
                             f'y2="{ty:.1f}" stroke="#f58518" stroke-width="2">'
                             f'<title>estimate {ticks[i]:.3g}</title></line>')
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts) + "\n")


def parse_ranks(text: str) -> tuple[int, ...]:
    """``--ranks 1,2,4``: rank counts, rising; rung 1 (the baseline) is added first when
    not given."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SelfcheckInputError(f"--ranks: expected rank counts like 1,2,4; got {text!r}"
                                  ) from None
    if not values or any(v < 1 for v in values):
        raise SelfcheckInputError(f"--ranks: expected rank counts >= 1; got {text!r}")
    if values != sorted(set(values)):
        raise SelfcheckInputError(f"--ranks: give each rank count once, rising; got {text!r}")
    return tuple(values) if values[0] == 1 else (1, *values)


def default_ranks(plan_spec: str) -> tuple[int, ...]:
    """1, 2 and the plan's world size (when it is known and larger)."""
    plan = load_plan(plan_spec)
    world = plan.mesh.world_size if plan.mesh.is_resolved else None
    return tuple(sorted({1, 2, *([world] if world else [])}))


def stderr_progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def first_failure_text(doc: dict[str, Any]) -> str:
    failure = doc["first_failure"]
    if failure is None:
        return ""
    return f"rung {failure['rung']}: {failure['check']}: {failure['message']}"


__all__ = ["CHECKS", "TOLERANCES", "Failure", "SelfcheckInputError", "Settings", "check_rung",
           "check_settings", "default_ranks", "fold_mesh", "format_report", "load_plan",
           "parse_ranks", "precision_of", "reduction_checks", "run_ladder", "rung_plan",
           "tolerances", "write_svg"]
