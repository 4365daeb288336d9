"""composer_par.plugin.sum_gradient on real gloo ranks: the identity forward, the
gradient summed over the mesh in backward, nothing else's gradient changed."""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks

pytestmark = pytest.mark.timeout(180)


def test_the_gradient_is_summed_over_the_mesh_and_nothing_else_changes() -> None:
    world = 2
    results = run_ranks("tests.gradient_sum_workers:summed_over_the_mesh", world, timeout=90)
    total = sum(r + 1 for r in range(world))  # rank r's gradient is r + 1
    for got in results:
        assert got["value"] == [1.0, 1.0, 1.0]
        assert got["x_grad"] == [float(total)] * 3
        assert got["a_grad"] == [world * 1.0, world * 2.0, world * 3.0]
        assert got["b_grad"] == [1.0, 2.0, 3.0]  # the add's gradient, not summed with a's
        assert got["untouched"]
