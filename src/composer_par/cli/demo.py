"""``composer-par demo``: the command line of :mod:`composer_par.tools.demo`.

Its arguments are checked, one by one at parse time and against each other here, before
the demo starts any process.
"""

from __future__ import annotations

import argparse

from composer_par.cli.common import InputError, Output
from composer_par.tools import demo


def configure_demo(parser: argparse.ArgumentParser) -> None:
    demo.add_arguments(parser)


def run_demo(args: argparse.Namespace, out: Output) -> int:
    problem = demo.check_arguments(args)
    if problem:
        raise InputError(problem)
    return demo.run(args, out)


__all__ = ["configure_demo", "run_demo"]
