"""Retention belongs to a run: a save's ``keep_last`` deletes only older steps of its own
run, loading a root picks the newest step of the run being resumed (or refuses, naming
each run), a load racing retention moves on to the newest remaining step, two threads
saving one step get their own claims, and clean-up beyond that is an explicit command."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from composer_par import checkpoint as ck
from composer_par.checkpoint import claims, runs, steps
from composer_par.checkpoint.errors import CheckpointError
from composer_par.cli.main import main as cli
from tests.test_checkpoint_io import assert_same, reference, state, write_claim


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test as a process of its own: no run adopted, no run id in the environment."""
    monkeypatch.setattr(runs, "_adopted", {})
    monkeypatch.delenv(runs.RUN_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def _steps(root: Path) -> list[int]:
    return [s for s, _, ok in steps.step_dirs(root) if ok]


def _as_torchrun_job(monkeypatch: pytest.MonkeyPatch, run_id: str) -> None:
    """This process from now on as a fresh torchrun job with ``--rdzv-id run_id``."""
    monkeypatch.setattr(runs, "_adopted", {})
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)


def test_a_second_run_in_one_root_keeps_its_steps_and_the_first_run_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe: train to 20 saving every 5, then a new job to 10 into the same root.
    # Before, keep_last kept the two highest steps of the root: the second job's 5 and
    # 10 were deleted right after save returned them.
    model = reference()
    _as_torchrun_job(monkeypatch, "first-job")
    for step in (5, 10, 15, 20):
        ck.save(tmp_path, model, step=step, keep_last=2)
    assert _steps(tmp_path) == [15, 20]
    _as_torchrun_job(monkeypatch, "second-job")
    for step in (5, 10):
        saved = ck.save(tmp_path, model, step=step, keep_last=2)
        assert steps.is_committed(saved)
    assert _steps(tmp_path) == [5, 10, 15, 20]
    assert steps.read_commit(tmp_path / "step-000000010")["run"] == "second-job"
    # A torchrun restart of the second job resumes its own newest step, not step 20.
    info = ck.load(tmp_path, reference(seed=8))
    assert (info.path.name, info.run) == ("step-000000010", "second-job")
    assert ck.load(tmp_path, reference(seed=8), run="first-job").step == 20
    # A third job names neither: refused, with both candidates named.
    _as_torchrun_job(monkeypatch, "third-job")
    with pytest.raises(CheckpointError) as err:
        ck.load(tmp_path, reference(seed=8))
    text = str(err.value)
    assert "holds the committed steps of 2 runs" in text and "(third-job) is none" in text
    assert "run first-job (newest step-000000020" in text
    assert "run second-job (newest step-000000010" in text
    with pytest.raises(CheckpointError, match="no committed step of run nobody"):
        ck.load(tmp_path, reference(seed=8), run="nobody")
    # The second job saving on deletes only its own older steps.
    _as_torchrun_job(monkeypatch, "second-job")
    ck.save(tmp_path, model, step=12, keep_last=2)
    assert _steps(tmp_path) == [10, 12, 15, 20]


def test_a_resumed_process_continues_the_run_it_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = reference()
    for step in (1, 2):
        ck.save(tmp_path, model, step=step, keep_last=2, run="pretrain")
    _as_torchrun_job(monkeypatch, "a-new-torchrun-invocation")
    info = ck.load(tmp_path, reference(seed=8))  # the root holds one run: resume it
    assert (info.step, info.run) == (2, "pretrain")
    ck.save(tmp_path, model, step=3, keep_last=2)
    assert steps.read_commit(tmp_path / "step-000000003")["run"] == "pretrain"
    assert _steps(tmp_path) == [2, 3]
    monkeypatch.setenv(runs.RUN_ENV, "explicit")  # the environment names another run
    ck.save(tmp_path, model, step=4, keep_last=1)
    assert _steps(tmp_path) == [2, 3, 4]


def test_a_save_never_deletes_the_step_it_just_saved_nor_older_runs_steps(
        tmp_path: Path) -> None:
    model = reference()
    ck.save(tmp_path, model, step=10, keep_last=1, run="a")
    assert ck.save(tmp_path, model, step=5, keep_last=1, run="a").is_dir()
    assert _steps(tmp_path) == [5, 10]
    # Steps committed before runs were recorded belong to no run: no run deletes them.
    legacy = tmp_path / "step-000000001"
    legacy.mkdir()
    steps.commit(legacy, 1)
    ck.save(tmp_path, model, step=11, keep_last=1, run="a")
    assert _steps(tmp_path) == [1, 11]
    with pytest.raises(ValueError, match="run must be a non-empty printable string"):
        ck.save(tmp_path, model, step=12, run="")


