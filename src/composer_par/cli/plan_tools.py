"""The CLI glue of the before-launch tools: ``validate --model`` (dry run), ``explain
--svg`` (layout pictures), ``estimate`` and ``suggest``.

:mod:`composer_par.cli.main` lists the commands; this module adds their arguments and
runs them. Nothing here imports torch unless a model is given (``--model``): estimating
from ``--params`` and suggesting stay on the static path.

The model code named by ``--model MODULE:FACTORY`` is the user's: whatever it raises,
and a ``sys.exit`` in it, ends the command with exit 2 naming ``MODULE:FACTORY``, not
with composer-par's internal-error code nor with the model's own exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_par.cli.common import (
    EXIT_ERRORS,
    EXIT_INPUT,
    EXIT_OK,
    InputError,
    Output,
    bounded_int,
    load_plan_for,
    plan_arguments,
    situation,
)
from composer_par.cli.failures import culprit, summary
from composer_par.planfile import MAX_RANKS, PlanFileError

if TYPE_CHECKING:
    from composer_par.estimate import ModelShape
    from composer_par.plan import Explanation, ParallelPlan


@contextlib.contextmanager
def model_code(spec: str) -> Iterator[None]:
    """Around what runs the user's model code (``--model spec``): what it raises, or an
    exit it calls, becomes an InputError (exit 2) naming ``spec``. A failure whose
    innermost owned frame is composer_par's or a plugin's stays a bug (exit 3)."""
    from composer_par.tools.dryrun import DryRunError

    try:
        yield
    except (InputError, KeyboardInterrupt):
        raise
    except DryRunError as exc:
        raise InputError(str(exc)) from exc
    except BaseException as exc:
        if culprit(exc, user_module=spec.partition(":")[0]).kind != "user":
            raise
        if isinstance(exc, SystemExit):
            what = f"called sys.exit({exc.code!r})"
        else:
            what = f"raised {summary(exc)}"
        raise InputError(f"--model {spec}: the model code {what}; composer-par cannot use "
                         "this model (fix the model code, or give another factory)") from exc


# Ranks are counted from 0; everything else here counts from 1.
_positive_int = bounded_int(1)
_rank = bounded_int(0)


def _count(text: str) -> int:
    from composer_par.estimate import EstimateError, parse_count

    try:
        return parse_count(text)
    except EstimateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    from composer_par.estimate import EstimateError, parse_bytes

    try:
        return parse_bytes(text)
    except EstimateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_rate(unit: str, what: str) -> Callable[[str], float]:
    """An argparse type for a finite rate > 0 in ``unit`` (``what`` names it in errors)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {unit} as a number; got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite {what} > 0; got {text}")
        return value

    return parse


_gbps = _positive_rate("Gbit/s", "bandwidth")
_tflops = _positive_rate("TFLOP/s", "throughput")


def _compute_dtype(text: str) -> str:
    from composer_par.estimate import EstimateError
    from composer_par.estimate.units import compute_dtype

    try:
        return compute_dtype(text)
    except EstimateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dim_size(text: str) -> tuple[str, int]:
    """``DIM=N``: a mesh dim and the largest size suggest tries for it."""
    dim, sep, size = text.partition("=")
    if not sep or not dim.strip().isidentifier() or not size.strip().isdigit() \
            or int(size) < 1:
        raise argparse.ArgumentTypeError(f"expected DIM=N (a mesh dim and a size >= 1, e.g. "
                                         f"tp=4); got {text!r}")
    return dim.strip(), int(size)


def _plugin_option(text: str) -> tuple[str, str, Any]:
    """``PLUGIN.OPTION=VALUE``: a plugin's option for suggest, the value as in a plan file
    (TOML; a bare word is a string)."""
    import tomllib

    key, sep, value = text.partition("=")
    plugin, dot, option = key.strip().partition(".")
    if not sep or not dot or not plugin or not option.isidentifier():
        raise argparse.ArgumentTypeError(f"expected PLUGIN.OPTION=VALUE (e.g. "
                                         f"pp.schedule=Interleaved1F1B); got {text!r}")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return plugin, option, parsed


