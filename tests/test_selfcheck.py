"""``composer-par selfcheck``: a correct plan passes every rung 1 -> 2 -> 4 (the project's
Llama and a Hugging Face Llama); each planted defect is caught at its rung and named.
Timing and memory figures are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from composer_par import MeshSpec, ParallelPlan
from composer_par.tools.selfcheck import (
    SelfcheckInputError,
    check_rung,
    fold_mesh,
    format_report,
    parse_ranks,
)
from tests.selfcheck_models import PLAN

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("selfcheck")

ROOT = Path(__file__).resolve().parent.parent


def selfcheck(tmp_path: Path, plan: str, model: str, *args: str
              ) -> tuple[int, dict[str, Any], str]:
    """Run the command as a user does (a fresh interpreter, the repository as the
    current directory so that ``tests.selfcheck_models`` imports on every rank)."""
    done = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "selfcheck", plan, "--model", model,
         "--json", "--steps", "2", "--warmup", "1", "--timeout", "60", *args],
        capture_output=True, text=True, timeout=540, cwd=ROOT,
    )
    try:
        doc = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON document: {done.stdout!r}\n{done.stderr}") from None
    return done.returncode, doc, done.stderr


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("plans") / "fsdp2_tp.toml"
    path.write_text(PLAN)
    return str(path)


@pytest.fixture(scope="module")
def correct_run(plan_file: str, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[int, dict[str, Any], str, Path]:
    svg = tmp_path_factory.mktemp("chart") / "ladder.svg"
    code, doc, err = selfcheck(svg.parent, plan_file, "tests.selfcheck_models:llama",
                               "--ranks", "1,2,4", "--svg", str(svg))
    return code, doc, err, svg


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_correct_plan_passes_every_rung(correct_run: Any) -> None:
    code, doc, err, svg = correct_run
    assert code == 0, err
    assert doc["ok"] and doc["first_failure"] is None
    assert [r["ranks"] for r in doc["rungs"]] == [1, 2, 4]
    baseline, two, four = doc["rungs"]
    assert baseline["baseline"] and baseline["mesh"] == {}
    assert two["mesh"] == {"dp_shard": 2, "tp": 1}
    assert two["folds"] == ["tp 2 -> 1 (does not fit beside the dims kept on 2 rank(s))"]
    assert four["mesh"] == {"dp_shard": 2, "tp": 2} and four["folds"] == []
    for rung in (two, four):
        assert [c["name"] for c in rung["checks"]] == [
            "plan", "initial parameters", "samples", "losses", "final parameters"]
        assert all(c["ok"] for c in rung["checks"])
        assert len(rung["peak_bytes"]) == rung["ranks"]
        assert rung["backend"] == "gloo"
        assert any(t["name"].startswith("gloo:") for t in rung["top_collectives"])
    assert len(baseline["losses"]) == 3  # 1 warm-up + 2 timed steps
    assert baseline["determinism"]["torch.use_deterministic_algorithms"] is True
    assert "rung 2 rank(s): folded tp 2 -> 1" in err  # progress on stderr
    chart = svg.read_text()
    assert chart.startswith("<svg") and chart.count("rank(s)</text>") == 9  # 3 panels x 3
    # Printed, never asserted.
    print(format_report(doc))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_hugging_face_llama_passes_every_rung(plan_file: str, tmp_path: Path) -> None:
    code, doc, err = selfcheck(tmp_path, plan_file, "tests.selfcheck_models:hf_llama",
                               "--ranks", "1,2,4")
    assert code == 0, err + json.dumps(doc.get("first_failure"))
    assert [r["ranks"] for r in doc["rungs"]] == [1, 2, 4] and doc["ok"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_hugging_face_config_directory_passes_every_rung(plan_file: str,
                                                          tmp_path: Path) -> None:
    """--model a directory holding a config.json (transformers' save_pretrained), as the
    rung processes resolve it too: the model the config describes, trained at parity."""
    pytest.importorskip("transformers")
    from tests import hf_workers

    hf_workers.config("llama").save_pretrained(tmp_path / "llama")
    code, doc, err = selfcheck(tmp_path, plan_file, str(tmp_path / "llama"), "--ranks", "1,2")
    assert code == 0, err + json.dumps(doc.get("first_failure"))
    assert [r["ranks"] for r in doc["rungs"]] == [1, 2] and doc["ok"]
    assert all(c["ok"] for c in doc["rungs"][1]["checks"])


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_sampler_that_repeats_samples_is_caught_at_rung_2(plan_file: str,
                                                            tmp_path: Path) -> None:
    code, doc, _ = selfcheck(tmp_path, plan_file, "tests.selfcheck_models:llama",
                             "--ranks", "1,2", "--sampler",
                             "tests.selfcheck_models:duplicate_sampler")
    failure = doc["first_failure"]
    assert code == 1 and not doc["ok"]
    assert (failure["rung"], failure["check"], failure["step"]) == (2, "samples", 1)
    assert "was read twice at step 1: by rank 0 (data shard 0) and rank 1" in failure["message"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_replicated_parameter_nudged_on_one_tp_rank_is_named(tmp_path: Path) -> None:
    code, doc, _ = selfcheck(tmp_path, "tests.selfcheck_models:nudged_plan",
                             "tests.selfcheck_models:llama", "--ranks", "1,2,4")
    failure = doc["first_failure"]
    assert code == 1
    assert [r["ranks"] for r in doc["rungs"]] == [1, 2]  # the ladder stops at rung 2
    assert doc["rungs"][1]["mesh"] == {"tp": 2, "dp_shard": 1}
    assert (failure["rung"], failure["check"], failure["parameter"], failure["rank"]) == (
        2, "initial parameters", "norm.weight", 1)
    assert "differs from the baseline after apply by 0.001" in failure["message"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_plan_whose_seed_differs_per_rank_is_caught(tmp_path: Path) -> None:
    code, doc, _ = selfcheck(tmp_path, "tests.selfcheck_models:seed_per_rank_plan",
                             "tests.selfcheck_models:llama", "--ranks", "1,2")
    failure = doc["first_failure"]
    assert code == 1 and (failure["rung"], failure["check"], failure["rank"]) == (2, "plan", 1)
    assert "line 20 is 'seed = 1' there" in failure["message"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_nondeterministic_op_is_refused_at_the_baseline(plan_file: str,
                                                          tmp_path: Path) -> None:
    code, doc, _ = selfcheck(tmp_path, plan_file,
                             "tests.selfcheck_models:nondeterministic_llama", "--ranks", "1,2")
    failure = doc["first_failure"]
    assert code == 1 and (failure["rung"], failure["check"]) == (1, "determinism")
    assert "put_ does not have a deterministic implementation" in failure["message"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_compare_reads_a_rung_of_a_selfcheck_log(correct_run: Any, tmp_path: Path) -> None:
    from composer_par.cli.main import main

    code, doc, _, _ = correct_run
    assert code == 0
    log = tmp_path / "selfcheck.json"
    log.write_text(json.dumps(doc))
    assert main(["compare", str(log), str(log), "--rung", "4", "--assert-equal"]) == 0
    # Rung 4 against the baseline: equal within the fp32 tolerance, not bit for bit.
    other = tmp_path / "baseline.json"
    other.write_text(json.dumps(doc["rungs"][0]))
    assert main(["compare", str(log), str(other), "--rung", "4"]) == 0
    assert main(["compare", str(log), str(log), "--rung", "8"]) == 2


# -- without processes -----------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "ranks", "kept", "folds"), [
    ({"dp_shard": 2, "tp": 2}, 4, {"dp_shard": 2, "tp": 2}, 0),
    ({"dp_shard": 2, "tp": 2}, 2, {"dp_shard": 2, "tp": 1}, 1),
    ({"tp": 2, "dp_shard": 2}, 2, {"tp": 2, "dp_shard": 1}, 1),
    ({"dp_shard": 2, "tp": 2}, 8, {"dp_shard": 4, "tp": 2}, 1),
    ({"dp_shard": -1, "tp": 2}, 8, {"dp_shard": 4, "tp": 2}, 0),
])
def test_fold_mesh(mesh: dict[str, int], ranks: int, kept: dict[str, int],
                   folds: int) -> None:
    from composer_par import FSDP2, TP

    plan = ParallelPlan(MeshSpec(**mesh)).use(FSDP2()).use(TP())
    folded, said = fold_mesh(plan, ranks)
    assert folded.to_dict() == kept and len(said) == folds


def test_fold_mesh_without_a_data_parallel_dim_to_widen() -> None:
    from composer_par import TP

    with pytest.raises(SelfcheckInputError, match="no data-parallel mesh dim to widen"):
        fold_mesh(ParallelPlan(MeshSpec(tp=2)).use(TP()), 4)


def test_parse_ranks() -> None:
    assert parse_ranks("2,4") == (1, 2, 4) and parse_ranks("1,2") == (1, 2)
    for bad in ("4,2", "0,2", "a", "2,2"):
        with pytest.raises(SelfcheckInputError):
            parse_ranks(bad)


def _record(rank: int, shard: int, samples: list[list[int]], value: float = 1.0) -> dict[str, Any]:
    import torch

    params = {"w": torch.full((2,), value)}
    return {"rank": rank, "plan": "[mesh]\n", "data_shard": [shard, 2], "samples": samples,
            "losses": [1.0, 0.5], "initial": params, "final": params}


def test_the_checks_name_a_missed_sample_and_a_drifted_parameter() -> None:
    base = [_record(0, 0, [[0, 1, 2, 3], [4, 5, 6, 7]])]
    fine = [_record(0, 0, [[0, 2], [4, 6]]), _record(1, 1, [[1, 3], [5, 7]])]
    assert [f for _, f in check_rung(base, fine)] == [None] * 5
    missed = [_record(0, 0, [[0, 2], [4, 6]]), _record(1, 1, [[1, 9], [5, 7]])]
    failure = dict(check_rung(base, missed))["samples"]
    assert failure is not None and "read by no rank at step 1 (e.g. sample 3)" in failure.message
    drifted = [fine[0], _record(1, 1, [[1, 3], [5, 7]], value=1.001)]
    failure = dict(check_rung(base, drifted))["final parameters"]
    assert failure is not None and (failure.parameter, failure.rank, failure.step) == ("w", 1, 2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--ranks", "1,3"], "does not split evenly"),
    (["--ranks", "2,1"], "rising"),
])
def test_bad_input_is_exit_2(plan_file: str, argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    from composer_par.cli.main import main

    code = main(["selfcheck", plan_file, "--model", "tests.selfcheck_models:llama",
                 "--batch", "8", *argv])
    assert code == 2 and message in capsys.readouterr().err


def test_a_plan_without_meta_init_is_exit_2(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from composer_par.cli.main import main

    plan = tmp_path / "plan.toml"
    plan.write_text('[mesh]\ndp_shard = 2\n[[plugins]]\nname = "fsdp2"\n')
    code = main(["selfcheck", str(plan), "--model", "tests.selfcheck_models:llama"])
    assert code == 2 and "needs a plan that materializes with MetaInit" in capsys.readouterr().err