def test_an_unfinished_step_of_another_run_is_left_to_explicit_cleaning(
        tmp_path: Path) -> None:
    from tests.test_checkpoint_io import dead_pid

    dead = tmp_path / "step-000000001"
    dead.mkdir()
    write_claim(dead, pid=dead_pid())  # a dead job of no run
    ck.save(tmp_path, reference(), step=2, keep_last=1, run="a")
    assert dead.is_dir()
    assert ck.clean_stale(tmp_path, older_than=0).removed == (dead,)


def test_a_load_whose_step_retention_removed_loads_the_newest_remaining(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = reference(seed=1), reference(seed=2)
    ck.save(tmp_path, older, step=1, run="a")
    ck.save(tmp_path, newer, step=2, run="a")
    real = ck.dcp.read_metadata
    removed: list[Path] = []

    def retention_strikes(directory: Path, *args: object) -> object:
        if not removed:  # as keep_last=1 of a save would, between choosing and reading
            removed.append(directory)
            steps.remove(directory)
        return real(directory, *args)

    monkeypatch.setattr(ck.dcp, "read_metadata", retention_strikes)
    model = reference(seed=9)
    with caplog.at_level(logging.WARNING):
        info = ck.load(tmp_path, model)
    assert removed == [tmp_path / "step-000000002"] and info.step == 1
    assert_same(state(model), state(older))
    assert any("removed by retention while it was being loaded" in r.getMessage()
               for r in caplog.records)
    # A step directory named explicitly is not swapped for another: the error says why.
    ck.save(tmp_path, newer, step=3, run="a")
    removed.clear()
    with pytest.raises(CheckpointError, match=r"step-000000003 was removed by retention"):
        ck.load(tmp_path / "step-000000003", model)


_SAVER = """
import sys, pathlib
from composer_par import checkpoint as ck
from tests.test_checkpoint_io import reference
root, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
model = reference()
step = 0
while not stop.exists():
    step += 1
    ck.save(root, model, step=step, keep_last=1, run="saver")
"""


@pytest.mark.timeout(300)
def test_loads_racing_a_keep_last_1_saver_all_succeed(tmp_path: Path) -> None:
    # Before, about one load in five failed with "CorruptFileError: ... missing" when
    # the saver's retention removed the step it had chosen.
    root, stop = tmp_path / "ckpt", tmp_path / "stop"
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, str(root), str(stop)],
                             cwd=Path(__file__).parent.parent, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while steps.latest(root) is None:
            assert saver.poll() is None, saver.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        expected = state(reference())
        for _ in range(25):
            model = reference(seed=9)
            ck.load(root, model)
            assert_same(state(model), expected)
    finally:
        stop.touch()
        _, err = saver.communicate(timeout=120)
    assert saver.returncode == 0, err[-3000:]


def test_two_threads_saving_one_step_get_their_own_claims(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, both threads had this process's job id: the second took over the first's
    # directory as "an earlier save of this same job", and a save reported success for
    # a checkpoint that then failed to load.
    real = ck.dcp.save_rng
    second_done = threading.Event()

    def first_waits_for_second(*args: object, **kwargs: object) -> None:
        if threading.current_thread().name == "first":  # its shards written, not committed
            assert second_done.wait(120)
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ck.dcp, "save_rng", first_waits_for_second)
    outcomes: dict[str, object] = {}

    def save(seed: int) -> None:
        try:
            outcomes[threading.current_thread().name] = ck.save(
                tmp_path, reference(seed=seed), step=3)
        except CheckpointError as exc:
            outcomes[threading.current_thread().name] = exc
        finally:
            if threading.current_thread().name == "second":
                second_done.set()

    first = threading.Thread(target=save, args=(1,), name="first")
    first.start()
    while not (tmp_path / "step-000000003" / claims.CLAIM).exists():
        time.sleep(0.01)
    second = threading.Thread(target=save, args=(2,), name="second")
    second.start()
    second.join(120)
    first.join(120)
    assert outcomes["first"] == tmp_path / "step-000000003", outcomes
    refused = outcomes["second"]
    assert isinstance(refused, CheckpointError), outcomes
    assert "another thread of this process" in str(refused)
    model = reference(seed=9)
    ck.load(tmp_path / "step-000000003", model)
    assert_same(state(model), state(reference(seed=1)))
    assert not claims._saving  # both saves ended: neither claim stands for a thread


