"""A checkpoint saved under EP 4 x FSDP2 loads into every expert-parallel layout and
training goes on as if it never stopped.

The MoE Llama (8 experts, top-2, a shared expert) trains 2 AdamW steps under dp_shard(2)
x ep(4) on 8 ranks and saves with composer_par.checkpoint (DCP); then it trains 2 more
steps: the run that never stopped. Each other layout loads that checkpoint into a fresh
model (another seed): model and optimizer state bitwise equal, in every rank's view; then
it trains the same 2 steps on the same micro-batches, and every step's loss and every
rank's full parameters match the uninterrupted run within fp32 tolerance (the layouts
sum gradients in other orders). FSDP2 alone, after its first step, saves again, and EP 4
loads that checkpoint without expert parallelism into one with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from composer_par.testing import run_ranks
from composer_par.testing.parity import assert_every_rank, assert_params_close
from tests.ep_checkpoint_workers import CONTINUED, SAVE_LAYOUT, SAVED_AT
from tests.test_checkpoint_dist import agreed, assert_every_rank_bitwise

WORKERS = "tests.ep_checkpoint_workers"

pytestmark = pytest.mark.distributed

# Load runs by world size: (source checkpoint, layout, save again after the first step).
LOADS: dict[int, list[tuple[str, str, bool]]] = {
    4: [(SAVE_LAYOUT, "fsdp2_ep_2x2", False), (SAVE_LAYOUT, "fsdp2_4", True),
        ("fsdp2_4", "ep_4", False)],
    2: [(SAVE_LAYOUT, "ep_2", False)],
    1: [(SAVE_LAYOUT, "one_process", False)],
}


def _matches_uninterrupted(expected: list[dict[str, Any]], views: list[dict[str, Any]],
                           what: str) -> None:
    """Each rank's continued steps: the uninterrupted run's losses and parameters."""
    import torch

    def check(view: dict[str, Any]) -> None:
        got = view["continued"]
        ours = expected[len(expected) - len(got):]
        assert [s["step"] for s in got] == [s["step"] for s in ours], (what, got)
        for mine, theirs in zip(got, ours, strict=True):
            torch.testing.assert_close(
                torch.tensor(mine["loss"], dtype=torch.float64),
                torch.tensor(theirs["loss"], dtype=torch.float64), rtol=1.3e-6, atol=1e-5,
                msg=lambda m, s=mine["step"]: f"{what}: loss of step {s}: {m}")
            try:
                assert_params_close(mine["params"], theirs["params"])
            except AssertionError as exc:
                raise AssertionError(f"{what}, step {mine['step']}: {exc}") from None

    assert_every_rank(views, check)


@pytest.mark.timeout(600)
def test_a_checkpoint_saved_under_ep4_x_fsdp2_loads_into_every_ep_layout(
        tmp_path: Path) -> None:
    root = str(tmp_path)
    uninterrupted = run_ranks(f"{WORKERS}:save_and_continue", 8, args=(root,), timeout=400)
    saved = agreed([v["saved"] for v in uninterrupted], "saved")
    assert any(k.endswith("moe.experts.w1.exp_avg") for k in saved)  # optimizer state
    assert saved["optim.layers.0.moe.experts.w1.step"] == SAVED_AT
    # Every rank of the uninterrupted run holds the same parameters at each step.
    continued = uninterrupted[0]["continued"]
    assert len(continued) == CONTINUED
    for view in uninterrupted:
        for mine, rank0 in zip(view["continued"], continued, strict=True):
            assert_every_rank_bitwise(rank0["params"], [mine["params"]], "uninterrupted")
    # Vacuous if nothing trained after the load: the parameters move every step.
    assert continued[0]["params"].keys() == continued[1]["params"].keys()
    for name, value in continued[1]["params"].items():
        assert not value.equal(continued[0]["params"][name]), name

    loaded: dict[str, list[dict[str, Any]]] = {}
    for world, loads in LOADS.items():
        views = run_ranks(f"{WORKERS}:load_and_continue", world, args=(loads, root),
                          timeout=400)
        for source, layout, _ in loads:
            loaded[f"{source}->{layout}"] = [v[f"{source}->{layout}"] for v in views]

    for key, views in loaded.items():
        source = key.partition("->")[0]
        if source == SAVE_LAYOUT:
            assert_every_rank_bitwise(saved, [v["loaded"] for v in views], key)
        _matches_uninterrupted(continued, views, key)
    # Out of FSDP2 alone (no EP) into EP 4: its resaved state, bitwise, one step later.
    resaved = agreed([v["resaved"] for v in loaded[f"{SAVE_LAYOUT}->fsdp2_4"]], "resaved")
    assert resaved["optim.layers.0.moe.experts.w1.step"] == SAVED_AT + 1
    assert_every_rank_bitwise(resaved, [v["loaded"] for v in loaded["fsdp2_4->ep_4"]],
                              "fsdp2_4 -> ep_4")
