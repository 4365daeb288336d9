"""The demo and examples/train.py with a pipeline: the same loop, one more plan table.

The plan below is FSDP2 over dp_shard with ``[[plugins]] name = "pp"`` added: that table is
the only change from a plan without a pipeline. The demo trains as the same plan without
the pipeline does, and train.py trains and saves under torchrun; both resume from a
checkpoint saved under the pipeline and continue as a run that never stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).parent.parent / "examples"
WITHOUT_PP = """[mesh]
pp = 2
dp_shard = 2

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 0
"""
PLAN = WITHOUT_PP + '\n[[plugins]]\nname = "pp"\nschedule = "1F1B"\n'


def demo(cwd: Path, plan: Path, *args: str, nproc: str = "4") -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "demo", "--json", "--plan", str(plan),
         "--checkpoint-dir", str(cwd / "ckpt"), "--seq-len", "32", "--nproc", nproc, *args],
        capture_output=True, text=True, timeout=600, cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout)  # type: ignore[no-any-return]


NO_PIPELINE = """[mesh]
dp_shard = 2

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 0
"""

def test_demo_with_a_pipeline_trains_as_without_one(tmp_path: Path) -> None:
    """4 ranks (pp 2 x dp_shard 2) against 2 (dp_shard 2): the same global batches from
    the same weights, so the same losses up to summation order."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    piped = demo(tmp_path, plan, "--steps", "4")
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain_plan = plain_dir / "plan.toml"
    plain_plan.write_text(NO_PIPELINE)
    plain = demo(plain_dir, plain_plan, "--steps", "4", nproc="2")
    a, b = piped["losses"], plain["losses"]
    assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 4
    assert all(abs(x - y) <= 1e-5 + 1.3e-6 * abs(y) for x, y in zip(a, b, strict=True)), (a, b)
    assert a[-1] < a[0]


def test_without_the_pp_table_the_plan_is_refused_and_with_it_valid() -> None:
    from composer_par import ParallelPlan

    report = ParallelPlan.from_toml(WITHOUT_PP).validate(world_size=4)
    assert [f.code for f in report.errors] == ["CP201"]  # nobody owns pp
    assert ParallelPlan.from_toml(PLAN).validate(world_size=4).ok


def test_demo_with_a_pipeline_resumes_bitwise(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    first = demo(tmp_path, plan, "--steps", "3")
    resumed = demo(tmp_path, plan, "--steps", "5", "--resume")
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    whole = demo(whole_dir, plan, "--steps", "5")
    assert resumed["first_step"] == 3
    assert first["losses"] + resumed["losses"] == whole["losses"]  # type: ignore[operator]


def _train(cwd: Path, plan: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "4", str(EXAMPLES / "train.py"), str(plan),
         "--seq-len", "32", "--max-grad-norm", "1.0", *args],
        capture_output=True, text=True, cwd=cwd, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


def test_train_py_with_a_pipeline_trains_and_saves_under_torchrun(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    first = _train(tmp_path, plan, "--steps", "2")
    assert "step-000000002" in first


def test_train_py_with_a_pipeline_resumes_under_torchrun(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    _train(tmp_path, plan, "--steps", "2")
    resumed = _train(tmp_path, plan, "--steps", "4", "--resume")
    assert '"resumed"' in resumed and "step-000000004" in resumed