def test_clean_stale_on_a_read_only_root_says_permission(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    ck.save(root, reference(), step=1)
    (root / "step-000000002").mkdir()
    os.utime(root / "step-000000002", (0, 0))
    if os.geteuid() == 0:  # root ignores the modes: refuse the rename as a mode would
        def refused(src: object, dst: object) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", str(src))

        monkeypatch.setattr(claims.os, "rename", refused)
        where = r"step-000000002"
    else:
        root.chmod(stat.S_IRUSR | stat.S_IXUSR)
        (root / claims.LOCK).chmod(stat.S_IRUSR)
        where = r"\.composer_par\.lock"
    try:
        with pytest.raises(CheckpointError, match=rf"cannot clean stale steps: Permission "
                           rf"denied on \S*{where} .*must be writable"):
            ck.clean_stale(root, older_than=0)
    finally:
        root.chmod(stat.S_IRWXU)
        (root / claims.LOCK).chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_clean_removes_older_committed_steps_of_each_run_with_a_dry_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = reference()
    for step, run in [(1, "a"), (2, "a"), (3, "a"), (4, "b")]:
        ck.save(tmp_path, model, step=step, run=run)
    assert cli(["clean", str(tmp_path), "--older-than", "1h", "--keep-last", "1"]) == 0
    assert _steps(tmp_path) == [1, 2, 3, 4]  # committed moments ago: not old enough
    capsys.readouterr()
    assert cli(["--json", "clean", str(tmp_path), "--older-than", "0", "--keep-last", "1",
                "--dry-run"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dry_run"] is True and _steps(tmp_path) == [1, 2, 3, 4]
    assert data["removed_committed"] == [str(tmp_path / f"step-00000000{s}") for s in (1, 2)]
    assert cli(["clean", str(tmp_path), "--older-than", "0", "--keep-last", "1",
                "--run", "b"]) == 0
    assert _steps(tmp_path) == [1, 2, 3, 4]  # b's only step is its newest
    assert cli(["clean", str(tmp_path), "--older-than", "0", "--keep-last", "1"]) == 0
    assert "removed committed: " in capsys.readouterr().out
    assert _steps(tmp_path) == [3, 4]
    assert cli(["clean", str(tmp_path), "--older-than", "0", "--run", "a"]) == 2
    assert "give --keep-last too" in capsys.readouterr().err


def test_load_fills_the_model_like_before_for_a_root_of_one_run(tmp_path: Path) -> None:
    model = reference(seed=4)
    ck.save(tmp_path, model, step=7)
    fresh = reference(seed=9)
    info = ck.load(tmp_path, fresh)
    assert info.step == 7 and info.run == claims.job_id()
    assert all(torch.equal(v, state(model)[k]) for k, v in state(fresh).items())


def test_a_damaged_commit_marker_is_named_when_it_may_be_the_newest(tmp_path: Path) -> None:
    model = reference()
    for step in (1, 2, 3):
        ck.save(tmp_path, model, step=step, run="a")
    (tmp_path / "step-000000001" / steps.MARKER).write_text("{not json")
    assert ck.load(tmp_path, reference(seed=9)).step == 3  # an older one: as before
    (tmp_path / "step-000000003" / steps.MARKER).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step-000000003/COMMITTED: the commit "
                       r"marker is not valid JSON"):
        ck.load(tmp_path, reference(seed=9))


def test_retention_leaves_a_step_a_load_is_reading_for_a_later_save(tmp_path: Path) -> None:
    model = reference()
    ck.save(tmp_path, model, step=1, keep_last=1, run="a")
    with steps.reading(tmp_path / "step-000000001"):
        ck.save(tmp_path, model, step=2, keep_last=1, run="a")
        assert _steps(tmp_path) == [1, 2]
    ck.save(tmp_path, model, step=3, keep_last=1, run="a")
    assert _steps(tmp_path) == [3]