def _device_arguments(group: Any) -> None:  # an argparse argument group
    from composer_par.estimate.devices import DEVICES

    group.add_argument("--device", choices=sorted(DEVICES), metavar="KIND",
                       help="the device the step time is predicted on: "
                       + ", ".join(sorted(DEVICES)) + " (default h100)")
    group.add_argument("--device-tflops", type=_tflops, metavar="F",
                       help="TFLOP/s the step's matmuls achieve per device (default: a share "
                       "of the device's dense peak in the matmul dtype)")
    group.add_argument("--matmul-dtype", type=_compute_dtype, metavar="DTYPE",
                       help="the dtype the matmuls compute in, e.g. fp8 (default: what the "
                       "plan's plugins say, else --dtype)")


def _dtype(text: str) -> str:
    from composer_par.estimate import EstimateError, dtype_name

    try:
        return dtype_name(text)
    except EstimateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# -- validate --model ------------------------------------------------------------------------


def validate_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "dry run (imports torch): apply the plan to a model on meta over a fake process group")
    group.add_argument("--model", metavar="MODULE:FACTORY",
                       help="build this model on meta and dry-run the plan for --rank "
                       "(resolved like uvicorn: the current directory is on the path); or "
                       "a Hugging Face config.json, or a model directory holding one")
    group.add_argument("--rank", type=_rank, action="append", metavar="R",
                       help="dry-run this rank (repeatable; default: 0 and the last rank)")
    group.add_argument("--all-params", action="store_true",
                       help="list every parameter (default: identical blocks collapsed)")


def run_validate_model(args: argparse.Namespace, out: Output) -> int:
    plan, world = load_plan_for(args)
    from composer_par.tools.dryrun import dry_run, format_result

    with model_code(args.model):
        result = dry_run(plan, args.model, world_size=world, ranks=args.rank)
    topology = plan.effective_topology()
    code = result.exit_code()
    data = {
        "plan": args.plan, "world_size": result.world_size, "mesh": plan.mesh.to_dict(),
        "topology": topology.to_dict() if topology else None, "model": args.model,
        "exit_code": code, **result.report.to_dict(), "dry_run": result.to_dict(),
    }
    body = result.report.format()
    if not result.report.findings:
        body = out.paint(body, "ok")
    text = (f"{args.plan}: {situation(plan, result.world_size)}\n"
            f"{out.severities(body)}\n{format_result(result, full=args.all_params)}")
    failed = [r.rank for r in result.ranks if r.failure is not None]
    if failed:
        text += "\n" + out.paint("ERROR", "ERROR") + (
            f" applying the plan failed on rank(s) {', '.join(map(str, failed))}: a real "
            "run would fail there too")
    out.result(data, text)
    return code


# -- explain --svg ---------------------------------------------------------------------------


def explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--svg", metavar="FILE", type=Path,
                        help="also draw the layout (nodes x devices, rank groups per mesh dim) "
                        "and, for a pipeline, its schedule's timeline into this SVG file")


