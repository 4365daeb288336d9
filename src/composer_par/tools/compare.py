"""Two runs side by side: the losses step by step and the parameters, the first step
where they part and the largest differences, for any plan.

A run is read from (:func:`load_run`):

* a JSON log: a document with ``"losses"`` (and optionally ``"first_step"``: the step
  before the first loss, and ``"parameters"``: :func:`parameter_summary` of the final
  weights), as ``composer-par demo --json`` writes and :func:`run_log` makes from any
  training loop; or a ``composer-par selfcheck --json`` document, one of whose rungs is
  taken (``rung=``: its rank count; default the last);
* a checkpoint of any format :mod:`composer_par.checkpoint.formats` reads: a committed
  DCP step directory or root (its latest step), a ``.safetensors`` file, a directory of
  them or an index json, a DeepSpeed ZeRO checkpoint, an FSDP1 state dict. Its
  parameters are compared tensor by tensor; it has no losses.

Parameters of two checkpoints are compared element by element; where one side is a JSON
log they are compared by their summaries (sum, norm, largest magnitude), which catch any
difference larger than the tolerance in practice but are not a proof of equality.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

# The fp32 tolerance the parity tests use (composer_par.testing.parity).
RTOL = 1.3e-6
ATOL = 1e-5
SUMMARY_KEYS = ("sum", "norm", "max_abs")
# The largest parameter differences listed.
TOP = 5
#: A loss table of at most this many steps is printed whole; a longer one is summarized
#: (``full=True``, the command's ``--full-table``, prints every step).
TABLE_ROWS = 50
#: The most parameter names one list of the report names.
_LIST = 50
#: In a summary: the first and last steps, the steps around the first divergence on each
#: side, and the steps of the largest differences.
_ENDS, _AROUND, _LARGEST = 5, 3, 10
#: The largest JSON log read (a log of every step of a long run is tens of MB).
LOG_LIMIT = 1 << 30


class CompareError(ValueError):
    """A run that cannot be read: the message names the file and what is wrong."""


def parameter_summary(params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Per parameter: shape, sum, norm and largest magnitude, in float64, for a JSON log."""
    out = {}
    for name, value in params.items():
        t = value.detach().double()
        out[name] = {"shape": list(t.shape), "sum": float(t.sum()), "norm": float(t.norm()),
                     "max_abs": float(t.abs().max()) if t.numel() else 0.0}
    return out


def run_log(losses: Sequence[float], params: Mapping[str, torch.Tensor] | None = None, *,
            first_step: int = 0) -> dict[str, Any]:
    """A JSON log of a training loop that ``composer-par compare`` reads: the loss of
    each step (steps ``first_step + 1 ...``) and, given, a summary of the final
    parameters (full tensors: ``full_tensor()`` of DTensors)."""
    log: dict[str, Any] = {"losses": [float(x) for x in losses], "first_step": first_step}
    if params is not None:
        log["parameters"] = parameter_summary(params)
    return log


@attrs.frozen
class Run:
    """One side of a comparison. ``losses`` maps step -> loss (None: a checkpoint);
    ``summaries`` or ``tensors`` (name -> a reader of the full tensor) hold its
    parameters, either may be None."""

    source: str
    kind: str  # "log" or "checkpoint"
    losses: dict[int, float] | None
    summaries: dict[str, dict[str, Any]] | None = None
    tensors: dict[str, Any] | None = None

    @property
    def has_parameters(self) -> bool:
        return self.summaries is not None or self.tensors is not None


def load_run(path: str | Path, *, rung: int | None = None, stack: ExitStack) -> Run:
    """Read ``path`` as a JSON log or a checkpoint; files it opens close with ``stack``."""
    p = Path(path)
    if not p.exists():
        raise CompareError(f"{p}: no such file or directory")
    if not p.is_dir() and p.suffix == ".json" and not p.name.endswith(".index.json"):
        return _from_log(p, rung)
    return _from_checkpoint(p, stack)


