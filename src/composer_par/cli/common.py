"""What every subcommand shares: exit codes, output, argument types, the plan arguments,
the one way a plan file is loaded, and the one way a failure ends a command.

Exit codes, the same for every subcommand:

* 0 -- done; the plan is clean or has warnings only
* 1 -- the plan has errors (or a plugin failed to load, or the estimate does not fit)
* 2 -- the input could not be used: bad command line, missing or unreadable file (a plan
  file over ``planfile.MAX_PLAN_BYTES`` included), bad TOML, unknown plugin or option
  (findings CP5xx), or model code given with ``--model`` that raised or exited
* 3 -- an internal error: a bug in composer_par or in an installed plugin (the message
  says which); ``COMPOSER_PAR_TRACEBACK=1`` prints its traceback
* 130 -- interrupted (Ctrl-C)

With ``--json`` stdout holds exactly one JSON document whatever happens; messages go to
stderr. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from composer_par.cli.failures import culprit, summary
from composer_par.planfile import MAX_RANKS, PlanFileError

if TYPE_CHECKING:
    from composer_par.findings import Report
    from composer_par.plan import ParallelPlan
    from composer_par.topology import Topology

PROG = "composer-par"
EXIT_OK, EXIT_ERRORS, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130
EXIT_CODES = ("exit codes: 0 done (clean or warnings only), 1 the plan has errors, "
              "2 unreadable input or bad command line, 3 internal error (a bug in "
              "composer_par or a plugin; COMPOSER_PAR_TRACEBACK=1 shows the traceback)")
# Set to print the traceback of an internal error after its summary.
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
        self.documents = 0  # JSON documents written: at most one

    def result(self, data: dict[str, Any], text: str) -> None:
        """The command's answer: ``data`` as JSON with --json, else ``text``."""
        if self.json_mode:
            if self.documents:
                raise RuntimeError("a command wrote a second JSON document")
            self.documents += 1
            self.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        else:
            self.stdout.write(text.rstrip("\n") + "\n")

    def note(self, text: str) -> None:
        """A side remark for humans: stderr, so stdout stays the answer."""
        self.stderr.write(text + "\n")

    def error(self, message: str, *, exit_code: int = EXIT_INPUT,
              notes: Sequence[str] = (), data: Mapping[str, Any] | None = None) -> int:
        """A failure: its first line (and ``notes``) on stderr and, with --json, as the
        document when none was written yet. Returns ``exit_code``."""
        first_line = message.strip().splitlines()[0] if message.strip() else "failed"
        label = "internal error" if exit_code == EXIT_INTERNAL else "error"
        self.stderr.write(f"{PROG}: {label}: {first_line}\n")
        for line in notes:
            self.stderr.write(f"  {line}\n")
        if self.json_mode and not self.documents:
            self.result({"ok": False, "error": first_line, "exit_code": exit_code,
                         **(data or {})}, "")
        return exit_code

    def finish(self, code: int) -> int:
        """The end of a command: with --json, a document even when the command wrote
        none (it reported on stderr only)."""
        if self.json_mode and not self.documents:
            data: dict[str, Any] = {"ok": code == EXIT_OK, "exit_code": code}
            if code != EXIT_OK:
                data["error"] = "see the messages on stderr"
            self.result(data, "")
        return code

    def paint(self, text: str, style: str) -> str:
        return f"\x1b[{_COLORS[style]}m{text}\x1b[0m" if self.color else text

    def severities(self, text: str) -> str:
        """Color the ERROR/WARNING/INFO word that starts a finding's line."""
        if not self.color:
            return text
        return _SEVERITY_AT_START.sub(lambda m: self.paint(m.group(1), m.group(1)), text)


# -- commands and argument types -------------------------------------------------------------


@attrs.frozen
class Command:
    """One subcommand: ``configure`` adds its arguments, ``run`` does it and returns the
    exit code. Add a subcommand by appending one to ``composer_par.cli.main.COMMANDS``."""

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