def layout_picture(
    explanation: Explanation, out: Output, svg: Path | None, title: str,
) -> tuple[str, dict[str, Any]]:
    """(text, data) of the layout picture: the terminal grid, and the SVG if asked."""
    from composer_par.tools.draw import (
        Grid,
        render_svg,
        render_text,
        render_timeline_svg,
        stack_svgs,
    )

    if not explanation.mesh.is_resolved or not explanation.groups:
        if svg is not None:
            raise InputError("cannot draw the layout: the world size is unknown (a mesh size "
                               "is -1); give --world-size or --nodes/--devices-per-node")
        return "", {"layout": None}
    grid = Grid.of(explanation.mesh, explanation.topology, explanation.groups)
    data: dict[str, Any] = {"layout": grid.to_dict()}
    text = render_text(grid, color=out.color)
    if svg is not None:
        try:
            # A pipeline's schedule timelines go below the layout, in the same file.
            drawn = [render_svg(grid, title=title),
                     *(render_timeline_svg(t) for t in explanation.timelines)]
            svg.write_text(drawn[0] if len(drawn) == 1 else stack_svgs(drawn),
                           encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot write {svg}: {exc.strerror or exc}") from exc
        data["svg"] = str(svg)
        text += f"\nSVG written to {svg}"
    return text, data


# -- the model of estimate and suggest -------------------------------------------------------


def _model_arguments(parser: argparse.ArgumentParser, *, required_seq: bool = True) -> None:
    from composer_par.estimate.presets import PRESETS

    model = parser.add_argument_group(
        "the model: --model, --preset, or --params with any of the sizes (the rest are "
        "derived)")
    model.add_argument("--model", metavar="MODULE:FACTORY",
                       help="measure this model, built on meta (imports torch); or a "
                       "Hugging Face config.json, or a model directory holding one")
    model.add_argument("--preset", choices=sorted(PRESETS), metavar="NAME",
                       help="a published model's shape: " + ", ".join(sorted(PRESETS)))
    model.add_argument("--params", type=_count, metavar="N",
                       help="parameter count: 13e9, 1.3B, 350M")
    model.add_argument("--layers", type=_positive_int, metavar="L", help="number of blocks")
    model.add_argument("--hidden", type=_positive_int, metavar="H", help="hidden size")
    model.add_argument("--heads", type=_positive_int, metavar="A", help="attention heads")
    model.add_argument("--kv-heads", type=_positive_int, metavar="K",
                       help="key/value heads (default: --heads)")
    model.add_argument("--ffn-hidden", type=_positive_int, metavar="F",
                       help="MLP hidden size (default: a 4x MLP)")
    model.add_argument("--vocab", type=_positive_int, metavar="V", help="vocabulary size")
    work = parser.add_argument_group("the workload")
    work.add_argument("--seq", type=_positive_int, required=required_seq, metavar="S",
                      help="sequence length (tokens)")
    work.add_argument("--micro-batch", type=_positive_int, default=1, metavar="B",
                      help="sequences per micro-batch per data-parallel rank (default 1)")
    work.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "none"), default="adamw",
                      help="optimizer whose states count (default adamw)")
    work.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                      help="sdpa (flash / memory-efficient: no attention scores kept; default) "
                      "or eager (s*s scores per head kept for backward)")
    links = parser.add_argument_group("link bandwidths per device, Gbit/s (override [topology])")
    links.add_argument("--intra-node-gbps", type=_gbps, metavar="G",
                       help="inside a node (default: the topology's, else 900)")
    links.add_argument("--inter-node-gbps", type=_gbps, metavar="G",
                       help="between nodes (default: the topology's, else 100)")


def model_shape(args: argparse.Namespace, plan: ParallelPlan | None) -> ModelShape:
    from composer_par.estimate import EstimateError, ModelShape

    sizes = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
             "kv_heads": args.kv_heads, "ffn_hidden": args.ffn_hidden, "vocab": args.vocab}
    if args.preset is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in
                 (("model", args.model), ("params", args.params), *sizes.items())
                 if v is not None]
        if given:
            raise InputError(f"give --preset or {', '.join(given)}, not both")
        from composer_par.estimate.presets import preset

        return preset(args.preset)
    if args.model is not None:
        if args.params is not None:
            raise InputError("give --model or --params, not both")
        from composer_par.tools.dryrun import build_on_meta, resolve_factory

        spec = plan.block_spec() if plan is not None else None
        overrides = {k: v for k, v in sizes.items() if k != "layers"}
        with model_code(args.model):
            model = build_on_meta(resolve_factory(args.model), args.model)
            return ModelShape.from_module(model, spec, source=args.model, **overrides)
    if args.params is None and (args.layers is None or args.hidden is None):
        raise InputError("give the model: --model MODULE:FACTORY, --preset NAME, or --params "
                           "N (with --layers/--hidden/--heads if known)")
    try:
        return ModelShape.from_numbers(params=args.params, **sizes)
    except EstimateError as exc:
        raise InputError(str(exc)) from exc


# -- estimate --------------------------------------------------------------------------------


