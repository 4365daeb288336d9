"""Lightning Fabric and the Lightning Trainer running composer_par plans.

One launch of 4 gloo ranks trains every case (FSDP2 x TP 2 x 2 and HSDP x FSDP2 2 x 2, on
a Hugging Face LlamaForCausalLM from config and on the project's Llama) through the plain
plan loop, Fabric and the Trainer, saves and loads checkpoints every way, and tries the
Trainer set-ups refused at setup; the tests below read its results. The refusals Lightning
meets while building the strategy need no processes and run here.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from composer_par.testing import run_ranks
from tests import lightning_workers as workers

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("lightning")

pytest.importorskip("lightning")

CASES = [("hf_llama", "fsdp2_tp"), ("hf_llama", "hsdp_fsdp2"), ("llama", "fsdp2_tp"),
         ("llama", "hsdp_fsdp2")]
KEYS = [f"{kind}/{plan}" for kind, plan in CASES]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("lightning")
    return run_ranks(workers.run_all, 4, args=(str(root), CASES), timeout=900)


def _each(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    out = [r[key] for r in ranks]
    for result in out:
        assert "error" not in result, result.get("error")
    return out


def _close(losses: list[float], expected: list[float]) -> bool:
    return len(losses) == len(expected) and all(
        abs(a - b) <= 1e-5 + 1.3e-6 * abs(b) for a, b in zip(losses, expected, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_fabric_trains_as_the_plain_loop(ranks: list[dict[str, Any]], key: str) -> None:
    for result in _each(ranks, key):
        fabric = result["fabric"]
        # built on meta by fabric.init_module, the plan's mesh (its dims, its object), the
        # sampler from plan.data_shard()
        assert fabric["on_meta"] and fabric["plans_mesh"] and fabric["sampler"]
        assert fabric["mesh"] == (("dp_shard", "tp") if "fsdp2_tp" in key
                                  else ("dp_replicate", "dp_shard"))
        assert len(fabric["losses"]) == workers.STEPS
        assert _close(fabric["losses"], result["plain_losses"]), (fabric["losses"],
                                                                   result["plain_losses"])
        assert fabric["losses"][-1] < fabric["losses"][0]
        same = result["fabric_vs_plain"]
        assert same["count"] > 0 and same["close"], same


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_trainer_trains_as_the_plain_loop(ranks: list[dict[str, Any]], key: str) -> None:
    for result in _each(ranks, key):
        # configure_model built the model on meta without asking; the plan materialized it
        assert result["trainer_built_on_meta"]
        # trainer.validate after fit: set up again, the trained model kept and evaluated
        assert result["trainer_validated"]
        assert result["trainer_steps"] == workers.STEPS
        assert _close(result["trainer_losses"], result["plain_losses"]), (
            result["trainer_losses"], result["plain_losses"])
        same = result["trainer_vs_plain"]
        assert same["count"] > 0 and same["close"], same


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_checkpoints_cross_between_lightning_and_composer_par(ranks: list[dict[str, Any]],
                                                              key: str) -> None:
    for result in _each(ranks, key):
        # fabric.save -> composer_par.checkpoint.load, and the other way round, bitwise
        assert result["plain_loaded_fabric"]["bitwise"], result["plain_loaded_fabric"]
        assert result["plain_loaded_extra"] == {"epoch": workers.SAVE_AT}
        assert result["fabric_loaded_plain"]["bitwise"], result["fabric_loaded_plain"]
        assert result["fabric_loaded_epoch"] == workers.SAVE_AT
        # trainer.save_checkpoint -> composer_par.checkpoint.load, with Lightning's state
        assert result["plain_loaded_trainer"]["bitwise"], result["plain_loaded_trainer"]
        assert result["plain_loaded_trainer_epoch"] == workers.SAVE_AT - 1


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_resume_through_the_adapters_continues_bitwise(ranks: list[dict[str, Any]],
                                                       key: str) -> None:
    for result in _each(ranks, key):
        tail = workers.STEPS - workers.SAVE_AT
        assert result["fabric_resumed"]["bitwise"], result["fabric_resumed"]
        assert result["fabric_resumed_losses"] == result["fabric"]["losses"][-tail:]
        assert result["trainer_resumed"]["bitwise"], result["trainer_resumed"]
        assert result["trainer_resumed_losses"] == result["trainer_losses"][-tail:]
        assert result["trainer_resumed_steps"] == workers.STEPS


@pytest.mark.distributed
def test_fabric_drives_a_pipeline_plan_through_its_training_step(
        ranks: list[dict[str, Any]]) -> None:
    """PP x FSDP2 (2 x 2): Fabric's loop calls the strategy's training_step, which runs
    the schedule; the model's forward alone is refused, since a stage's output is no
    loss input; the checkpoint reads back outside Lightning."""
    for result in ranks:
        pipeline = result["pipeline"]
        assert pipeline["forward_refused"]
        assert len(pipeline["fabric_losses"]) == workers.STEPS
        assert _close(pipeline["fabric_losses"], pipeline["plain_losses"]), pipeline
        assert pipeline["fabric_vs_plain"]["count"] > 0, pipeline
        assert pipeline["fabric_vs_plain"]["close"], pipeline["fabric_vs_plain"]
        assert pipeline["plain_loaded_fabric"]["bitwise"], pipeline["plain_loaded_fabric"]


@pytest.mark.distributed
def test_trainer_refuses_a_module_the_plan_cannot_own(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        # CP707: a parameter outside the submodule the plan applies to; CP702: a model
        # configure_model already sharded
        assert result["refusals"] == {"outside": ["CP707"], "configure_model": ["CP702"]}


@pytest.mark.distributed
def test_fabric_starting_its_own_processes_runs_the_plan(tmp_path: Path) -> None:
    """As a user's script runs: Fabric starts the second process and initializes the
    process group itself (gloo on CPU, the plan's timeout); Fabric trains as the plain
    loop does on both ranks."""
    import json
    import os

    torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK")
    env = {k: v for k, v in os.environ.items() if k not in torchrun}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "tests.lightning_workers", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert (result["world"], result["backend"], result["timeout_s"]) == (2, "gloo", 120.0)
        # fabric.setup(model, optimizer) and a filtered save are refused, saying why
        assert result["refused"] == ["setup", "filter"]
        assert _close(result["losses"], result["ref_losses"]), result
        assert result["same"]["count"] > 0 and result["same"]["close"], result["same"]


# -- refused while Lightning builds the strategy: no processes -------------------------------


def _fabric(plan: Any, devices: int = 4, **kwargs: Any) -> Any:
    from lightning.fabric import Fabric

    from composer_par.integrations.lightning import FabricStrategy

    settings = {k: kwargs.pop(k) for k in list(kwargs) if k != "precision"}
    return Fabric(strategy=FabricStrategy(plan, **settings), devices=devices,
                  accelerator="cpu", **kwargs)


def _codes(build: Any) -> list[str]:
    from composer_par.integrations.errors import IntegrationError

    with pytest.raises(IntegrationError) as info:
        build()
    assert "nothing was built" in str(info.value)
    return info.value.report.codes()


def test_a_plan_that_fits_is_accepted() -> None:
    fabric = _fabric(workers.make_plan("fsdp2_tp"), data_parallel_size=2,
                     tensor_parallel_size=2, timeout=300)
    assert fabric.world_size == 4


def test_precision_over_the_plans_mixed_precision_is_refused() -> None:
    import lightning as L

    from composer_par.integrations.lightning import TrainerStrategy

    plan = workers.make_plan("fsdp2_bf16")
    assert _codes(lambda: _fabric(plan, precision="bf16-mixed")) == ["CP701"]
    assert _codes(lambda: L.Trainer(strategy=TrainerStrategy(plan), devices=4,
                                    accelerator="cpu", precision="bf16-true",
                                    logger=False)) == ["CP701"]
    # no mixed precision in the plan: Lightning's precision is the only one
    _fabric(workers.make_plan("fsdp2_tp"), precision="bf16-mixed")


def test_strategy_settings_the_plan_decides_are_refused() -> None:
    plan = workers.make_plan("fsdp2_tp")
    assert _codes(lambda: _fabric(plan, parallelize_fn=lambda m, mesh: m)) == ["CP702"]
    assert _codes(lambda: _fabric(plan, data_parallel_size=4)) == ["CP703"]
    assert _codes(lambda: _fabric(plan, tensor_parallel_size=4)) == ["CP703"]
    assert _codes(lambda: _fabric(plan, timeout=timedelta(seconds=60))) == ["CP706"]
    assert _codes(lambda: _fabric(plan, save_distributed_checkpoint=False)) == ["CP706"]


def test_a_process_count_the_plan_does_not_fit_is_refused() -> None:
    import lightning as L

    from composer_par.integrations.lightning import TrainerStrategy

    plan = workers.make_plan("hsdp_fsdp2")
    assert _codes(lambda: _fabric(plan, devices=2)) == ["CP704"]
    assert _codes(lambda: L.Trainer(strategy=TrainerStrategy(plan), devices=8,
                                    accelerator="cpu", logger=False)) == ["CP704"]


def test_a_pipeline_plan_is_refused_by_the_trainer_only() -> None:
    import lightning as L

    from composer_par.integrations.lightning import TrainerStrategy

    plan = workers.make_plan("pp", world=2)
    assert _codes(lambda: L.Trainer(strategy=TrainerStrategy(plan), devices=2,
                                    accelerator="cpu", logger=False)) == ["CP705"]
    # Fabric's loop is the user's: fabric.strategy.training_step runs the schedule
    assert _fabric(plan, devices=2).world_size == 2


# torch.compile's first use imports dynamo, whose torch.jit use warns on this torch.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_lightning_module_is_refused_by_lightning() -> None:
    """Compile on both sides cannot happen in the Trainer: Lightning itself refuses a
    compiled LightningModule under a model-parallel strategy, before any process starts
    (the plan's Compile plugin compiles per block)."""
    import lightning as L
    import torch

    from composer_par.integrations.lightning import TrainerStrategy

    trainer = L.Trainer(strategy=TrainerStrategy(workers.make_plan("fsdp2_tp")), devices=4,
                        accelerator="cpu", logger=False, max_epochs=1)
    with pytest.raises(RuntimeError, match="compiled model is incompatible"):
        trainer.fit(torch.compile(workers._lit_module("llama")))


def test_composer_par_does_not_import_lightning() -> None:
    # the adapter's module too: lightning comes with the first strategy made
    code = ("import sys, composer_par, composer_par.integrations, "
            "composer_par.integrations.errors, composer_par.integrations.lightning\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'lightning_fabric', 'pytorch_lightning')], 'lightning imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert done.returncode == 0, done.stderr
