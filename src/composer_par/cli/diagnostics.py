"""The CLI glue of the pre-flight commands: ``env`` (the machine, for a bug report),
``compare`` (two runs side by side) and ``selfcheck`` (the ladder of rungs before a long
run). The work is done in :mod:`composer_par.tools.environment`,
:mod:`composer_par.tools.compare` and :mod:`composer_par.tools.selfcheck`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from composer_par.cli.common import (
    EXIT_ERRORS,
    EXIT_INPUT,
    EXIT_OK,
    InputError,
    Output,
    bounded_int,
)


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
    parser.add_argument("--full-table", action="store_true",
                        help="print (and with --json, give) the loss of every step; by "
                        "default a table longer than 50 steps is summarized: the first "
                        "and last steps, those around the first divergence and those of "
                        "the largest differences")
    parser.add_argument("--rung", type=bounded_int(1), metavar="RANKS",
                        help="in a selfcheck log, the rung of this many ranks (default: "
                        "the last); other logs ignore it")


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
    out.result({"ok": result.equal, "exit_code": code, **result.to_dict(args.full_table)},
               result.format(args.full_table))
    return code


def selfcheck_arguments(parser: argparse.ArgumentParser) -> None:
    from composer_par.cli.common import bounded_float

    parser.add_argument("plan", metavar="PLAN", help="a plan file, or MODULE:FUNCTION "
                        "returning a ParallelPlan; it must materialize with MetaInit")
    parser.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                        help="the model to train (built on meta): a causal language model "
                        "taking token ids, returning logits (or an output with .logits); or "
                        "a Hugging Face config.json, or a model directory holding one")
    parser.add_argument("--ranks", metavar="1,2,N",
                        help="the rungs' rank counts, rising (default: 1, 2 and the plan's "
                        "world size); rung 1, the baseline, always runs first")
    parser.add_argument("--steps", type=bounded_int(1, 1000), default=4,
                        help="check steps, timed (default 4)")
    parser.add_argument("--warmup", type=bounded_int(0, 1000), default=1,
                        help="warm-up steps before them, trained and checked, not timed "
                        "(default 1)")
    parser.add_argument("--seq-len", type=bounded_int(2, 1024), default=16,
                        help="tokens per sample (default 16)")
    parser.add_argument("--batch", type=bounded_int(1, 4096), default=8,
                        help="global batch in samples (default 8)")
    parser.add_argument("--lr", type=bounded_float(0.0), default=0.05,
                        help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=bounded_int(0), default=0,
                        help="the seed of torch, random and the sampler (default 0)")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.use_deterministic_algorithms and cuDNN's deterministic "
                        "mode on every rung (default on)")
    parser.add_argument("--sampler", metavar="MODULE:FACTORY",
                        help="factory(dataset, num_replicas=, rank=, seed=) -> the sample "
                        "ids a data-parallel rank reads (default: DistributedSampler)")
    parser.add_argument("--rtol", type=_tolerance, default=None,
                        help="relative tolerance of losses and final parameters (default: "
                        "by the plan's compute dtype, 1.3e-6 in float32, 1.6e-2 in "
                        "bfloat16)")
    parser.add_argument("--atol", type=_tolerance, default=None,
                        help="absolute tolerance (default: by the compute dtype, 1e-5 in "
                        "float32, 1e-4 in bfloat16)")
    parser.add_argument("--timeout", type=bounded_float(0.0, 3600.0), default=120.0,
                        help="process-group timeout in seconds (default 120)")
    parser.add_argument("--svg", metavar="FILE", type=Path,
                        help="write a chart: peak memory, step time, collective share per rung")


def run_selfcheck(args: argparse.Namespace, out: Output) -> int:
    from composer_par.cli.plan_tools import model_code
    from composer_par.tools import selfcheck
    from composer_par.tools.demo import _quiet_numpy_warning

    _quiet_numpy_warning()
    try:
        with model_code(args.plan):
            ranks = (selfcheck.parse_ranks(args.ranks) if args.ranks
                     else selfcheck.default_ranks(args.plan))
        settings = selfcheck.Settings(
            plan=args.plan, model=args.model, ranks=ranks, steps=args.steps,
            warmup=args.warmup, seq_len=args.seq_len, batch=args.batch, lr=args.lr,
            seed=args.seed, deterministic=args.deterministic, timeout=args.timeout,
            sampler=args.sampler, rtol=args.rtol, atol=args.atol)
        with model_code(args.plan):
            selfcheck.check_settings(settings)
        with model_code(args.model):
            from composer_par.tools.dryrun import build_on_meta, resolve_factory
            from composer_par.tools.selfcheck_rank import vocabulary_size

            vocabulary_size(build_on_meta(resolve_factory(args.model), args.model))
    except selfcheck.SelfcheckInputError as exc:
        raise InputError(str(exc)) from exc
    doc = selfcheck.run_ladder(settings, out.note)
    if args.svg is not None:
        selfcheck.write_svg(doc, args.svg)
        doc["svg"] = str(args.svg)
    out.result(doc, selfcheck.format_report(doc))
    if not doc["ok"]:
        out.note(f"selfcheck: {selfcheck.first_failure_text(doc)}")
    # 2: a rank's model factory raised (the input, as when it raises here); 1: a rung
    # differs or a rank failed.
    return EXIT_OK if doc["ok"] else (EXIT_INPUT if doc["exit_code"] == 2 else EXIT_ERRORS)


__all__ = ["compare_arguments", "env_arguments", "run_compare", "run_env",
           "run_selfcheck", "selfcheck_arguments"]