def estimate_arguments(parser: argparse.ArgumentParser) -> None:
    plan_arguments(parser)
    _model_arguments(parser)
    work = parser.add_argument_group("precision and checkpointing (default: the plan's)")
    work.add_argument("--dtype", type=_dtype, metavar="DTYPE",
                      help="bf16, fp16 (16-bit mixed precision) or fp32; default: the plan's "
                      "mixed precision, else the model's dtype, else fp32")
    work.add_argument("--reduce-dtype", type=_dtype, metavar="DTYPE",
                      help="dtype of gradient reductions (default: the plan's, else --dtype)")
    work.add_argument("--activation-checkpoint", choices=("none", "selective", "full"),
                      help="default: the plan's activation_checkpoint plugin, else none")
    work.add_argument("--accumulate", "--grad-accum", dest="grad_accum", type=_positive_int,
                      default=1, metavar="K",
                      help="micro-batches per optimizer step, as the training step's "
                      "accumulate=K (default 1); with K > 1 every sync policy is shown")
    work.add_argument("--sync", choices=("last", "reduce_scatter", "every"), default="last",
                      help="when the accumulated gradients are reduced, as the training "
                      "step's sync= (default last: once per step)")
    work.add_argument("--device-memory", type=_size, metavar="SIZE",
                      help="device memory, e.g. 80GiB: say whether it fits (exit 1 if not)")
    _device_arguments(parser.add_argument_group("the step time"))


def run_estimate(args: argparse.Namespace, out: Output) -> int:
    from composer_par.estimate import EstimateError, Workload, estimate_plan

    plan, world = load_plan_for(args)
    report = plan.validate(world_size=world)
    if report.exit_code() == EXIT_INPUT:  # options only the plugins can check (CP5xx)
        raise PlanFileError(report, args.plan)
    shape = model_shape(args, plan)
    try:
        workload = Workload(seq=args.seq, micro_batch=args.micro_batch, dtype=args.dtype,
                            reduce_dtype=args.reduce_dtype, optimizer=args.optimizer,
                            activation_checkpoint=args.activation_checkpoint,
                            grad_accum=args.grad_accum, sync=args.sync,
                            attention=args.attention, matmul_dtype=args.matmul_dtype)
        est = estimate_plan(plan, shape, workload, world_size=world,
                            intra_node_gbps=args.intra_node_gbps,
                            inter_node_gbps=args.inter_node_gbps,
                            device_memory=args.device_memory, device=args.device,
                            device_tflops=args.device_tflops)
    except EstimateError as exc:
        raise InputError(str(exc)) from exc
    code = report.exit_code()
    if est.fits is False:
        code = max(code, EXIT_ERRORS)
    data = {"plan": args.plan, "world_size": est.layout.mesh.world_size, "exit_code": code,
            **est.to_dict(), "report": report.to_dict()}
    text = f"{args.plan}: estimate per rank and step\n{est.format(out.paint)}"
    if not report.ok:
        text += (f"\nthe plan has {len(report.errors)} error(s):\n"
                 + out.severities(report.format()))
    out.result(data, text)
    return code


# -- suggest ---------------------------------------------------------------------------------


def suggest_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("the cluster")

    ranks = bounded_int(1, MAX_RANKS)
    where.add_argument("--nodes", type=ranks, required=True, metavar="N")
    where.add_argument("--devices-per-node", type=ranks, required=True, metavar="M")
    where.add_argument("--device-memory", type=_size, required=True, metavar="SIZE",
                       help="memory per device, e.g. 80GiB or 80GB")
    _model_arguments(parser)
    work = parser.add_argument_group("precision and output")
    work.add_argument("--dtype", type=_dtype, default="bfloat16", metavar="DTYPE",
                      help="bf16 (default), fp16 or fp32: 16-bit means FSDP2 mixed precision "
                      "with fp32 gradient reduction")
    work.add_argument("--global-batch", type=_positive_int, metavar="N",
                      help="sequences per step over all ranks (default: --micro-batch x the "
                      "ranks); each layout's data shards split it")
    work.add_argument("--max-size", type=_dim_size, action="append", default=[],
                      metavar="DIM=N", help="the largest size to try for a mesh dim, e.g. "
                      "tp=4 (repeatable)")
    work.add_argument("--max-tp", type=_positive_int, metavar="T",
                      help="the same as --max-size tp=T")
    work.add_argument("--option", type=_plugin_option, action="append", default=[],
                      metavar="PLUGIN.OPTION=VALUE",
                      help="make a plugin with this option for every layout it joins, e.g. "
                      "pp.schedule=Interleaved1F1B (repeatable; the value as in a plan file)")
    _device_arguments(where)
    work.add_argument("--top", type=_positive_int, default=10, metavar="N",
                      help="runners-up to list (default 10)")
    work.add_argument("--no-progress", action="store_true",
                      help="no progress line on stderr (shown when the search takes over "
                      "a second)")
    work.add_argument("--output", "-o", type=Path, metavar="FILE",
                      help="also write the best plan file here")


