"""The command line run in the test's own process, as the CLI tests call it."""

from __future__ import annotations

import contextlib
import io


def run(argv: list[str], stdout: io.StringIO | None = None) -> tuple[int, str, str]:
    """``composer-par argv``: its exit code, stdout and stderr (written to ``stdout``
    when given, a terminal stand-in)."""
    from composer_par.cli.main import main

    out, err = stdout or io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()
