"""``composer-par selfcheck`` compares like with like: the plans people run pass, and the
planted defects are still caught.

The baseline runs the plan's precision policy, and is run again as one micro-batch per
data shard where a rung's ranks take a loss per micro-batch (the MoE router's balancing
loss) or compute in bf16; tolerances are per compute dtype and stated. A correct bf16
plan and the project's MoE plan pass every rung; a replica moved on one tp rank and a
sampler without the rank are caught under bf16; a missing gradient reduction stops the
ladder at rung 1 (the reduction check), naming the parameter and the dim. stderr stays
quiet: no profiler lines, one line per failed rank, exit 2 when a rank's model factory
raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.selfcheck_models import BF16_PLAN, NORMS_REPLICATED_PLAN
from tests.test_selfcheck import ROOT, selfcheck

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def _plan(tmp_path: Path, text: str, name: str = "plan.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _quiet(err: str) -> None:
    assert "USDT" not in err and "profiler_start" not in err, err
    assert "Traceback" not in err, err


def test_a_correct_bf16_plan_passes_every_rung(tmp_path: Path) -> None:
    code, doc, err = selfcheck(tmp_path, _plan(tmp_path, BF16_PLAN),
                               "tests.selfcheck_models:llama", "--ranks", "1,2")
    assert code == 0, err
    assert doc["ok"] and doc["compute_dtype"] == "bfloat16"
    assert (doc["rtol"], doc["atol"]) == (1.6e-2, 1e-4)
    assert (doc["initial_rtol"], doc["initial_atol"]) == (1.3e-6, 1e-5)
    assert "(bfloat16 compute)" in doc["tolerance_note"]
    assert doc["rungs"][1]["compared_with"].startswith("the baseline as 2 micro-batches")
    assert all(c["ok"] for c in doc["rungs"][1]["checks"])
    _quiet(err)


def test_the_moe_example_plan_passes_every_rung() -> None:
    code, doc, err = selfcheck(ROOT, "examples/plans/fsdp_ep.toml",
                               "composer_par.tools.demo:demo_moe_model", "--ranks", "1,2,4")
    assert code == 0, err + str(doc.get("first_failure"))
    assert [r["ranks"] for r in doc["rungs"]] == [1, 2, 4]
    assert doc["compute_dtype"] == "float32"
    for rung, shards in ((doc["rungs"][1], 2), (doc["rungs"][2], 4)):
        assert rung["compared_with"] == (
            f"the baseline as {shards} micro-batches, one per data shard (its ranks each "
            "take a loss per micro-batch)")
    _quiet(err)


def test_a_moved_replica_is_caught_under_bf16(tmp_path: Path) -> None:
    code, doc, _ = selfcheck(tmp_path, "tests.selfcheck_models:nudged_bf16_plan",
                             "tests.selfcheck_models:llama", "--ranks", "1,2")
    failure = doc["first_failure"]
    assert code == 1 and doc["compute_dtype"] == "bfloat16"
    assert (failure["rung"], failure["check"], failure["parameter"], failure["rank"]) == (
        2, "initial parameters", "norm.weight", 1)


def test_a_sampler_without_the_rank_is_caught_under_bf16(tmp_path: Path) -> None:
    code, doc, _ = selfcheck(tmp_path, _plan(tmp_path, BF16_PLAN),
                             "tests.selfcheck_models:llama", "--ranks", "1,2", "--sampler",
                             "tests.selfcheck_models:duplicate_sampler")
    assert code == 1
    assert (doc["first_failure"]["rung"], doc["first_failure"]["check"]) == (2, "samples")


def test_a_missing_reduction_stops_the_ladder_at_rung_1(tmp_path: Path) -> None:
    code, doc, err = selfcheck(tmp_path, _plan(tmp_path, NORMS_REPLICATED_PLAN),
                               "tests.selfcheck_models:qwen3", "--ranks", "1,2")
    failure: dict[str, Any] = doc["first_failure"]
    assert code == 1
    assert [r["ranks"] for r in doc["rungs"]] == [1]  # no multi-rank rung launched
    assert (failure["rung"], failure["check"], failure["rank"]) == (1, "reductions", 0)
    assert failure["parameter"] == "model.layers.0.self_attn.q_norm.weight"
    assert "gradient needs a sum over tp and gets none" in failure["message"]
    assert "on the layout of rung 2 (tp(2))" in failure["message"]
    _quiet(err)


def test_a_rank_whose_model_factory_raises_is_named_in_one_line_exit_2(
        tmp_path: Path) -> None:
    code, doc, err = selfcheck(tmp_path, _plan(tmp_path, BF16_PLAN),
                               "tests.selfcheck_models:fails_on_rank_1", "--ranks", "1,2")
    assert code == 2, err
    failure = doc["first_failure"]
    assert (failure["rung"], failure["check"], failure["rank"]) == (2, "model code", 1)
    lines = [line for line in err.splitlines() if "FAILED on rank" in line]
    assert lines == ["rung 2 rank(s): FAILED on rank 1: ModelCodeError: rank 1: "
                     "tests.selfcheck_models:fails_on_rank_1() raised RuntimeError: no "
                     "weights for rank 1"], err
    _quiet(err)
    assert len(err.splitlines()) <= 8, err
