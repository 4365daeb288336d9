"""Rank-side function of tests/test_bench_ep_vs_transformers.py: the benchmark's own rank
function (benchmarks/bench_ep_vs_transformers.py, loaded by path: benchmarks/ is no
package) at its smallest configuration, without timed repeats."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_ep_vs_transformers.py"


def bench() -> Any:
    name = "bench_ep_vs_transformers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def side_by_side(layout: str, steps: int) -> dict[str, Any]:
    """transformers' EP and composer_par's on ``layout``: 2 blocks, dim 32, 4 experts
    top-2, ``steps`` compared steps and one counted, no timed repeats."""
    return bench()._rank_main([layout], 2, 32, 4, 2, 16, 4, steps, 0, 0)  # type: ignore[no-any-return]
