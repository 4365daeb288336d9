"""The multi-process harness itself: real gloo ranks on CPU."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from composer_par.testing import RankFailure, RankTimeout, run_ranks
from composer_par.testing.parity import ATOL, ParityCase, ParityResult, parity_result
from composer_par.testing.pytest_plugin import Ranks
from tests import harness_workers as w

pytestmark = pytest.mark.distributed


HAVE_PROC = Path("/proc/self/stat").exists()
_HELPER = re.compile(r"from multiprocessing\.(forkserver|resource_tracker) import main")


def _descendants(root: int) -> dict[int, str]:
    """Live processes below ``root``, pid to command line, save multiprocessing's helpers.

    The forkserver and the resource tracker, children of ``root``, live as long
    as it does. Rank processes are children of the forkserver (and share its
    command line), so they are still found.
    """
    children: dict[int, list[int]] = {}
    zombies = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name may contain spaces and parentheses; state and
            # ppid follow the last ')'.
            state, ppid = stat.rpartition(")")[2].split()[:2]
            children.setdefault(int(ppid), []).append(int(entry.name))
            if state == "Z":
                zombies.add(int(entry.name))
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        helper = pid in children[root] and _HELPER.search(cmdline)
        if pid not in zombies and not helper:
            found[pid] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    assert multiprocessing.active_children() == []
    if HAVE_PROC:
        assert _descendants(os.getpid()) == {}


def _sections(message: str) -> dict[int, str]:
    """Split a RankFailure message into its per-rank sections."""
    parts = re.split(r"^--- rank (\d+)/\d+: ", message, flags=re.MULTILINE)
    return {int(rank): body for rank, body in zip(parts[1::2], parts[2::2], strict=True)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order(world_size: int, tmp_path: Path) -> None:
    results = run_ranks(
        w.describe_rank,
        world_size,
        args=("t",),
        workdir=tmp_path,
        env={"EXTRA": "x"},
        threads_per_rank=2,
    )
    total = world_size * (world_size + 1) / 2
    assert results == [
        {
            "tag": "t",
            "rank": r,
            "world_size": world_size,
            "sum": total,
            "threads": 2,
            "env": {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(world_size),
                "EXTRA": "x",
            },
        }
        for r in range(world_size)
    ]
    # The run's temp dir (store, logs) is cleaned up.
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_function_by_name_and_kwargs() -> None:
    results = run_ranks("tests.harness_workers:describe_rank", 2, kwargs={"tag": "k"})
    assert [r["tag"] for r in results] == ["k", "k"]


@pytest.mark.timeout(60)
def test_raising_rank_is_reported_and_siblings_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(w.raise_on_rank, 3, args=(1,), timeout=50)
    # The siblings were blocked in all_reduce: they were stopped after the grace,
    # not left to the timeout.
    assert time.monotonic() - start < 15
    assert type(info.value) is RankFailure
    assert info.value.failed_ranks[0] == 1, info.value
    message = str(info.value)
    sections = _sections(message)
    assert next(iter(sections)) == 1
    assert sections[1].startswith("raised\nTraceback")
    assert "ValueError: boom from rank 1" in sections[1]
    assert set(sections) == {0, 1, 2}


@pytest.mark.timeout(60)
def test_exiting_rank_is_reported_with_exit_code() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(w.exit_on_rank, 2, args=(1, 3))
    assert info.value.failed_ranks[0] == 1, info.value
    assert _sections(str(info.value))[1].startswith("exited with code 3 before reporting")


@pytest.mark.timeout(60)
def test_crashing_rank_is_reported_with_signal_and_stack() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(w.segfault_on_rank, 2, args=(0,))
    assert info.value.failed_ranks[0] == 0, info.value
    section = _sections(str(info.value))[0]
    assert section.startswith("killed by signal SIGSEGV before reporting")
    # faulthandler's report, read from the rank's stderr.
    assert "in segfault_on_rank" in section


@pytest.mark.timeout(60)
def test_hang_times_out_with_every_rank_stack() -> None:
    with pytest.raises(RankTimeout, match="the call took over 3s") as info:
        run_ranks(w.hang_on_rank, 2, args=(1,), timeout=3)
    assert set(info.value.failed_ranks) == {0, 1}, info.value
    sections = _sections(str(info.value))
    assert set(sections) == {0, 1}
    for body in sections.values():
        assert body.startswith("still running when stopped")
        assert "in hang_on_rank" in body
    assert "in all_reduce" in sections[0]


@pytest.mark.timeout(60)
def test_abort_after_reporting_is_not_a_failure(tmp_path: Path) -> None:
    assert run_ranks(w.abort_after_report, 2, args=(str(tmp_path),)) == [0, 1]
    # Rank 0 did abort, while the harness was still waiting for rank 1.
    assert (tmp_path / "rank0.aborted").exists()


@pytest.mark.timeout(60)
def test_tensor_results_outlive_their_rank() -> None:
    results = run_ranks(w.rank_tensor, 2)
    assert [t.tolist() for t in results] == [[0.0, 0.0], [1.0, 1.0]]


@pytest.mark.timeout(60)
def test_unpicklable_result_is_a_failure() -> None:
    with pytest.raises(RankFailure, match="could not send the result of rank 0"):
        run_ranks(w.unpicklable_result, 1)


@pytest.mark.timeout(60)
def test_missing_function_fails_every_rank() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks("tests.harness_workers:no_such_function", 2)
    assert sorted(info.value.failed_ranks) == [0, 1]
    assert "AttributeError" in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAVE_PROC, reason="needs /proc")
def test_ranks_die_with_the_process_that_started_them() -> None:
    code = (
        "from composer_par.testing import run_ranks\n"
        "from tests import harness_workers as w\n"
        "run_ranks(w.hang_on_rank, 2, args=(1,), timeout=60)\n"
    )
    root = Path(__file__).parents[1]
    starter = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 45
        while len(ranks := _descendants(starter.pid)) < 2:
            assert starter.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 10
    while alive := [pid for pid in ranks if _alive(pid)]:
        assert time.monotonic() < deadline, alive
        time.sleep(0.05)


def test_local_function_is_rejected_before_starting() -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="module level"):
        run_ranks(local, 2)


@pytest.mark.timeout(60)
def test_concurrent_runs_do_not_collide(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(run_ranks, w.describe_rank, 2, args=(tag,), workdir=tmp_path)
            for tag in ("a", "b")
        ]
        results = [f.result() for f in futures]
    assert [[r["tag"] for r in rs] for rs in results] == [["a", "a"], ["b", "b"]]
    assert [[r["sum"] for r in rs] for rs in results] == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.timeout(60)
def test_ranks_helper(tmp_path: Path) -> None:
    assert [r["rank"] for r in Ranks(tmp_path).run(w.describe_rank, 2, args=("r",))] == [0, 1]


@pytest.mark.timeout(60)
def test_ranks_fixture(request: pytest.FixtureRequest) -> None:
    if not request.config.pluginmanager.hasplugin("composer_par"):
        pytest.skip("composer_par is not installed, so its pytest11 entry point is not registered")
    ranks = request.getfixturevalue("ranks")
    assert [r["rank"] for r in ranks.run(w.describe_rank, 2, args=("f",))] == [0, 1]


# -- parity compares every rank's parameters ------------------------------------------------

TP2 = """
[mesh]
tp = 2