def _from_log(path: Path, rung: int | None) -> Run:
    from composer_par.checkpoint.errors import CheckpointError
    from composer_par.checkpoint.jsonfile import MalformedJsonError, read_json_object

    try:
        data = read_json_object(path, LOG_LIMIT, what="JSON log")
    except MalformedJsonError as exc:
        if str(exc).endswith("is not a JSON object"):
            raise CompareError(f"{path}: a JSON log is an object") from None
        raise CompareError(f"{path}: not a JSON log: {exc}") from None
    except CheckpointError as exc:
        raise CompareError(f"{path}: not a JSON log: {exc}") from None
    if "rungs" in data:  # a selfcheck log; rung= concerns these alone
        data = _pick_rung(path, data["rungs"], rung)
    losses = data.get("losses")
    if not isinstance(losses, list) or not all(isinstance(x, int | float) for x in losses):
        raise CompareError(f"{path}: expected \"losses\": a list of numbers")
    first = data.get("first_step", 0)
    if not isinstance(first, int):
        raise CompareError(f"{path}: \"first_step\" must be an int; found {first!r}")
    summaries = data.get("parameters")
    if summaries is not None and not (isinstance(summaries, dict) and all(
            isinstance(s, dict) and all(k in s for k in SUMMARY_KEYS)
            for s in summaries.values())):
        raise CompareError(f"{path}: \"parameters\" must map each name to "
                           f"{{{', '.join(SUMMARY_KEYS)}}}")
    return Run(str(path), "log", {first + i + 1: float(x) for i, x in enumerate(losses)},
               summaries)


def _pick_rung(path: Path, rungs: Any, wanted: int | None) -> dict[str, Any]:
    if not isinstance(rungs, list) or not rungs:
        raise CompareError(f"{path}: \"rungs\" is empty: the selfcheck finished no rung")
    if not all(isinstance(entry, dict) for entry in rungs):
        raise CompareError(f"{path}: \"rungs\" must be a list of objects")
    if wanted is None:
        return rungs[-1]  # type: ignore[no-any-return]
    for entry in rungs:
        if entry.get("ranks") == wanted:
            return entry  # type: ignore[no-any-return]
    found = ", ".join(str(r.get("ranks")) for r in rungs)
    raise CompareError(f"{path}: no rung of {wanted} ranks (rungs: {found})")


def _from_checkpoint(path: Path, stack: ExitStack) -> Run:
    """A checkpoint of any format (:mod:`composer_par.checkpoint.formats`): each tensor
    read when it is compared, one at a time."""
    import functools

    from composer_par.checkpoint import CheckpointError
    from composer_par.checkpoint.formats import open_source

    try:
        source = stack.enter_context(open_source(path))
    except (CheckpointError, ValueError) as exc:
        raise CompareError(f"{path}: {exc}") from None
    return Run(str(path), "checkpoint", None,
               tensors={name: functools.partial(source.read, name) for name in source.specs})


@attrs.frozen
class StepRow:
    step: int
    a: float | None
    b: float | None

    @property
    def diff(self) -> float | None:
        return None if self.a is None or self.b is None else abs(self.a - self.b)


