"""Exclusive saves: a save claims its step directory, never removes one another job may
be writing, and stale unfinished steps are cleaned only explicitly. Two real multi-rank
jobs saving the same steps into one root at the same moment: exactly one wins each."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_par import checkpoint as ck
from composer_par.checkpoint import claims, steps
from composer_par.checkpoint.errors import CheckpointError
from composer_par.testing.distributed import run_ranks
from tests import checkpoint_io_workers as workers
from tests.test_checkpoint_io import dead_pid, reference, state, write_claim


def _unfinished(root: Path, step: int, **claim: Any) -> Path:
    """An unfinished step directory with a shard file and (unless ``claim`` is None) a
    claim of another job."""
    directory = root / steps.step_name(step)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"half a shard")
    if claim.pop("none", False) is False:
        write_claim(directory, **claim)
    return directory


def test_a_live_job_s_unfinished_step_is_never_removed(tmp_path: Path) -> None:
    directory = _unfinished(tmp_path, 4)  # claimed by a job whose pid (ours) runs
    with pytest.raises(CheckpointError) as err:
        ck.save(tmp_path, reference(), step=4)
    text = str(err.value)
    assert str(directory) in text and "being written by another job other-job" in text
    assert f"pid {os.getpid()}" in text and "is running" in text
    assert (directory / "__0_0.distcp").read_bytes() == b"half a shard"
    assert not steps.is_committed(directory)


def test_a_claim_from_another_machine_is_not_taken_over(tmp_path: Path) -> None:
    directory = _unfinished(tmp_path, 4, pid=dead_pid(), host="elsewhere")
    with pytest.raises(CheckpointError, match=r"claimed on another machine \(elsewhere\)"):
        ck.save(tmp_path, reference(), step=4)
    assert (directory / "__0_0.distcp").exists()


def test_a_dead_job_s_step_is_taken_over(tmp_path: Path) -> None:
    directory = _unfinished(tmp_path, 4, pid=dead_pid())
    model = reference()
    assert ck.save(tmp_path, model, step=4) == directory
    claim = claims.read_claim(directory)
    assert claim is not None and claim.id == claims.job_id() and claim.pid == os.getpid()
    fresh = reference(seed=9)
    ck.load(directory, fresh)
    assert all(torch.equal(v, state(model)[k]) for k, v in state(fresh).items())


def test_an_earlier_torchrun_attempt_of_the_same_run_is_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _unfinished(tmp_path, 4, host="another-node")
    data = json.loads((directory / claims.CLAIM).read_text())
    data.update(run_id="run-7", restart=0)
    (directory / claims.CLAIM).write_text(json.dumps(data))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(CheckpointError, match="claimed on another machine"):
        ck.save(tmp_path, reference(), step=4)  # the same attempt: maybe still alive
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert ck.save(tmp_path, reference(), step=4) == directory
    assert claims.read_claim(directory).restart == 1  # type: ignore[union-attr]


def test_a_forked_process_is_another_job() -> None:
    """Jobs forked from one parent (a launcher that imported composer_par first) must not
    share an id, or one could take over the other's live step as its own."""
    read, write = os.pipe()
    parent = claims.job_id()
    pid = os.fork()
    if pid == 0:  # the child: report its id, leave without running pytest's teardown
        os.write(write, claims.job_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child and child != parent and claims.job_id() == parent


def test_a_committed_step_names_the_job_that_saved_it(tmp_path: Path) -> None:
    ck.save(tmp_path, reference(), step=2)
    with pytest.raises(CheckpointError, match=rf"already a committed checkpoint \(saved by "
                       rf"job {claims.job_id()} \(host "):
        ck.save(tmp_path, reference(), step=2)


def test_clean_stale_keeps_young_and_live_steps_and_never_committed_ones(
        tmp_path: Path) -> None:
    old = time.time() - 7200

    def age(directory: Path) -> None:
        for path in [directory, *directory.rglob("*")]:
            os.utime(path, (old, old), follow_symlinks=False)
        claim = directory / claims.CLAIM
        if claim.exists():
            data = json.loads(claim.read_text())
            data["claimed_at"] = old
            claim.write_text(json.dumps(data))
            os.utime(claim, (old, old))

    young_dead = _unfinished(tmp_path, 1, pid=dead_pid())
    old_dead = _unfinished(tmp_path, 2, pid=dead_pid())
    old_live = _unfinished(tmp_path, 3)
    old_unclaimed = _unfinished(tmp_path, 4, none=True)
    old_elsewhere = _unfinished(tmp_path, 5, host="elsewhere")
    committed = ck.save(tmp_path, reference(), step=6)
    for directory in (old_dead, old_live, old_unclaimed, old_elsewhere, committed):
        age(directory)
    leftover = tmp_path / ".step-000000009.claim-abc-123"
    leftover.mkdir()
    os.utime(leftover, (old, old))
    with pytest.raises(ValueError, match="older_than"):
        ck.clean_stale(tmp_path, older_than=-1)
    dry = ck.clean_stale(tmp_path, older_than=3600, dry_run=True)
    assert old_dead.exists() and set(dry.removed) == {old_dead, old_unclaimed, old_elsewhere,
                                                       leftover}
    cleaned = ck.clean_stale(tmp_path, older_than=3600)
    assert set(cleaned.removed) == {old_dead, old_unclaimed, old_elsewhere, leftover}
    kept = dict(cleaned.kept)
    assert "younger than 3600 s" in kept[young_dead]
    assert "claimed by a live job other-job" in kept[old_live]
    assert [s for s, _, _ in steps.step_dirs(tmp_path)] == [1, 3, 6]
    assert steps.is_committed(committed) and not list(tmp_path.glob(".trash-*"))


def test_inspect_shows_who_claims_an_unfinished_step(tmp_path: Path) -> None:
    ck.save(tmp_path, reference(), step=1)
    _unfinished(tmp_path, 2)
    _unfinished(tmp_path, 3, pid=dead_pid())
    rows = {row["step"]: row for row in ck.describe(tmp_path)["steps"]}
    assert rows[2]["claim"]["job"] == "other-job" and rows[2]["claim"]["state"] == "live"
    assert rows[3]["claim"]["state"] == "dead" and "not running" in rows[3]["claim"]["why"]


def test_inspect_clean_stale_removes_only_what_nothing_writes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from composer_par.cli.main import main

    ck.save(tmp_path, reference(), step=1)
    gone = _unfinished(tmp_path, 2, pid=dead_pid())
    live = _unfinished(tmp_path, 3)
    old = time.time() - 7200
    for directory in (gone, live):
        for path in [directory, *directory.rglob("*")]:
            os.utime(path, (old, old))
        data = json.loads((directory / claims.CLAIM).read_text())
        data["claimed_at"] = old
        (directory / claims.CLAIM).write_text(json.dumps(data))
        os.utime(directory / claims.CLAIM, (old, old))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path), "--clean-stale", "1h", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cleaned"]["removed"] == [str(gone)]
    assert [k["path"] for k in data["cleaned"]["kept"]] == [str(live)]
    assert [s["step"] for s in data["steps"]] == [1, 3]
    assert main(["inspect", str(tmp_path), "--clean-stale", "soon"]) == 2
    assert "expected an age like 3600, 30m, 2h or 1d" in capsys.readouterr().err


