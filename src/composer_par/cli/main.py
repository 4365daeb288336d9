"""``composer-par``: check and explain plans, list plugins and rule codes.

Every subcommand has ``--help`` and ``--json`` (only JSON on stdout; messages go to
stderr). Exit codes, the same for every subcommand:

* 0 -- done; the plan is clean or has warnings only
* 1 -- the plan has errors (or a plugin failed to load)
* 2 -- the input could not be read: bad command line, missing file, bad TOML,
  unknown plugin or option (findings CP5xx)

The static commands never import torch, so they answer in a fraction of a second on a
laptop. A subcommand is one :class:`Command` in :data:`COMMANDS`: its arguments and
its ``run(args, out) -> exit code``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import attrs

if TYPE_CHECKING:
    from composer_par.findings import Report
    from composer_par.plan import ParallelPlan
    from composer_par.topology import Topology

PROG = "composer-par"
EPILOG = ("exit codes: 0 done (clean or warnings only), 1 the plan has errors, "
          "2 unreadable input or bad command line")
DESCRIPTION = ("Check and explain parallelism plans; list plugins and rule codes. "
               "Exit codes: 0 ok, 1 the plan has errors, 2 unreadable input.")
EXIT_OK, EXIT_ERRORS, EXIT_INPUT = 0, 1, 2
# Set to see the traceback of an unexpected failure instead of its one-line summary.
TRACEBACK_ENV = "COMPOSER_PAR_TRACEBACK"


class InputError(Exception):
    """The command line or its input cannot be used: a one-line message, exit 2."""


# -- output --------------------------------------------------------------------------------

_COLORS = {"ERROR": "31", "WARNING": "33", "INFO": "36", "ok": "32"}
_SEVERITY_AT_START = re.compile(r"^(ERROR|WARNING|INFO)\b", re.MULTILINE)


def use_color(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Color only on a terminal, and never when NO_COLOR is set (no-color.org)."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR") or env.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Output:
    """Where a command's result goes: text (maybe colored) or one JSON document."""

    def __init__(self, *, json_mode: bool, stdout: TextIO, stderr: TextIO) -> None:
        self.json_mode = json_mode
        self.stdout = stdout
        self.stderr = stderr
        self.color = not json_mode and use_color(stdout)

    def result(self, data: dict[str, Any], text: str) -> None:
        """The command's answer: ``data`` as JSON with --json, else ``text``."""
        if self.json_mode:
            self.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        else:
            self.stdout.write(text.rstrip("\n") + "\n")

    def note(self, text: str) -> None:
        """A side remark for humans: stderr, so stdout stays the answer."""
        self.stderr.write(text + "\n")

    def error(self, message: str) -> None:
        first_line = message.strip().splitlines()[0] if message.strip() else "failed"
        self.stderr.write(f"{PROG}: error: {first_line}\n")
        if self.json_mode:
            self.stdout.write(json.dumps({"ok": False, "error": first_line,
                                          "exit_code": EXIT_INPUT}) + "\n")

    def paint(self, text: str, style: str) -> str:
        return f"\x1b[{_COLORS[style]}m{text}\x1b[0m" if self.color else text

    def severities(self, text: str) -> str:
        """Color the ERROR/WARNING/INFO word that starts a finding's line."""
        if not self.color:
            return text
        return _SEVERITY_AT_START.sub(lambda m: self.paint(m.group(1), m.group(1)), text)


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in (header, *rows)]
    return "\n".join(lines)


# -- commands ------------------------------------------------------------------------------


