"""The examples: every example plan validates, and train.py trains under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from composer_par.cli.main import main as cli

EXAMPLES = Path(__file__).parent.parent / "examples"

# plan -> the launch it is written for (world size, nodes x devices per node)
LAUNCHES = {
    "fsdp.toml": ["--world-size", "4"],
    "hsdp.toml": ["--nodes", "2", "--devices-per-node", "4"],
    "fsdp_tp.toml": ["--world-size", "4"],
    "hsdp_fsdp_tp.toml": [],  # its [topology] says 2 x 4
}


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_example_plans_are_clean(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["validate", str(EXAMPLES / "plans" / name), *LAUNCHES[name]])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plan is valid: no findings" in out


def test_every_example_plan_is_listed() -> None:
    assert {p.name for p in (EXAMPLES / "plans").glob("*.toml")} == set(LAUNCHES)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_py_trains_and_resumes_under_torchrun(tmp_path: Path) -> None:
    def train(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", str(EXAMPLES / "train.py"),
             str(EXAMPLES / "plans" / "fsdp.toml"), "--seq-len", "32", *args],
            capture_output=True, text=True, cwd=tmp_path, timeout=240,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stdout + result.stderr

    first = train("--steps", "2")
    assert "step-000000002" in first
    resumed = train("--steps", "4", "--resume")
    assert '"resumed"' in resumed and "step-000000004" in resumed
