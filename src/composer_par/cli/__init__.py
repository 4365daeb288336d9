"""``composer-par``: the command line (see :mod:`composer_par.cli.main`)."""

from composer_par.cli.main import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