def bounded_float(above: float, highest: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number greater than ``above``, at most ``highest``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
        if not math.isfinite(value) or value <= above or (highest is not None
                                                           and value > highest):
            wanted = f"> {above:g}" + (f" and <= {highest:g}" if highest is not None else "")
            raise argparse.ArgumentTypeError(f"expected a finite number {wanted}; got {text}")
        return value

    return parse


# -- the plan file ---------------------------------------------------------------------------


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    """PLAN.toml and the flags that say where it runs (override its [topology])."""
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

    The one way a command loads its plan: an unreadable plan raises PlanFileError, which
    :func:`fail` turns into its CP5xx findings and exit 2; contradictory flags and a
    broken torchrun environment raise InputError.
    """
    from composer_par.plan import ParallelPlan
    from composer_par.planfile import parse, parts_from_data, read_source
    from composer_par.topology import TopologyError

    if args.plan == "-":
        # Bytes when there are: the bound is on bytes, and the decoding is the file's.
        text, name = read_source(getattr(sys.stdin, "buffer", sys.stdin))
        plan = ParallelPlan.from_parts(parts_from_data(parse(text, name), name=name))
    else:
        plan = ParallelPlan.from_toml(Path(args.plan))
    try:
        plan.topology = _topology(plan, args)
        world = args.world_size if args.world_size is not None else plan.world_size()
        plan.effective_topology()
    except TopologyError as exc:  # from torchrun's variables: the environment is input
        raise InputError(f"TopologyError: {exc}") from exc
    return plan, world


def _topology(plan: ParallelPlan, args: argparse.Namespace) -> Topology | None:
    """The plan's [topology] with --nodes / --devices-per-node laid over it. One flag
    alone derives the other from the world size (--world-size, else the mesh's), or
    failing that keeps it from the file."""
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


def situation(plan: ParallelPlan, world: int | None) -> str:
    """The mesh equation, and the topology it lies on when one is known."""
    text = plan.mesh.equation(world)
    topology = plan.effective_topology()
    if topology is not None:
        text += f" on {topology.describe()}"
    return text


def unreadable_plan(out: Output, name: str, report: Report) -> int:
    """A plan that could not be read: its CP5xx findings, exit 2."""
    data = {"plan": name, "exit_code": EXIT_INPUT, **report.to_dict()}
    out.result(data, f"{name}: cannot read the plan\n{out.severities(report.format())}")
    return EXIT_INPUT


# -- how a command ends when it raised -------------------------------------------------------


def fail(exc: BaseException, out: Output, args: argparse.Namespace | None,
         argv: Sequence[str]) -> int:
    """The exit code of a command that raised ``exc``, after saying what happened.

    Input (InputError, an unreadable plan, an OSError on a file named on the command
    line) is exit 2; Ctrl-C is 130; anything else is a bug, exit 3, and the message
    names whose bug it is and how to see the traceback.
    """
    if isinstance(exc, InputError):
        return out.error(str(exc))
    if isinstance(exc, PlanFileError):
        name = getattr(args, "plan", None) or exc.source or "the plan"
        return unreadable_plan(out, str(name), exc.report)
    if isinstance(exc, KeyboardInterrupt):
        return out.error("interrupted", exit_code=EXIT_INTERRUPTED)
    if isinstance(exc, OSError) and _names_an_argument(exc, argv):
        reason = exc.strerror or str(exc)
        return out.error(f"cannot read {exc.filename}: {reason}")
    owner = culprit(exc)
    from composer_par import __version__

    bug = (f"this is a bug in composer_par {__version__}, not in your input: please report it"
           if owner.kind == "composer_par" else
           f"this is a bug in {owner.describe()}, not in composer_par or your input: please "
           "report it to the plugin's authors")
    show = os.environ.get(TRACEBACK_ENV)
    notes = [bug, "the traceback is below" if show else
             f"set {TRACEBACK_ENV}=1 to see the traceback"]
    code = out.error(summary(exc), exit_code=EXIT_INTERNAL, notes=notes,
                     data={"internal": True, "culprit": owner.describe()})
    if show:
        traceback.print_exception(exc, file=out.stderr)
    return code


def _names_an_argument(exc: OSError, argv: Sequence[str]) -> bool:
    """Whether the file ``exc`` is about is one named on the command line, or inside a
    directory named there (``--flag=PATH`` included)."""
    named = [exc.filename, exc.filename2]
    paths = [os.fsdecode(p) for p in named if isinstance(p, str | bytes)]
    if not paths:
        return False
    given = []
    for word in argv:
        text = word.partition("=")[2] if word.startswith("--") else word
        if text and text != "-":
            given.append(os.path.abspath(text))
    for path in map(os.path.abspath, paths):
        for arg in given:
            if path == arg or path.startswith(arg.rstrip(os.sep) + os.sep):
                return True
    return False


__all__ = [
    "EXIT_CODES",
    "EXIT_ERRORS",
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "PROG",
    "TRACEBACK_ENV",
    "Command",
    "InputError",
    "Output",
    "bounded_float",
    "bounded_int",
    "fail",
    "load_plan_for",
    "plan_arguments",
    "situation",
    "unreadable_plan",
    "use_color",
]
