"""The demo: trains with the default plan, resumes bitwise, and fails loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_par.hangs import ROLL_CALL_S
from composer_par.tools.demo import FREEZE_ENV
from tests import processes

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


def test_a_frozen_rank_ends_the_run_at_the_timeout_named_leaving_no_process(
        tmp_path: Path) -> None:
    # Before the plan's groups had a timeout, the ranks waiting for a frozen one sat in
    # torch's 30-minute default even with --timeout 10.
    timeout = 10.0
    with (tmp_path / "stdout").open("w") as stdout:
        run = processes.run_watched(
            [sys.executable, "-m", "composer_par.cli", "demo", "--json", "--checkpoint-dir",
             str(tmp_path / "ckpt"), "--seq-len", "32", "--steps", "4", "--timeout",
             str(timeout)],
            env={**os.environ, FREEZE_ENV: "0:2"}, cwd=tmp_path, timeout=400, stdout=stdout)
    stderr = run.stderr
    assert run.code == 1, stderr[-3000:]
    assert run.left == [], f"processes left behind: {run.left}"
    frozen_at = run.first("rank 0: frozen at step 2")
    # Bounded by the timeout, not torch's 30 minutes; the slack is for a loaded machine
    # (measured ~37 s on 2 busy cores), not a speed claim.
    assert run.ended - frozen_at < timeout + ROLL_CALL_S + 60, stderr[-3000:]
    data = json.loads((tmp_path / "stdout").read_text())
    # The stuck rank is the one that failed, not the healthy rank that reported it.
    assert data["ok"] is False and data["stuck_ranks"] == [0] and data["failed_rank"] == 0
    assert data["reported_by"] != 0
    assert data["error"].startswith("StuckRankError: rank 0 never joined: ranks 1, 2, 3 "
                                    "timed out after 10 s")
    assert "demo failed: rank 0 never joined: ranks 1, 2, 3 timed out" in stderr


def test_a_finished_demo_exits_0_on_every_rank_with_no_thread_left(tmp_path: Path) -> None:
    # The launcher returns only if every rank exited 0; each rank reports the process
    # group threads still running after its groups were destroyed (none, or a warning).
    plan = Path(__file__).parent.parent / "examples" / "plans" / "fsdp.toml"
    result = demo(tmp_path, "--plan", str(plan), "--nproc", "2", "--steps", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout)["ok"] is True
    assert "still running at exit" not in result.stderr, result.stderr[-4000:]
    assert "terminate called" not in result.stderr


def test_corpus_tokens_repeat_the_corpus_for_sequences_longer_than_it() -> None:
    from composer_par.tools.demo import corpus_bytes, corpus_tokens

    size = len(corpus_bytes())
    assert len(corpus_tokens()) == size
    long = corpus_tokens(2 * size + 1)
    assert len(long) == 3 * size and bool((long[size:2 * size] == long[:size]).all())


def test_a_context_parallel_plan_trains_a_sequence_longer_than_the_corpus(
        tmp_path: Path) -> None:
    from composer_par.tools.demo import corpus_bytes

    seq_len = (len(corpus_bytes()) // 8 + 1) * 8  # longer than the corpus, 2 * cp divides
    plan = Path(__file__).parents[1] / "examples" / "plans" / "fsdp_cp.toml"
    long = subprocess.run(
        [sys.executable, "-m", "composer_par.cli", "demo", "--json", "--checkpoint-dir",
         str(tmp_path / "long"), "--plan", str(plan), "--nproc", "4", "--steps", "1",
         "--batch", "2", "--seq-len", str(seq_len)],
        capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert long.returncode == 0, long.stderr[-3000:]
    assert json.loads(long.stdout)["ok"]
