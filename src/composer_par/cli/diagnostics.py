"""The CLI glue of the pre-flight commands: ``env`` (the machine, for a bug report),
``compare`` (two runs side by side) and ``selfcheck`` (the ladder of rungs before a long
run). The work is done in :mod:`composer_par.tools.environment`,
:mod:`composer_par.tools.compare` and :mod:`composer_par.tools.selfcheck`.
"""

from __future__ import annotations

import argparse

from composer_par.cli.common import EXIT_ERRORS, EXIT_OK, InputError, Output, bounded_int


def env_arguments(parser: argparse.ArgumentParser) -> None:
    """``env`` takes no arguments besides --json."""


def run_env(args: argparse.Namespace, out: Output) -> int:
    from composer_par.tools.environment import collect, format_environment

    data = collect()
    out.result(data, format_environment(data))
    return EXIT_OK


def _tolerance(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0; got {text}")
    return value


def compare_arguments(parser: argparse.ArgumentParser) -> None:
    from composer_par.tools.compare import ATOL, RTOL

    parser.add_argument("a", metavar="A", help="a run: a JSON log (demo/selfcheck --json, "
                        "or composer_par.tools.compare.run_log) or a checkpoint")
    parser.add_argument("b", metavar="B", help="the other run (the reference of --rtol)")
    parser.add_argument("--rtol", type=_tolerance, default=RTOL,
                        help=f"relative tolerance (default {RTOL:g}, fp32 parity)")
    parser.add_argument("--atol", type=_tolerance, default=ATOL,
                        help=f"absolute tolerance (default {ATOL:g})")
    parser.add_argument("--assert-equal", action="store_true",
                        help="bit for bit: --rtol 0 --atol 0")
    parser.add_argument("--rung", type=bounded_int(1), metavar="RANKS",
                        help="in a selfcheck log, the rung of this many ranks (default: "
                        "the last)")


def run_compare(args: argparse.Namespace, out: Output) -> int:
    from contextlib import ExitStack

    from composer_par.tools.compare import CompareError, compare, load_run

    rtol, atol = (0.0, 0.0) if args.assert_equal else (args.rtol, args.atol)
    with ExitStack() as stack:
        try:
            a = load_run(args.a, rung=args.rung, stack=stack)
            b = load_run(args.b, rung=args.rung, stack=stack)
        except CompareError as exc:
            raise InputError(str(exc)) from exc
        if (a.losses is None or b.losses is None) and not (a.has_parameters
                                                            and b.has_parameters):
            raise InputError(f"nothing to compare: {args.a} and {args.b} share neither "
                             "losses nor parameters")
        result = compare(a, b, rtol=rtol, atol=atol)
    code = EXIT_OK if result.equal else EXIT_ERRORS
    out.result({"ok": result.equal, "exit_code": code, **result.to_dict()}, result.format())
    return code


__all__ = ["compare_arguments", "env_arguments", "run_compare", "run_env"]
