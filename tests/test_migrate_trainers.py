"""The Trainer and the accelerate adapter take the settings users already have -- the
Trainer's --fsdp arguments, an accelerate config -- and build the plan from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import ATOL, RTOL

DATA = Path(__file__).parent / "data" / "migrate"
WORKERS = "tests.migrate_trainer_workers"


def _args(tmp_path: Path, **sharding: Any) -> Any:
    import transformers

    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to="none", **sharding)


def test_plan_from_training_args_clears_what_the_plan_now_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # TrainingArguments sets it from fsdp_config; restored after the test.
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    from composer_par.integrations.hf_trainer import trainer_findings
    from composer_par.integrations.sources import plan_from_training_args

    args = _args(tmp_path, fsdp="full_shard auto_wrap offload", activation_checkpointing=True,
                 fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                              "cpu_ram_efficient_loading": True})
    plan, cleared, result = plan_from_training_args(args)
    fsdp2 = plan.plugin("fsdp2")
    assert fsdp2 is not None and fsdp2.reshard_after_forward is True
    assert fsdp2.offload == "cpu" and fsdp2.blocks == ("LlamaDecoderLayer",)
    assert plan.plugin("activation_checkpoint") is not None
    assert result.report.codes() == ["CP910"]
    assert "CP910" in capsys.readouterr().err  # printed for the user
    # Left on, the Trainer's sharding and checkpointing would be refused (CP714, CP712);
    # cleared, nothing is.
    assert {"CP712", "CP714"} <= {f.code for f in trainer_findings(plan, args)}
    assert trainer_findings(plan, cleared) == []
    assert not cleared.fsdp and not cleared.activation_checkpointing


def test_load_plan_takes_a_plan_file_or_another_tools_config(tmp_path: Path) -> None:
    from composer_par.integrations.sources import load_plan

    plan = load_plan(DATA / "ds_zero2.json")
    assert plan.plugin("fsdp2").reshard_after_forward is False  # type: ignore[union-attr]
    toml = tmp_path / "plan.toml"
    toml.write_text(plan.to_toml(), encoding="utf-8")
    assert load_plan(toml).to_toml() == plan.to_toml()
    assert load_plan(plan) is plan


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_trainer_with_fsdp_arguments_trains_as_the_hand_written_plan(tmp_path: Path) -> None:
    import torch

    results = run_ranks(f"{WORKERS}:trainer_from_fsdp_arguments", 2, args=(str(tmp_path),),
                        timeout=400)
    for rank, result in enumerate(results):
        assert "reshard_after_forward = true" in result["plan"]
        assert not result["fsdp_left"]
        losses, params = result["imported"]
        hand_losses, hand_params = result["by_hand"]
        assert len(losses) == 3
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(hand_losses),
                                   rtol=RTOL, atol=ATOL)
        for name, value in hand_params.items():
            torch.testing.assert_close(params[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_prepare_accelerator_from_an_accelerate_config() -> None:
    results = run_ranks(f"{WORKERS}:accelerator_from_config", 2,
                        args=(str(DATA / "accelerate_fsdp1_cpu.yaml"),))
    for result in results:
        assert result == {"reshard": False, "blocks": ["DecoderLayer"], "processes": 2,
                          "sharded": "DTensor"}
