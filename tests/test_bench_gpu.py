"""benchmarks/bench_gpu.py on the CPU: its FLOP count is torchtitan's, and its set-up
trains torchtitan's Llama3 by torchtitan's parallelize code and by a plan, in bf16 and in
both float8 recipes (emulated), to the same losses. The timing itself needs a GPU (./dev
gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_modules import benchmark

pytest.importorskip("torchtitan")
pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parent.parent


# torchtitan's attention module compiles at import, and importing inductor touches torch.jit
# APIs that torch itself deprecates.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_flops_per_token_is_torchtitans() -> None:
    import torch

    bench = benchmark("bench_gpu")
    bench._base()._standins()
    for flavor, tied in (("debugmodel", False), ("1B", True)):
        cfg = bench.model_config(flavor, None, 2048)
        with torch.device("meta"):
            model = cfg.build()
        params, theirs = cfg.get_nparams_and_flops(model, 2048)
        attention = cfg.layers[0].attention
        embedding = model.tok_embeddings.weight.numel()
        ours = bench.flops_per_token(params, embedding, len(cfg.layers), attention.n_heads,
                                     cfg.dim // attention.n_heads, 2048, tied=tied)
        assert ours == theirs, flavor
        assert getattr(cfg, "enable_weight_tying", False) == tied, flavor


@pytest.mark.timeout(300)
def test_the_set_up_trains_both_sides_alike_on_cpu() -> None:
    """Two blocks of the debugmodel, no compile (emulated float8 on CPU): both sides'
    losses are equal in every mode, and the report has every figure."""
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--device", "cpu", "--flavor",
         "debugmodel", "--layers", "2", "--seq", "16", "--batch", "2", "--steps", "1",
         "--warmup", "0", "--no-compile", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert list(report["modes"]) == ["bf16", "rowwise", "tensorwise"]
    for mode, result in report["modes"].items():
        assert result["loss_difference"] == 0.0, (mode, result)
        for side in result["sides"].values():
            assert side["tokens_per_s"] > 0 and 0 < side["mfu"] < 1
            assert len(side["losses"]) == 1
        assert result["ratio"]["tokens_per_s"] > 0
    # the float8 modes train other numbers than bf16: the comparison is not vacuous
    losses = {m: r["sides"]["torchtitan"]["losses"] for m, r in report["modes"].items()}
    assert losses["bf16"] != losses["rowwise"] != losses["tensorwise"]


def test_without_a_gpu_it_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    run = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--modes", "bf16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA device" in run.stderr