@attrs.frozen
class Comparison:
    """What :func:`compare` found. ``first_divergent_step`` is the first step whose losses
    differ beyond the tolerance (None: none); ``param_diffs`` is each shared parameter's
    largest difference (element-wise, or of the summaries), largest first."""

    a: str
    b: str
    rtol: float
    atol: float
    steps: list[StepRow]
    first_divergent_step: int | None
    param_diffs: list[tuple[str, float, bool]]  # name, difference, within tolerance
    only_in_a: list[str]
    only_in_b: list[str]
    shape_mismatches: list[str]
    parameter_method: str | None  # "elementwise", "summary" or None (not compared)

    @property
    def losses_equal(self) -> bool:
        return self.first_divergent_step is None

    @property
    def parameters_equal(self) -> bool:
        return (not self.only_in_a and not self.only_in_b and not self.shape_mismatches
                and all(ok for _, _, ok in self.param_diffs))

    @property
    def equal(self) -> bool:
        return self.losses_equal and self.parameters_equal

    @property
    def first_divergent_parameter(self) -> str | None:
        different = [name for name, _, ok in self.param_diffs if not ok]
        return different[0] if different else None

    @property
    def largest_loss_differences(self) -> list[StepRow]:
        """The steps whose losses differ most (a loss on one side only, or NaN, first)."""
        def size(row: StepRow) -> float:
            d = row.diff
            return math.inf if d is None or math.isnan(d) else d
        return sorted((r for r in self.steps if size(r) > 0), key=size,
                      reverse=True)[:_LARGEST]

    def shown_steps(self, full: bool = False) -> list[StepRow]:
        """The rows of the loss table: every step when ``full`` or when there are at most
        :data:`TABLE_ROWS`; else the first and last steps, those around the first
        divergence and those of the largest differences, in step order."""
        if full or len(self.steps) <= TABLE_ROWS:
            return list(self.steps)
        index = {row.step: i for i, row in enumerate(self.steps)}
        keep = set(range(_ENDS)) | set(range(len(self.steps) - _ENDS, len(self.steps)))
        if self.first_divergent_step is not None:
            at = index[self.first_divergent_step]
            keep |= set(range(max(at - _AROUND, 0), min(at + _AROUND + 1, len(self.steps))))
        keep |= {index[row.step] for row in self.largest_loss_differences}
        return [self.steps[i] for i in sorted(keep)]

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        """As JSON; ``steps`` holds the rows :meth:`shown_steps` gives (``full``: all)."""
        rows = self.shown_steps(full)
        return {
            "a": self.a, "b": self.b, "rtol": self.rtol, "atol": self.atol,
            "equal": self.equal, "losses_equal": self.losses_equal,
            "parameters_equal": self.parameters_equal,
            "first_divergent_step": self.first_divergent_step,
            "steps_compared": len(self.steps),
            "steps_shown": "all" if len(rows) == len(self.steps) else len(rows),
            "steps": [{"step": r.step, "a": r.a, "b": r.b, "diff": r.diff} for r in rows],
            "largest_loss_differences": [{"step": r.step, "diff": r.diff}
                                         for r in self.largest_loss_differences],
            "parameter_method": self.parameter_method,
            "largest_parameter_differences": [
                {"name": n, "diff": d, "within_tolerance": ok}
                for n, d, ok in self.param_diffs[:TOP]],
            "parameters_differing": [n for n, _, ok in self.param_diffs if not ok][:_LIST],
            "parameters_differing_count": sum(1 for _, _, ok in self.param_diffs if not ok),
            "only_in_a": self.only_in_a[:_LIST], "only_in_b": self.only_in_b[:_LIST],
            "shape_mismatches": self.shape_mismatches[:_LIST],
        }

    def format(self, full: bool = False) -> str:
        """The report as text: the loss table (summarized past :data:`TABLE_ROWS` steps
        unless ``full``), the verdict on losses and parameters."""
        from composer_par.tables import table

        lines = [f"A: {self.a}", f"B: {self.b}",
                 f"tolerance: rtol {self.rtol:g}, atol {self.atol:g}"]
        if self.steps:
            rows = self.shown_steps(full)
            cells: list[tuple[Any, ...]] = []
            previous = None
            for r in rows:
                if previous is not None and r.step != previous.step + 1 and \
                        len(rows) < len(self.steps):
                    cells.append(("...", "", "", "", ""))
                cells.append((r.step, _num(r.a), _num(r.b), _num(r.diff),
                              "" if _close(r.a, r.b, self.rtol, self.atol) else "DIFFERS"))
                previous = r
            lines.append(table(cells, ("STEP", "LOSS A", "LOSS B", "|A-B|", ""),
                               right=(0, 1, 2, 3)))
            if len(rows) < len(self.steps):
                lines.append(f"table: {len(rows)} of {len(self.steps)} steps (the first and "
                             "last, around the first divergence, the largest differences); "
                             "--full-table prints every step")
            if self.first_divergent_step is None:
                lines.append(f"losses: equal at every one of the {len(self.steps)} steps")
            else:
                apart = sum(1 for r in self.steps if not _close(r.a, r.b, self.rtol, self.atol))
                lines.append(f"losses: first divergent step {self.first_divergent_step}; "
                             f"{apart} of {len(self.steps)} steps differ")
        else:
            lines.append("losses: not compared (a checkpoint holds none)")
        if self.parameter_method is None:
            lines.append("parameters: not compared (one side holds none)")
        else:
            how = ("element by element" if self.parameter_method == "elementwise"
                   else "by their summaries (sum, norm, largest magnitude)")
            differing = [n for n, _, ok in self.param_diffs if not ok]
            lines.append(f"parameters ({how}): {len(self.param_diffs)} compared, "
                         f"{len(differing)} differ")
            for name, diff, ok in self.param_diffs[:TOP]:
                lines.append(f"  {name}: largest difference {diff:.3g}"
                             + ("" if ok else "  DIFFERS"))
            for label, names in (("only in A", self.only_in_a), ("only in B", self.only_in_b),
                                 ("shapes differ", self.shape_mismatches)):
                if names:
                    more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
                    lines.append(f"  {label}: {', '.join(names[:_LIST])}{more}")
        lines.append("the runs are equal within the tolerance" if self.equal else
                     "the runs differ")
        return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _close(a: float | None, b: float | None, rtol: float, atol: float) -> bool:
    if a is None or b is None:
        return False
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * abs(b)


