"""Gradient accumulation through the trainers' own loops with a plan: the Lightning
Trainer (``accumulate_grad_batches``), Lightning Fabric (``no_backward_sync``), accelerate
(``accumulate``) and the Hugging Face Trainer (``gradient_accumulation_steps``). Under
the default ``gradient_sync="last"`` the plan's FSDP2 units reduce-scatter once per
optimizer step instead of once per microbatch (golden counts, every rank), and every
rank's parameters end where the plan's own loop ends over the same global batches in one
step each. One launch of 2 gloo ranks runs every FSDP2 case; one of 4, HSDP x FSDP2 through
the Lightning Trainer and accelerate."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from composer_par.testing import run_ranks
from composer_par.testing.parity import ATOL, RTOL
from tests import trainer_accumulation_workers as workers

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("trainer_accumulation")

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

ADAPTERS = ["lightning_trainer", "fabric", "accelerate", "hf_trainer"]
CASES = [(adapter, sync) for adapter in ADAPTERS for sync in ("last", "every")]
K = workers.ACCUMULATE


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer-accumulation")
    return run_ranks(workers.run_all, 2, args=(str(root), CASES), timeout=900)


HSDP_CASES = [("lightning_trainer", "reduce_scatter"), ("accelerate", "last")]


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer-accumulation-hsdp")
    return run_ranks(workers.run_all, 4, args=(str(root), HSDP_CASES), timeout=900)


def _each(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    out = [r[key] for r in ranks]
    for result in out:
        assert "error" not in result, result["error"]
    return out


def _reduce_scatters(result: dict[str, Any]) -> list[int]:
    return [c.get("reduce_scatter", 0) for c in result["counts"]]


def _all_reduces(result: dict[str, Any]) -> list[int]:
    return [c.get("all_reduce", 0) for c in result["counts"]]


def _assert_parity(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for rank, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["params"].keys() == reference["params"].keys()
        for name, param in mine["params"].items():
            torch.testing.assert_close(param, reference["params"][name], rtol=RTOL,
                                       atol=ATOL, msg=f"rank {rank} {name}")
        if "steps" in mine:
            assert mine["steps"] == workers.STEPS


# FSDP units: the project's Llama has three (2 blocks and the root), the Hugging Face
# LlamaForCausalLM of tests/hf_workers.py four: its 2 decoder layers, the embedding, and
# the final norm joined with the output head (the model's own FSDP plan, read by
# composer_par.plugin.fsdp_units).
UNITS = 3
HF_UNITS = 4


@pytest.mark.distributed
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("adapter", ["lightning_trainer", "fabric", "accelerate"])
def test_deferred_sync_reduce_scatters_once_per_step(ranks: list[dict[str, Any]],
                                                     adapter: str) -> None:
    # Counted per microbatch: the first k - 1 reduce nothing, the last all k.
    for last, every in zip(_each(ranks, f"{adapter}/last"), _each(ranks, f"{adapter}/every"),
                           strict=True):
        assert _reduce_scatters(last) == ([0] * (K - 1) + [UNITS]) * workers.STEPS
        assert _reduce_scatters(every) == [UNITS] * (K * workers.STEPS)


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_hf_trainer_reduce_scatters_once_per_step(ranks: list[dict[str, Any]]) -> None:
    # Counted per optimizer step (the Trainer's on_step_begin to on_step_end).
    for last, every in zip(_each(ranks, "hf_trainer/last"), _each(ranks, "hf_trainer/every"),
                           strict=True):
        assert last["steps"] == every["steps"] == workers.STEPS
        assert _reduce_scatters(last) == [HF_UNITS] * workers.STEPS
        assert _reduce_scatters(every) == [K * HF_UNITS] * workers.STEPS


@pytest.mark.distributed
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", [f"{adapter}/{sync}" for adapter, sync in CASES])
def test_accumulation_trains_at_parity_with_one_step(ranks: list[dict[str, Any]],
                                                     case: str) -> None:
    reference = "reference/hf" if case.startswith("hf_trainer") else "reference/llama"
    _assert_parity(_each(ranks, case), _each(ranks, reference))


@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_hsdp_defers_the_replicate_all_reduce_at_parity(
        hsdp_ranks: list[dict[str, Any]]) -> None:
    # "reduce_scatter": a reduce-scatter every microbatch, the all-reduce over
    # dp_replicate only in the last; "last": both only in the last.
    for result in _each(hsdp_ranks, "lightning_trainer/reduce_scatter"):
        assert _reduce_scatters(result) == [UNITS] * (K * workers.STEPS)
        assert _all_reduces(result) == ([0] * (K - 1) + [UNITS]) * workers.STEPS
    for result in _each(hsdp_ranks, "accelerate/last"):
        assert _reduce_scatters(result) == ([0] * (K - 1) + [UNITS]) * workers.STEPS
        assert _all_reduces(result) == ([0] * (K - 1) + [UNITS]) * workers.STEPS
    reference = _each(hsdp_ranks, "reference/llama")
    for adapter, sync in HSDP_CASES:
        _assert_parity(_each(hsdp_ranks, f"{adapter}/{sync}"), reference)


def test_the_policy_is_checked_before_anything_is_built() -> None:
    from composer_par import MeshSpec, ParallelPlan
    from composer_par.integrations.accelerate import plan_accelerator_class
    from composer_par.integrations.lightning import FabricStrategy, TrainerStrategy

    plan = ParallelPlan(MeshSpec())
    for made in (FabricStrategy, TrainerStrategy, plan_accelerator_class()):
        with pytest.raises(ValueError, match="sync must be one of"):
            made(plan, gradient_sync="never")