[[plugins]]
name = "tp"

[[plugins]]
name = "meta_init"
seed = 7
"""
DRIFTED = "layers.0.attention_norm.weight"  # Replicate under TP: each rank holds a copy


@pytest.mark.timeout(240)
def test_parity_compares_every_ranks_parameters_not_rank_0s_alone() -> None:
    """A norm weight moved by 1e-3 on rank 1 alone after training: the losses and rank 0's
    view are at parity (what was compared before), every rank's view is not."""
    case = ParityCase(task="composer_par.testing.tasks:llama", plan=TP2, world_size=2,
                      lr=1.0)
    result = parity_result(case, run_ranks(w.train_then_drift, 2,
                                           args=(case, DRIFTED, 1, 1e-3), timeout=200))
    assert len(result.rank_params) == 2 and result.params is result.rank_params[0]
    rank_0_alone = ParityResult(result.losses, result.reference_losses, result.params,
                                result.reference_params)
    rank_0_alone.assert_close()
    assert result.max_param_diff(0)[1] <= ATOL
    with pytest.raises(AssertionError,
                       match=rf"^rank 1: parameter {re.escape(DRIFTED)} differs from the "
                             "reference") as failure:
        result.assert_close()
    assert "rank 0" not in str(failure.value)
    name, diff = result.max_param_diff()
    assert name == DRIFTED and diff == pytest.approx(1e-3, abs=ATOL)


@pytest.mark.xdist_group("groups_hold")
def test_xdist_groups_are_honoured_under_loadgroup(request: pytest.FixtureRequest) -> None:
    """Modules that keep one launch for all their tests, and the scheduler tests that
    must not run beside each other, rely on ``xdist_group``. pytest 9.2 with
    pytest-xdist 3.8 ignores the mark with no word (pytest-xdist#1386; ./dev installs
    pytest 9.1.1): this fails there instead."""
    if not getattr(request.config.option, "loadgroup", False):  # set on xdist's workers
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@groups_hold"), request.node.nodeid