def compare(a: Run, b: Run, *, rtol: float = RTOL, atol: float = ATOL) -> Comparison:
    """``a`` against ``b`` (``b`` is the reference of the relative tolerance)."""
    rows: list[StepRow] = []
    first = None
    if a.losses is not None and b.losses is not None:
        for step in sorted(set(a.losses) | set(b.losses)):
            row = StepRow(step, a.losses.get(step), b.losses.get(step))
            rows.append(row)
            if first is None and not _close(row.a, row.b, rtol, atol):
                first = step
    method, diffs, only_a, only_b, shapes = _compare_parameters(a, b, rtol, atol)
    return Comparison(a.source, b.source, rtol, atol, rows, first, diffs, only_a, only_b,
                      shapes, method)


def _compare_parameters(a: Run, b: Run, rtol: float, atol: float) -> tuple[
        str | None, list[tuple[str, float, bool]], list[str], list[str], list[str]]:
    if not a.has_parameters or not b.has_parameters:
        return None, [], [], [], []
    names_a = set(a.tensors or a.summaries or {})
    names_b = set(b.tensors or b.summaries or {})
    elementwise = a.tensors is not None and b.tensors is not None
    diffs, shapes = [], []
    for name in sorted(names_a & names_b):
        if elementwise:
            found = _tensor_diff(a.tensors[name], b.tensors[name], rtol, atol)  # type: ignore[index]
        else:
            found = _summary_diff(_summary_of(a, name), _summary_of(b, name), rtol, atol)
        if found is None:
            shapes.append(name)
        else:
            diffs.append((name, *found))
    # The ones beyond the tolerance first, then by size.
    diffs.sort(key=lambda d: (d[2], -d[1]))
    return ("elementwise" if elementwise else "summary", diffs, sorted(names_a - names_b),
            sorted(names_b - names_a), shapes)


def _read(reader: Any) -> torch.Tensor:
    from composer_par.checkpoint import CheckpointError

    try:
        return reader()  # type: ignore[no-any-return]
    except CheckpointError as exc:
        raise CompareError(str(exc)) from None


def _tensor_diff(ra: Any, rb: Any, rtol: float, atol: float) -> tuple[float, bool] | None:
    ta, tb = _read(ra).double(), _read(rb).double()
    if ta.shape != tb.shape:
        return None
    if ta.numel() == 0:
        return 0.0, True
    diff = (ta - tb).abs()
    ok = bool((diff <= atol + rtol * tb.abs()).all())
    return float(diff.max()), ok


def _summary_of(run: Run, name: str) -> dict[str, Any]:
    if run.summaries is not None:
        return run.summaries[name]
    return parameter_summary({name: _read(run.tensors[name])})[name]  # type: ignore[index]


def _summary_diff(sa: Mapping[str, Any], sb: Mapping[str, Any], rtol: float, atol: float
                  ) -> tuple[float, bool] | None:
    """The largest difference of the summaries, and whether each is within what two
    tensors equal element-wise within ``rtol``/``atol`` can differ by: ``max_abs`` by
    ``atol + rtol * max_abs``, ``norm`` by ``sqrt(n)`` times that, ``sum`` by ``n`` times
    that (n elements). A summary beyond its bound proves the tensors differ."""
    shape_a, shape_b = sa.get("shape"), sb.get("shape")
    if shape_a is not None and shape_b is not None and list(shape_a) != list(shape_b):
        return None
    n = math.prod(shape_b) if shape_b is not None else 1
    element = atol + rtol * abs(float(sb["max_abs"]))
    bounds = {"max_abs": element, "norm": math.sqrt(n) * element, "sum": n * element}
    worst, ok = 0.0, True
    for key in SUMMARY_KEYS:
        diff = abs(float(sa[key]) - float(sb[key]))
        ok = ok and not diff > bounds[key]  # a NaN on one side differs
        worst = max(worst, diff)
    return worst, ok


def iter_names(run: Run) -> Iterator[str]:
    yield from (run.tensors or run.summaries or {})


__all__ = ["ATOL", "RTOL", "CompareError", "Comparison", "Run", "compare", "load_run",
           "parameter_summary", "run_log"]
