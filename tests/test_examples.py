"""The examples: every example plan validates, and train.py trains under torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_par.cli.main import main as cli
from composer_par.hangs import ROLL_CALL_S
from tests import processes

EXAMPLES = Path(__file__).parent.parent / "examples"

# plan -> the launch it is written for (world size, nodes x devices per node)
LAUNCHES = {
    "fsdp.toml": ["--world-size", "4"],
    "hsdp.toml": ["--nodes", "2", "--devices-per-node", "4"],
    "fsdp_tp.toml": ["--world-size", "4"],
    "fsdp_cp.toml": ["--world-size", "4"],
    "fsdp_ep.toml": ["--world-size", "4"],
    "hsdp_fsdp_tp.toml": [],  # its [topology] says 2 x 4
    "hsdp_two_nodes.toml": ["--nodes", "2", "--devices-per-node", "2"],
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


def _torchrun_train(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """examples/train.py on 2 processes under ``torchrun --standalone`` (whose run id is
    new on each invocation)."""
    env = {k: v for k, v in os.environ.items() if k != "COMPOSER_PAR_RUN_ID"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(EXAMPLES / "train.py"),
         str(EXAMPLES / "plans" / "fsdp.toml"), "--seq-len", "32", *args],
        capture_output=True, text=True, cwd=cwd, timeout=240, env=env)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_train_py_keeps_each_run_s_steps_and_resumes_the_run_named(tmp_path: Path) -> None:
    from composer_par import checkpoint as ck
    from composer_par.checkpoint import steps

    # Before, the second job's keep_last (the two highest steps of the whole root) deleted
    # its steps 1 and 2 right after saving them, and --resume then took the first job's.
    root = tmp_path / "train-checkpoints"
    for args in (("--steps", "4"), ("--steps", "2")):
        job = _torchrun_train(tmp_path, *args, "--save-every", "1")
        assert job.returncode == 0, job.stderr[-4000:]
    assert [s for s, _, ok in ck.step_dirs(root) if ok] == [1, 2, 3, 4]
    first_run = steps.read_commit(root / "step-000000004")["run"]
    assert steps.read_commit(root / "step-000000002")["run"] != first_run
    ambiguous = _torchrun_train(tmp_path, "--steps", "5", "--resume")
    assert ambiguous.returncode != 0
    assert "holds the committed steps of 2 runs" in ambiguous.stderr, ambiguous.stderr[-4000:]
    assert f"run {first_run} (newest step-000000004" in ambiguous.stderr
    resumed = _torchrun_train(tmp_path, "--steps", "5", "--resume", "--run-id", first_run)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert '"resumed"' in resumed.stdout + resumed.stderr
    assert [s for s, _, ok in ck.step_dirs(root) if ok] == [1, 2, 4, 5]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_py_finished_job_exits_0_on_every_rank_with_no_thread_left(
        tmp_path: Path) -> None:
    # torchrun exits 0 only if every worker did; each rank says which threads were still
    # running as it ended, after its last save and export: none but the main thread, the
    # process groups' native threads joined (composer_par.teardown).
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(EXAMPLES / "train.py"),
         str(EXAMPLES / "plans" / "fsdp.toml"), "--seq-len", "32", "--steps", "3",
         "--save-every", "3", "--final-weights", "final"],
        capture_output=True, text=True, cwd=tmp_path, timeout=240,
        env={**os.environ, "COMPOSER_PAR_TRAIN_SHOW_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "step-000000003" in result.stdout + result.stderr
    for rank in (0, 1):
        assert f"rank {rank}: threads at exit: python ['MainThread'], native []" in \
            result.stderr, result.stderr[-4000:]
    assert "terminate called" not in result.stderr
    assert "still running at exit" not in result.stderr


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_py_ends_a_job_with_a_frozen_rank_at_the_plans_timeout_naming_it(
        tmp_path: Path) -> None:
    # The plan's timeout is the job's: init_process_group gets it too (a 1-D mesh runs on
    # the default group). Before, train.py's default group waited torch's 30 minutes.
    timeout = 8
    plan = tmp_path / "plan.toml"
    plan.write_text((EXAMPLES / "plans" / "fsdp.toml").read_text()
                    + f"\n[plan]\ntimeout = {timeout}\n")
    run = processes.run_watched(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--monitor-interval", "0.2", str(EXAMPLES / "train.py"), str(plan), "--seq-len", "32",
         "--steps", "4"],
        env={**os.environ, "COMPOSER_PAR_TRAIN_FREEZE": "1:2"}, cwd=tmp_path, timeout=240)
    stderr = run.stderr
    assert run.code == 1, stderr[-3000:]
    assert run.left == [], f"processes left behind: {run.left}"
    frozen_at = run.first("rank 1: frozen at step 2")
    # Bounded by the timeout, not torch's 30 minutes; the slack is for a loaded machine
    # (measured ~37 s on 2 busy cores), not a speed claim.
    assert run.ended - frozen_at < timeout + ROLL_CALL_S + 60, stderr[-3000:]
    assert ("StuckRankError: rank 1 never joined: rank 0 timed out after 8 s" in stderr), \
        stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_py_rank_sent_sigterm_mid_run_ends_the_job_promptly_leaving_no_process(
        tmp_path: Path) -> None:
    # SIGTERM keeps its default action in a rank (nothing installs a handler that would
    # wait for a collective to return): the rank ends at once, torchrun stops its peer
    # and exits, and no process of the job is left.
    mark = processes.new_mark()
    with (tmp_path / "stderr").open("w") as stderr, subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "--monitor-interval", "0.2", str(EXAMPLES / "train.py"),
             str(EXAMPLES / "plans" / "fsdp.toml"), "--seq-len", "32", "--steps", "100000",
             "--save-every", "2"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, processes.MARK_ENV: mark}) as job:
        try:
            committed = tmp_path / "train-checkpoints" / "step-000000002" / "COMMITTED"
            deadline = time.monotonic() + 200
            while not committed.exists():
                assert job.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint committed"
                time.sleep(0.1)
            [rank1] = [pid for pid in processes.children(job.pid)
                       if b"\0RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
            os.kill(rank1, signal.SIGTERM)
            sent = time.monotonic()
            code = job.wait(timeout=120)
            ended = time.monotonic()
            left = processes.marked(mark)
        finally:
            job.kill()
            processes.kill_marked(mark)
    text = (tmp_path / "stderr").read_text()
    assert code == 1, text[-3000:]
    assert "Signal 15 (SIGTERM) received by PID" in text, text[-3000:]
    assert left == [], f"processes left behind: {left}"
    # Prompt: no wait for the plan's timeout (300 s); the slack is for a loaded machine.
    assert ended - sent < 60, text[-3000:]