@attrs.frozen
class Command:
    """One subcommand: ``configure`` adds its arguments, ``run`` does it and returns the
    exit code. Add a subcommand by appending one to :data:`COMMANDS`."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Output], int]


def bounded_int(lowest: int, highest: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int from ``lowest`` to ``highest`` (None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int; got {text!r}") from None
        if value < lowest or (highest is not None and value > highest):
            wanted = f">= {lowest}" if highest is None else f"from {lowest} to {highest}"
            raise argparse.ArgumentTypeError(f"expected an int {wanted}; got {value}")
        return value

    return parse


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from composer_par.planfile import MAX_RANKS

    ranks = bounded_int(1, MAX_RANKS)
    parser.add_argument("plan", metavar="PLAN.toml", help="the plan file ('-' reads stdin)")
    group = parser.add_argument_group("where it runs (overrides the plan's [topology])")
    group.add_argument("--nodes", type=ranks, metavar="N", help="number of nodes")
    group.add_argument("--devices-per-node", type=ranks, metavar="M",
                       help="devices (ranks) per node")
    group.add_argument("--world-size", type=ranks, metavar="N",
                       help="number of ranks (default: the topology's, else the mesh's)")


def load_plan_for(args: argparse.Namespace) -> tuple[ParallelPlan, int | None]:
    """The plan named on the command line with the flags applied, and its world size.

    Raises PlanFileError for an unreadable plan, InputError for contradictory flags.
    """
    from composer_par.plan import ParallelPlan
    from composer_par.planfile import parse, parts_from_data

    if args.plan == "-":
        plan = ParallelPlan.from_parts(parts_from_data(parse(sys.stdin.read(), "<stdin>"),
                                                       name="<stdin>"))
    else:
        plan = ParallelPlan.from_toml(Path(args.plan))
    plan.topology = _topology(plan, args)
    world = args.world_size if args.world_size is not None else plan.world_size()
    return plan, world


def _topology(plan: ParallelPlan, args: argparse.Namespace) -> Topology | None:
    """The plan's [topology] with --nodes / --devices-per-node laid over it. One flag
    alone derives the other from the world size (--world-size, else the mesh's), or
    failing that keeps it from the file."""
    from composer_par.planfile import MAX_RANKS
    from composer_par.topology import Topology

    nodes, per_node, base = args.nodes, args.devices_per_node, plan.topology
    if nodes is None and per_node is None:
        return base
    if nodes is None or per_node is None:
        given = nodes or per_node
        world = args.world_size or (plan.mesh.world_size if plan.mesh.is_resolved else None)
        if world is not None and world % given == 0:
            other = world // given
        elif base is not None:
            other = base.devices_per_node if per_node is None else base.nodes
        else:
            flag = "--devices-per-node" if per_node is None else "--nodes"
            raise InputError(f"give {flag} too: it cannot be derived"
                             + (f" ({world} ranks on {given})" if world else ""))
        nodes, per_node = (given, other) if per_node is None else (other, given)
    if nodes * per_node > MAX_RANKS:
        raise InputError(f"{nodes} nodes x {per_node} devices is more than {MAX_RANKS} ranks")
    if base is not None:
        return attrs.evolve(base, nodes=nodes, devices_per_node=per_node)
    return Topology(nodes=nodes, devices_per_node=per_node)


def _situation(plan: ParallelPlan, world: int | None) -> str:
    text = plan.mesh.equation(world)
    topology = plan.effective_topology()
    if topology is not None:
        text += f" on {topology.describe()}"
    return text


def _plan_file_failure(args: argparse.Namespace, out: Output, report: Report) -> int:
    """A plan file that could not be read: its CP5xx findings, exit 2."""
    data = {"plan": args.plan, "exit_code": EXIT_INPUT, **report.to_dict()}
    text = f"{args.plan}: cannot read the plan\n{out.severities(report.format())}"
    out.result(data, text)
    return EXIT_INPUT


def run_validate(args: argparse.Namespace, out: Output) -> int:
    from composer_par.planfile import PlanFileError

    if getattr(args, "model", None):  # the dry run (imports torch)
        return _module("cli.plan_tools").run_validate_model(args, out)
    try:
        plan, world = load_plan_for(args)
    except PlanFileError as exc:
        return _plan_file_failure(args, out, exc.report)
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
    text = f"{args.plan}: {_situation(plan, world)}\n{out.severities(body)}"
    out.result(data, text)
    if world is None:
        out.note("note: the world size is unknown (a mesh size is -1): "
                 "pass --world-size or --nodes/--devices-per-node to check the mesh equation")
    return code


def run_explain(args: argparse.Namespace, out: Output) -> int:
    from composer_par.planfile import PlanFileError
    from composer_par.plugin.caller import HookError

    try:
        plan, world = load_plan_for(args)
    except PlanFileError as exc:
        return _plan_file_failure(args, out, exc.report)
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
        picture, layout = _module("cli.plan_tools").layout_picture(
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
    from composer_par.findings import RULES

    rules = sorted(RULES.values(), key=lambda r: r.code)
    data = {"rules": [{"code": r.code, "severity": r.severity.value, "title": r.title}
                      for r in rules]}
    cells = [(r.code, r.severity.value, r.title) for r in rules]
    out.result(data, table(cells, ("CODE", "SEVERITY", "TITLE")))
    return EXIT_OK


def _module(name: str) -> Any:
    """A subcommand's module, imported on use: the static commands stay fast and never
    import torch (the before-launch tools, the checkpoint tools, the demo)."""
    return importlib.import_module(f"composer_par.{name}")


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    _plan_arguments(parser)
    _module("cli.plan_tools").validate_arguments(parser)


def _explain_arguments(parser: argparse.ArgumentParser) -> None:
    _plan_arguments(parser)
    _module("cli.plan_tools").explain_arguments(parser)


COMMANDS: list[Command] = [
    Command("validate", "check a plan file without processes or torch; with --model, dry-run "
            "it on a fake process group", _validate_arguments, run_validate),
    Command("explain", "the steps each plugin takes and the rank groups of each mesh dim",
            _explain_arguments, run_explain),
    Command("plugins", "the installed plugins: version, distribution, claims, stages",
            lambda parser: None, run_plugins),
    Command("rules", "the catalog of validation rule codes", lambda parser: None, run_rules),
    Command("demo", "train a small Llama with a plan on local processes (torch's launcher)",
            lambda p: _module("tools.demo").add_arguments(p),
            lambda a, o: _module("tools.demo").run(a, o)),
    Command("inspect", "keys, shapes, dtypes, bytes, commit state and saved plan of a checkpoint "
            "(DCP or safetensors)",
            lambda p: _module("cli.checkpoint").configure_inspect(p),
            lambda a, o: _module("cli.checkpoint").run_inspect(a, o)),
    Command("convert", "convert a checkpoint DCP <-> safetensors, streaming, with progress",
            lambda p: _module("cli.checkpoint").configure_convert(p),
            lambda a, o: _module("cli.checkpoint").run_convert(a, o)),
    Command("estimate", "per-rank memory and per-mesh-dim communication of a plan",
            lambda p: _module("cli.plan_tools").estimate_arguments(p),
            lambda a, o: _module("cli.plan_tools").run_estimate(a, o)),
    Command("suggest", "rank candidate layouts for a model and a cluster; print the best plan",
            lambda p: _module("cli.plan_tools").suggest_arguments(p),
            lambda a, o: _module("cli.plan_tools").run_suggest(a, o)),
]



# -- entry point ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Raises instead of exiting, so main() decides the output and the exit code."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from composer_par import __version__

    # No abbreviations: `--node` must not silently mean --nodes (nor change meaning when
    # an option is added later).
    parser = _Parser(prog=PROG, allow_abbrev=False, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    # --json is accepted before or after the subcommand; SUPPRESS keeps the subcommand's
    # default from overwriting a --json given before it.
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help,
                               epilog=EPILOG, allow_abbrev=False)
        child.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                           help="machine-readable output on stdout (only JSON there)")
        command.configure(child)
        child.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (tests call this in-process)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    out = Output(json_mode="--json" in args_list, stdout=sys.stdout, stderr=sys.stderr)
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(args_list)
        except SystemExit as exc:  # --help and --version print, then exit 0
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        if args.command is None:
            parser.print_help(sys.stderr)
            raise InputError(f"choose a command: {', '.join(c.name for c in COMMANDS)}")
        out = Output(json_mode=args.json, stdout=sys.stdout, stderr=sys.stderr)
        return int(args.run(args, out))
    except InputError as exc:
        out.error(str(exc))
        return EXIT_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # bad input must never end in a traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        out.error(f"{type(exc).__name__}: {exc}")
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
