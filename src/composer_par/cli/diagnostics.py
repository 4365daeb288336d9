"""The CLI glue of the pre-flight commands: ``env`` (the machine, for a bug report),
``compare`` (two runs side by side) and ``selfcheck`` (the ladder of rungs before a long
run). The work is done in :mod:`composer_par.tools.environment`,
:mod:`composer_par.tools.compare` and :mod:`composer_par.tools.selfcheck`.
"""

from __future__ import annotations

import argparse

from composer_par.cli.common import EXIT_OK, Output


def env_arguments(parser: argparse.ArgumentParser) -> None:
    """``env`` takes no arguments besides --json."""


def run_env(args: argparse.Namespace, out: Output) -> int:
    from composer_par.tools.environment import collect, format_environment

    data = collect()
    out.result(data, format_environment(data))
    return EXIT_OK


__all__ = ["env_arguments", "run_env"]
