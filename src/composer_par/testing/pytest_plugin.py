"""pytest plugin (entry point ``composer_par``): the ``ranks``, ``parity`` and
``fake_world`` fixtures.

Installed with composer-par, so plugin authors' test suites get them without a
conftest. Loading it imports no torch: only the rank processes (and the single-process
reference of ``parity``) do, so test sessions that never use the fixtures pay nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import (
    CommMeasurement,
    ParityCase,
    ParityResult,
    check_parity,
    measure_comm,
)


class Ranks:
    """Runs functions on gloo ranks, keeping their files under the test's ``tmp_path``."""

    def __init__(self, workdir: os.PathLike[str]) -> None:
        self._workdir = workdir

    def run(self, fn: Callable[..., Any] | str, world_size: int, **kwargs: Any) -> list[Any]:
        """Like ``run_ranks``, with ``workdir`` defaulting to the test's ``tmp_path``."""
        kwargs.setdefault("workdir", self._workdir)
        return run_ranks(fn, world_size, **kwargs)


class Parity:
    """Trains a plan on gloo ranks side by side with a single-process reference.

    ``check`` returns a :class:`~composer_par.testing.parity.ParityResult` (losses, and
    full parameters of the reference and of every rank; ``assert_close()`` asserts fp32
    parity of every rank's, the differences are there to assert anything looser); ``comm``
    counts the collectives of the plan's training steps per mesh dim. Both take a
    :class:`ParityCase` or its fields.
    """

    Case = ParityCase

    def __init__(self, workdir: os.PathLike[str]) -> None:
        self._workdir = workdir

    def check(self, case: ParityCase | None = None, *, timeout: float = 240.0,
              **fields: Any) -> ParityResult:
        return check_parity(case or ParityCase(**fields), timeout=timeout,
                            workdir=self._workdir)

    def comm(self, case: ParityCase | None = None, *, timeout: float = 240.0,
             **fields: Any) -> CommMeasurement:
        return measure_comm(case or ParityCase(**fields), timeout=timeout,
                            workdir=self._workdir)


def pytest_configure(config: pytest.Config) -> None:
    # Projects that use the fixture under --strict-markers get the marker too.
    config.addinivalue_line("markers", "distributed: spawns real gloo ranks")


@pytest.fixture
def ranks(tmp_path: os.PathLike[str]) -> Ranks:
    """Run a module-level function on real gloo ranks: ``ranks.run(fn, world_size, ...)``."""
    return Ranks(tmp_path)


@pytest.fixture
def parity(tmp_path: os.PathLike[str]) -> Parity:
    """Train a plan against a single-process reference: ``parity.check(task=..., plan=...,
    world_size=...)``; count its collectives: ``parity.comm(...)``."""
    return Parity(tmp_path)


@pytest.fixture
def fake_world() -> Iterator[Callable[..., None]]:
    """One process standing for any rank of a world, no peers: ``fake_world(world_size,
    rank=0)`` starts torch's fake process group (again, for another rank or size, if one
    is running), on which DeviceMeshes build and local work (sharding, validation,
    ``apply``) runs while collectives do nothing. Destroyed after the test."""
    import torch.distributed as dist

    from composer_par.plugin import torch_private

    FakeStore = torch_private.fake_store()

    def init(world_size: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
