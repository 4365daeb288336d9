"""An imported plan trains exactly as the plan written by hand: 2 gloo ranks, 10 steps,
both at parity with one process, and equal to each other bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_par.migrate import import_config, import_trainer_args
from composer_par.testing.parity import ParityCase, check_parity

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

DATA = Path(__file__).parent / "data" / "migrate"
LLAMA = "composer_par.testing.tasks:llama"
# The harness starts every plan from MetaInit (layout-invariant init), so the reference
# starts from the same weights; an imported plan gets it the way a user adds it.
META_INIT = '\n[[plugins]]\nname = "meta_init"\nseed = 7\n'

BY_HAND = """
[mesh]
dp_shard = 2

[[plugins]]
name = "fsdp2"
reshard_after_forward = false
blocks = ["DecoderLayer"]

[[plugins]]
name = "activation_checkpoint"
""" + META_INIT


def _case(plan: str) -> ParityCase:
    return ParityCase(task=LLAMA, plan=plan, world_size=2, optimizer="adamw", lr=0.01,
                      reference="accumulate")


def test_imported_accelerate_fsdp1_plan_trains_as_the_hand_written_plan() -> None:
    result = import_config(DATA / "accelerate_fsdp1_cpu.yaml")
    assert result.report.ok, result.report.format()
    imported = check_parity(_case(result.toml + META_INIT))
    imported.assert_close()
    by_hand = check_parity(_case(BY_HAND))
    by_hand.assert_close()
    # The same plan: the same arithmetic, so the same bits.
    assert imported.losses == by_hand.losses
    for name, value in by_hand.params.items():
        assert imported.params[name].equal(value), name
    assert imported.losses[-1] < imported.losses[0] - 0.05, imported.losses


def test_imported_trainer_fsdp_plan_trains_at_parity() -> None:
    result = import_trainer_args(fsdp="full_shard auto_wrap", fsdp_config={
        "transformer_layer_cls_to_wrap": ["DecoderLayer"]})
    assert result.report.ok, result.report.format()
    plan = result.plan()
    assert plan.plugin("fsdp2").reshard_after_forward is True  # type: ignore[union-attr]
    check_parity(_case(result.toml + META_INIT)).assert_close()
