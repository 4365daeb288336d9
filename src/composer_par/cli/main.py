"""``composer-par``: check and explain plans, list plugins and rule codes, estimate,
suggest, dry-run, inspect, clean and convert checkpoints, run a demo, and run the
lighthouse of fault-tolerant replica groups.

This module holds the list of subcommands, the parser and :func:`main`; the subcommands
live in modules by topic (:mod:`~composer_par.cli.plan_commands`,
:mod:`~composer_par.cli.plan_tools`, :mod:`~composer_par.cli.checkpoint`,
:mod:`~composer_par.cli.demo`, :mod:`~composer_par.cli.lighthouse`) and share
:mod:`~composer_par.cli.common`.

Every subcommand has ``--help`` and ``--json`` (exactly one JSON document on stdout,
whatever happens; messages go to stderr). Exit codes, the same for every subcommand:

* 0 -- done; the plan is clean or has warnings only
* 1 -- the plan has errors (or a plugin failed to load)
* 2 -- the input could not be used: bad command line, missing or unreadable file, bad
  TOML, unknown plugin or option (findings CP5xx), ``--model`` code that failed
* 3 -- an internal error: a bug in composer_par or in an installed plugin; the message
  says which, and ``COMPOSER_PAR_TRACEBACK=1`` prints the traceback
* 130 -- interrupted

The static commands never import torch, so they answer in a fraction of a second on a
laptop. A subcommand is one :class:`~composer_par.cli.common.Command` in
:data:`COMMANDS`: its arguments and its ``run(args, out) -> exit code``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Sequence
from typing import NoReturn

from composer_par.cli import (
    checkpoint,
    demo,
    diagnostics,
    launch,
    lighthouse,
    migrate,
    plan_commands,
    plan_tools,
)
from composer_par.cli.common import (
    EXIT_CODES,
    EXIT_OK,
    PROG,
    Command,
    InputError,
    Output,
    fail,
)

DESCRIPTION = ("Check and explain parallelism plans; list plugins and rule codes. "
               "Exit codes: 0 ok, 1 the plan has errors, 2 unreadable input, "
               "3 internal error.")

COMMANDS: list[Command] = [
    Command("validate", "check a plan file without processes or torch; with --model, dry-run "
            "it on a fake process group", plan_commands.validate_arguments,
            plan_commands.run_validate),
    Command("explain", "the steps each plugin takes and the rank groups of each mesh dim",
            plan_commands.explain_arguments, plan_commands.run_explain),
    Command("plugins", "the installed plugins: version, distribution, claims, stages",
            plan_commands.no_arguments, plan_commands.run_plugins),
    Command("rules", "the catalog of validation rule codes", plan_commands.no_arguments,
            plan_commands.run_rules),
    Command("demo", "train a small Llama with a plan on local processes (torch's launcher)",
            demo.configure_demo, demo.run_demo),
    Command("inspect", "keys, shapes, dtypes, bytes, commit state and saved plan of a checkpoint "
            "(DCP or safetensors)", checkpoint.configure_inspect, checkpoint.run_inspect),
    Command("clean", "remove a checkpoint root's stale unfinished steps and, with "
            "--keep-last, each run's older committed ones (an age, a dry run)",
            checkpoint.configure_clean, checkpoint.run_clean),
    Command("convert", "convert a checkpoint DCP <-> safetensors, or DeepSpeed ZeRO to either",
            checkpoint.configure_convert, checkpoint.run_convert),
    Command("estimate", "per-rank memory and per-mesh-dim communication of a plan",
            plan_tools.estimate_arguments, plan_tools.run_estimate),
    Command("suggest", "rank candidate layouts for a model and a cluster; print the best plan",
            plan_tools.suggest_arguments, plan_tools.run_suggest),
    Command("env", "versions, devices, interconnect, inferred topology and plugins, for a "
            "bug report", diagnostics.env_arguments, diagnostics.run_env),
    Command("compare", "two runs side by side (JSON logs or checkpoints): losses per step, "
            "parameters, the first divergent step", diagnostics.compare_arguments,
            diagnostics.run_compare),
    Command("selfcheck", "the pre-flight ladder: train a plan on 1, 2, N local ranks against "
            "a one-process baseline; losses, parameters, samples, memory, step time, "
            "collectives", diagnostics.selfcheck_arguments, diagnostics.run_selfcheck),
    Command("import", "a plan file from an accelerate config, a DeepSpeed JSON or the "
            "Trainer's --fsdp / --deepspeed", migrate.import_arguments, migrate.run_import),
    Command("launch", "a plan's job for SLURM (sbatch), Kubernetes (Kubeflow TrainJob or "
            "PyTorchJob) or torchrun on each node; the script after --",
            launch.launch_arguments, launch.run_launch),
    Command("lighthouse", "run torchft's lighthouse, where fault-tolerant replica groups "
            "(the ft plugin) form each step's quorum", lighthouse.lighthouse_arguments,
            lighthouse.run_lighthouse),
]

# Commands whose words after "--" are another program's command line (kept whole, out of
# argparse's reach: it would take them for this command's options).
TRAILING_COMMANDS = frozenset({"launch"})


def split_trailing(args_list: list[str]) -> tuple[list[str], list[str] | None]:
    """``(words to parse, words after "--")`` for a command in TRAILING_COMMANDS; the
    words unchanged and None for any other."""
    command = next((w for w in args_list if not w.startswith("-")), None)
    if command not in TRAILING_COMMANDS or "--" not in args_list:
        return args_list, None
    cut = args_list.index("--")
    return args_list[:cut], args_list[cut + 1:]


class _Parser(argparse.ArgumentParser):
    """Raises instead of exiting, so main() decides the output and the exit code."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from composer_par import __version__

    # No abbreviations: `--node` must not silently mean --nodes (nor change meaning when
    # an option is added later).
    parser = _Parser(prog=PROG, allow_abbrev=False, description=DESCRIPTION, epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    # --json is accepted before or after the subcommand; SUPPRESS keeps the subcommand's
    # default from overwriting a --json given before it.
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help,
                               epilog=EXIT_CODES, allow_abbrev=False)
        child.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                           help="machine-readable output on stdout (only JSON there)")
        command.configure(child)
        child.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (tests call this in-process)."""
    args_list, trailing = split_trailing(list(sys.argv[1:] if argv is None else argv))
    # Before parsing, --json anywhere on the line decides, so that a bad command line
    # gets its JSON document too.
    out = Output(json_mode="--json" in args_list, stdout=sys.stdout, stderr=sys.stderr)
    args = None
    try:
        parser = build_parser()
        printed = io.StringIO()
        try:
            # --help and --version print and exit 0; with --json their text goes into
            # the one document.
            with contextlib.redirect_stdout(printed) if out.json_mode else \
                    contextlib.nullcontext():
                args = parser.parse_args(args_list)
            args.trailing = trailing
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else EXIT_OK
            if out.json_mode:
                out.result({"ok": code == EXIT_OK, "exit_code": code,
                            "text": printed.getvalue()}, "")
            return code
        if args.command is None:
            if not out.json_mode:
                parser.print_help(sys.stderr)
            raise InputError(f"choose a command: {', '.join(c.name for c in COMMANDS)}")
        out = Output(json_mode=args.json, stdout=sys.stdout, stderr=sys.stderr)
        # With --json, whatever else writes to stdout (a plugin, the user's model code)
        # goes to stderr: stdout holds only the document.
        with contextlib.redirect_stdout(sys.stderr) if out.json_mode else \
                contextlib.nullcontext():
            code = int(args.run(args, out))
        return out.finish(code)
    except BaseException as exc:  # every way a command ends gets its exit code
        return fail(exc, out, args, args_list)


__all__ = ["COMMANDS", "build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())