# -- real jobs ------------------------------------------------------------------------------

TRIALS = 20


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_jobs_saving_the_same_steps_at_once_exactly_one_wins_each(tmp_path: Path) -> None:
    """Two independent 2-rank jobs (each its own process group) save into one root at the
    same explicit step, released together, 20 times: each time exactly one save succeeds,
    the other fails naming the directory and the winner, and the committed directory
    holds the winner's weights, bitwise."""
    root, sync = tmp_path / "root", tmp_path / "sync"
    sync.mkdir()
    results: dict[str, Any] = {}

    def job(name: str, peer: str, seed: int) -> None:
        try:
            results[name] = run_ranks(workers.concurrent_saves, 2, timeout=500, args=(
                str(root), str(sync), name, peer, TRIALS, seed))[0]
        except BaseException as exc:  # reported by the main thread
            results[name] = exc

    threads = [threading.Thread(target=job, args=("a", "b", 1)),
               threading.Thread(target=job, args=("b", "a", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        if isinstance(results[name], BaseException):
            raise results[name]
    ids = {name: results[name]["job"] for name in ("a", "b")}
    wins = {"a": 0, "b": 0}
    for trial in range(TRIALS):
        directory = root / steps.step_name(trial)
        outcome = {name: results[name]["outcomes"][trial] for name in ("a", "b")}
        winners = [name for name in ("a", "b") if outcome[name][0] == "ok"]
        assert len(winners) == 1, (trial, {n: o[0] for n, o in outcome.items()})
        winner = winners[0]
        loser = "b" if winner == "a" else "a"
        wins[winner] += 1
        error = outcome[loser][0]
        assert str(directory) in error and f"job {ids[winner]}" in error, (trial, error)
        assert claims.read_claim(directory).id == ids[winner]  # type: ignore[union-attr]
        loaded = reference(seed=99)
        ck.load(directory, loaded)
        expected = {k.removeprefix("model."): v for k, v in outcome[winner][1].items()}
        got = state(loaded)
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            assert torch.equal(value, got[key]), (trial, winner, key)
    assert sum(wins.values()) == TRIALS


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_failing_rank_s_error_reaches_every_rank(tmp_path: Path) -> None:
    errors = run_ranks(workers.one_rank_fails_saving, 2, args=(str(tmp_path), 1), timeout=200)
    for rank, error in enumerate(errors):
        assert "saving" in error and "nothing committed" in error, (rank, error)
        assert "rank 1: writing its files: AttributeError" in error, (rank, error)
        assert "get_state" in error, (rank, error)
        assert "another rank" not in error
    # The failed save removed its own directory: nothing half-written is left.
    assert steps.step_dirs(tmp_path) == [] and ck.latest(tmp_path) is None