class LayoutProgress:
    """How many of suggest's layouts have been gone through, on stderr (stdout keeps the
    answer, JSON or text): silent for the first second, then redrawn in place on a
    terminal, one line per tenth otherwise."""

    def __init__(self, stream: Any, *, quiet_for: float = 1.0) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.started = time.perf_counter()
        self.quiet_for = quiet_for
        self.last_draw = 0.0
        self.last_tenth = -1
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.started < self.quiet_for and done < total:
            return
        line = f"suggest: {done:,} of {total:,} layouts ({done / max(total, 1):.0%})"
        if self.tty:
            if now - self.last_draw < 0.1 and done < total:
                return
            self.last_draw = now
            self.stream.write("\r" + line)
        else:
            tenth = done * 10 // max(total, 1)
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            self.stream.write(line + "\n")
        self.shown = True
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write(("\n" if self.tty else "") + f"suggest: done in "
                              f"{time.perf_counter() - self.started:.1f} s\n")
            self.stream.flush()


def run_suggest(args: argparse.Namespace, out: Output) -> int:
    from composer_par.estimate import EstimateError
    from composer_par.tools.suggest import format_suggestion, suggest
    from composer_par.topology import Topology

    if args.nodes * args.devices_per_node > 2**17:
        raise InputError(f"{args.nodes} nodes x {args.devices_per_node} devices is too many "
                           "ranks")
    shape = model_shape(args, None)
    topology = Topology(nodes=args.nodes, devices_per_node=args.devices_per_node)
    max_sizes = dict(args.max_size)
    if args.max_tp is not None:
        max_sizes["tp"] = args.max_tp
    options: dict[str, dict[str, Any]] = {}
    for plugin, option, value in args.option:
        options.setdefault(plugin, {})[option] = value
    progress = None if args.no_progress else LayoutProgress(out.stderr)
    try:
        result = suggest(shape, topology, args.device_memory, seq=args.seq,
                         micro_batch=args.micro_batch, global_batch=args.global_batch,
                         dtype=args.dtype, optimizer=args.optimizer,
                         intra_node_gbps=args.intra_node_gbps,
                         inter_node_gbps=args.inter_node_gbps, max_sizes=max_sizes,
                         attention=args.attention, options=options, device=args.device,
                         device_tflops=args.device_tflops, matmul_dtype=args.matmul_dtype,
                         progress=progress)
    except EstimateError as exc:
        raise InputError(str(exc)) from exc
    finally:
        if progress is not None:
            progress.close()
    code = EXIT_OK if result.best is not None else EXIT_ERRORS
    data = {"exit_code": code, **result.to_dict()}
    text = format_suggestion(result, top=args.top, paint=out.paint)
    if args.output is not None and result.plan_toml is not None:
        try:
            args.output.write_text(result.plan_toml, encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot write {args.output}: {exc.strerror or exc}") from exc
        data["output"] = str(args.output)
        text += f"\nplan file written to {args.output}"
    out.result(data, text)
    return code


__all__ = [
    "LayoutProgress",
    "estimate_arguments",
    "explain_arguments",
    "layout_picture",
    "model_code",
    "model_shape",
    "run_estimate",
    "run_suggest",
    "run_validate_model",
    "suggest_arguments",
    "validate_arguments",
]
