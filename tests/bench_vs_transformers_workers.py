"""Rank-side function of tests/test_bench_vs_transformers.py: the benchmark's own rank
function (benchmarks/bench_vs_transformers.py, loaded by path: benchmarks/ is no package)
at a small size, without timed repeats."""

from __future__ import annotations

from typing import Any

from tests.benchmark_modules import benchmark


def bench() -> Any:
    return benchmark("bench_vs_transformers")


def side_by_side(models: list[str], modes: list[str], steps: int) -> dict[str, Any]:
    """transformers' FSDP2 / TP and composer_par's plan on each model and mode: 2 blocks,
    hidden 128, ``steps`` compared steps, one counted, one measured, no timed repeats."""
    return bench()._rank_main(models, modes, 2, 128, 16, 4, steps, 0, 0)  # type: ignore[no-any-return]
