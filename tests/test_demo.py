"""The demo: trains with the default plan, resumes bitwise, and fails loudly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "demo", "--json", "--checkpoint-dir",
         str(tmp_path / "ckpt"), "--seq-len", "32", *args],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
    )


def test_resume_continues_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    first = demo(tmp_path, "--steps", "3")
    assert first.returncode == 0, first.stderr
    resumed = demo(tmp_path, "--steps", "5", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    whole = demo(whole_dir, "--steps", "5")
    assert whole.returncode == 0, whole.stderr
    a, b, c = (json.loads(r.stdout) for r in (first, resumed, whole))
    assert b["first_step"] == 3 and len(b["losses"]) == 2
    assert a["losses"] + b["losses"] == c["losses"]  # bitwise: same data, same state
    assert c["losses"][-1] < c["losses"][0]
    assert "step-000000005" in b["checkpoint"]
    assert "Warning" not in resumed.stderr, resumed.stderr


def test_a_failing_rank_stops_the_run_and_is_named(tmp_path: Path) -> None:
    result = demo(tmp_path, "--steps", "4", "--fail", "1:2", "--timeout", "10")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data == {"ok": False, "failed_rank": 1, "exit_code": 1,
                    "error": "RuntimeError: failure injected at step 2 (--fail)"}
    assert "demo failed: rank 1" in result.stderr


def test_a_fresh_run_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "precious.txt").write_text("keep me")
    result = demo(tmp_path, "--steps", "1")
    assert result.returncode == 2
    assert "not made by the demo" in result.stderr
    assert (tmp_path / "ckpt" / "precious.txt").read_text() == "keep me"
