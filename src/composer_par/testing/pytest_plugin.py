"""pytest plugin (entry point ``composer_par``): the ``ranks`` fixture.

Loading it imports no torch: only the rank processes do, so test sessions that
never use the fixture pay nothing for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks


class Ranks:
    """Runs functions on gloo ranks, keeping their files under the test's ``tmp_path``."""

    def __init__(self, workdir: os.PathLike[str]) -> None:
        self._workdir = workdir

    def run(self, fn: Callable[..., Any] | str, world_size: int, **kwargs: Any) -> list[Any]:
        """Like ``run_ranks``, with ``workdir`` defaulting to the test's ``tmp_path``."""
        kwargs.setdefault("workdir", self._workdir)
        return run_ranks(fn, world_size, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    # Projects that use the fixture under --strict-markers get the marker too.
    config.addinivalue_line("markers", "distributed: spawns real gloo ranks")


@pytest.fixture
def ranks(tmp_path: os.PathLike[str]) -> Ranks:
    """Run a module-level function on real gloo ranks: ``ranks.run(fn, world_size, ...)``."""
    return Ranks(tmp_path)
