"""Checkpoints written by real FSDP1 (``FullyShardedDataParallel`` on gloo ranks), full
and sharded state dicts with the optimizer, load into a plan and resume: the loaded
weights are FSDP1's bit for bit, and the resumed training follows FSDP1's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ATOL, RTOL, assert_params_close

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORKERS = "tests.fsdp1_checkpoint_workers"


@pytest.mark.parametrize(("kind", "world"), [("full", 2), ("sharded", 2), ("sharded", 4)])
def test_fsdp1_checkpoint_resumes_in_a_plan(tmp_path: Path, kind: str, world: int) -> None:
    """Saved by FSDP1 on 2 ranks; loaded by a plan on ``world`` ranks (4: resharded)."""
    fsdp1 = run_ranks(f"{WORKERS}:fsdp1_train_and_save", 2, args=(str(tmp_path), kind))
    resumed = run_ranks(f"{WORKERS}:plan_load_and_resume", world, args=(str(tmp_path), kind))
    saved = fsdp1[0]["saved"]
    for rank, view in enumerate(resumed):
        assert view["kind"] == kind
        assert view["optimizer_keys"] > 0
        assert set(view["loaded"]) == set(saved), rank
        for name, value in saved.items():  # the load is exact
            assert view["loaded"][name].equal(value), (rank, name)
        assert view["losses"] == pytest.approx(fsdp1[0]["losses"], rel=RTOL, abs=ATOL)
        assert_params_close(view["final"], fsdp1[0]["final"], rtol=RTOL, atol=ATOL)
    # Training moved the weights after the load: the comparison is not of a still model.
    moved = max(float((resumed[0]["final"][n] - saved[n]).abs().max()) for n in saved)
    assert moved > 1e-4


def test_a_mismatched_checkpoint_names_the_keys(tmp_path: Path) -> None:
    from composer_par.checkpoint import KeyMismatchError

    run_ranks(f"{WORKERS}:fsdp1_train_and_save", 2, args=(str(tmp_path), "full"))
    messages = run_ranks(f"{WORKERS}:load_into_another_model", 2, args=(str(tmp_path),))
    message = messages[0]
    assert KeyMismatchError.__name__ in message and "layers.1" in message


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_convert_takes_an_fsdp1_checkpoint(tmp_path: Path, kind: str) -> None:
    """``composer-par convert`` of what FSDP1 saved: safetensors and DCP that hold its
    weights bit for bit."""
    from safetensors.torch import load_file

    from composer_par import checkpoint as ck
    from composer_par.cli.main import main
    from composer_par.testing.tasks import llama

    fsdp1 = run_ranks(f"{WORKERS}:fsdp1_train_and_save", 2, args=(str(tmp_path), kind))
    saved = fsdp1[0]["saved"]
    source = tmp_path / ("pytorch_model_fsdp.bin" if kind == "full" else "pytorch_model_fsdp_0")
    assert main(["convert", str(source), str(tmp_path / "st"), "--no-progress"]) == 0
    weights = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert weights.keys() == saved.keys()
    assert all(weights[n].equal(v) for n, v in saved.items())
    assert main(["convert", str(source), str(tmp_path / "dcp"), "--to", "dcp",
                 "--no-progress"]) == 0
    model = llama.build()
    ck.load(tmp_path / "dcp", model)
    assert all(p.equal(saved[n]) for n, p in model.named_parameters())
    # The optimizer's file is not a model's: refused, naming the key.
    if kind == "full":
        code = main(["convert", str(tmp_path / "optimizer.bin"), str(tmp_path / "o"),
                     "--no-progress"])
        assert code == 2 and not (tmp_path / "o").exists()
