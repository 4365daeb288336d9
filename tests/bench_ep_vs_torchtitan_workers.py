"""Rank-side function of tests/test_bench_ep_vs_torchtitan.py: the benchmark's own rank
function (benchmarks/bench_ep_vs_torchtitan.py, loaded by path: benchmarks/ is no
package) at its smallest configuration, without timed repeats."""

from __future__ import annotations

from typing import Any

from tests.benchmark_modules import benchmark


def bench() -> Any:
    return benchmark("bench_ep_vs_torchtitan")


def side_by_side(layout: str, steps: int) -> dict[str, Any]:
    """torchtitan's EP and composer_par's on ``layout``: 2 blocks, dim 32, 4 experts
    top-2, ``steps`` compared steps and one counted, no timed repeats."""
    return bench()._rank_main([layout], 2, 32, 4, 2, 16, 4, steps, 0, 0)  # type: ignore[no-any-return]
