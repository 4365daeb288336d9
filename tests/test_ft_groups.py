"""Fault-tolerant replica groups for real: a lighthouse (the composer-par command), two
replica groups of two gloo ranks each (each its own launch, TCPStore and process group),
a group SIGKILLed mid-step, the other training on alone, the dead group restarted and
healed from the live one through torchft's transport.

After the run every rank of both groups holds the same parameters bitwise, and they
equal (fp32 tolerance) one process that trained with the same participants at each step;
the surviving group committed every step exactly once, its losses those of that run. The
same with HSDP alone x TP inside each group, and with DiLoCo (against one process running
DiLoCo with the same groups at each sync). A whole-job restart resumes from a checkpoint
(with torchft's step count); a lighthouse that does not answer fails apply in time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

from tests import ft_workers
from tests.ft_launch import Group, lighthouse, quorum_status, wait_for
from tests.processes import MARK_ENV, kill_marked, new_mark

RTOL, ATOL = 1.3e-6, 1e-5
STEPS = 10
KILL_AT = 3  # group 1 dies inside this step's forward
HOLD_AT = 7  # group 0 waits here until the restarted group asks for a quorum


def _records(run: Path, group: str, rank: int = 0) -> list[dict[str, Any]]:
    path = run / f"{group}-rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _applied(run: Path, group: str) -> list[int]:
    return [r["step"] for r in _records(run, group) if r["applied"]]


def _kill_and_heal(kind: str, run: Path, hold_at: int = HOLD_AT) -> None:
    """The scenario of the module for plan ``kind``: g0 and g1 start together; g1 stops
    inside step KILL_AT and is SIGKILLed; g0 trains on; g1 is launched again ("g1b"),
    heals, and both finish STEPS steps."""
    # A learning-rate scheduler (tracked, healed with the model) except under DiLoCo,
    # whose reference keeps the inner learning rate fixed.
    lr = {"schedule_lr": kind != "diloco"}
    with lighthouse(log=run / "lighthouse.log") as address:
        plan = ft_workers.plan_text(kind, address)
        groups = [
            Group("g0", 2, ft_workers.train, (plan, str(run), "g0", STEPS), run,
                  {"REPLICA_GROUP_ID": "0"},
                  {"wait_for": ("g1",), "hold_at": hold_at, "hold_for": "release", **lr}),
            Group("g1", 2, ft_workers.train, (plan, str(run), "g1", STEPS), run,
                  {"REPLICA_GROUP_ID": "1"}, {"wait_for": ("g0",), "pause_at": KILL_AT, **lr}),
        ]
        try:
            wait_for(lambda: all((run / f"g1-rank{r}-paused").exists() for r in range(2)),
                     "group 1 to stop inside its step", 240, tuple(groups))
            groups[1].kill()
            wait_for(lambda: len(_applied(run, "g0")) >= KILL_AT + 2,
                     "group 0 to train on alone", 240, (groups[0],))
            groups.append(Group("g1b", 2, ft_workers.train, (plan, str(run), "g1b", STEPS),
                                run, {"REPLICA_GROUP_ID": "1"}, lr))
            # While group 0 holds, the one group asking for a quorum is the restarted one.
            wait_for(lambda: (run / "g0-holding").exists()
                     and "only have 1 participants" in quorum_status(address),
                     "the restarted group to ask for a quorum", 240, tuple(groups[::2]))
            (run / "release").touch()
            groups[0].wait(300)
            groups[2].wait(300)
        finally:
            for group in groups:
                group.kill()


def _check(run: Path, shards_per_group: int = 2) -> list[tuple[int, ...]]:
    """Check the scenario's records and parameters; returns who took part in each step."""
    import torch

    g0 = _records(run, "g0")
    # The surviving group applied every step once, in order; one attempt was discarded:
    # the step whose all-reduce lost group 1.
    assert _applied(run, "g0") == list(range(STEPS)), g0
    discarded = [r for r in g0 if not r["applied"]]
    assert [r["step"] for r in discarded] == [KILL_AT], g0
    # Who took part in each applied step, from both groups' records.
    schedule: list[tuple[int, ...]] = []
    for at in range(STEPS):
        members = [0]
        for name in ("g1", "g1b"):
            if any(r["step"] == at and r["applied"] and r["quorum"]["participating"]
                   for r in _records(run, name)):
                members.append(1)
        schedule.append(tuple(members))
    both = [(0, 1)]
    assert schedule == both * KILL_AT + [(0,)] * (HOLD_AT - KILL_AT) + both * (
        STEPS - HOLD_AT), schedule
    # The restarted group healed from group 0 before its first step, then trained on.
    again = _records(run, "g1b")
    assert again and again[0]["quorum"]["healed"] and again[0]["step"] == HOLD_AT, again
    assert not any(r["quorum"]["healed"] for r in again[1:]), again
    assert [r["quorum"]["participants"] for r in g0 if r["applied"]] == [
        len(members) for members in schedule]
    # Bitwise: every rank of both groups holds the same shards.
    states = {(g, r): torch.load(run / f"{g}-rank{r}.pt", weights_only=True)
              for g in ("g0", "g1b") for r in range(2)}
    for r in range(2):
        for name, tensor in states[("g0", r)]["local"].items():
            assert torch.equal(tensor, states[("g1b", r)]["local"][name]), (r, name)
    # And the run with the same participants at each step.
    losses, params = ft_workers.reference(schedule, 2, shards_per_group)
    for key, (g, r) in enumerate(states):
        full = states[(g, r)]["full"]
        assert set(full) == set(params), key
        for name, value in params.items():
            torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL,
                                       msg=f"{g} rank {r}: {name}")
    applied = [r["loss"] for r in g0 if r["applied"]]
    torch.testing.assert_close(torch.tensor(applied), torch.tensor(losses), rtol=RTOL,
                               atol=ATOL)
    return schedule


def _resume_whole_job(kind: str, run: Path, schedule: list[tuple[int, ...]]) -> None:
    """Every group of a new job (a new lighthouse too) resumes from group 0's last
    checkpoint, torchft's step count included, and trains one more step together."""
    import torch

    with lighthouse(log=run / "lighthouse-again.log") as address:
        plan = ft_workers.plan_text(kind, address)
        groups = [Group(f"r{g}", 2, ft_workers.train, (plan, str(run), f"r{g}", STEPS + 1),
                        run, {"REPLICA_GROUP_ID": str(g)},
                        {"wait_for": (f"r{1 - g}",), "resume_from": str(run / "ckpt")})
                  for g in range(2)]
        try:
            for group in groups:
                group.wait(300)
        finally:
            for group in groups:
                group.kill()
    for name in ("r0", "r1"):
        (record,) = _records(run, name)
        assert record["step"] == STEPS and record["applied"], record
        assert record["quorum"]["participants"] == 2 and not record["quorum"]["healed"]
    states = {(g, r): torch.load(run / f"{g}-rank{r}.pt", weights_only=True)
              for g in ("r0", "r1") for r in range(2)}
    for r in range(2):
        for name, tensor in states[("r0", r)]["local"].items():
            assert torch.equal(tensor, states[("r1", r)]["local"][name]), (r, name)
    _, params = ft_workers.reference([*schedule, (0, 1)], 2, 2)
    for (g, r), state in states.items():
        for name, value in params.items():
            torch.testing.assert_close(state["full"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=f"{g} rank {r}: {name}")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_killed_group_is_dropped_then_heals_hsdp_tp(tmp_path: Path) -> None:
    _kill_and_heal("hsdp_tp", tmp_path)
    _check(tmp_path, shards_per_group=1)


SYNC_EVERY = 2
DILOCO_HOLD = 6  # the start of a sync round


def _rounds(run: Path) -> list[dict[int, bool]]:
    """Each sync round's groups and whether each healed there, from the groups' records."""
    rounds: list[dict[int, bool]] = [{} for _ in range(STEPS // SYNC_EVERY)]
    for name, group in (("g0", 0), ("g1", 1), ("g1b", 1)):
        for record in _records(run, name):
            quorum = record["quorum"]  # the group's last sync, as of this step
            if quorum and quorum["committed"]:
                rounds[quorum["step"]][group] = quorum["healed"]
    return rounds


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_killed_group_is_dropped_then_heals_diloco(tmp_path: Path) -> None:
    import torch

    _kill_and_heal("diloco", tmp_path, hold_at=DILOCO_HOLD)
    rounds = _rounds(tmp_path)
    # Group 1 dies in round 1; group 0 syncs alone until the restarted group heals at
    # round 3's sync (its pseudo-gradient then is group 0's), and both sync round 4.
    assert rounds == [{0: False, 1: False}, {0: False}, {0: False}, {0: False, 1: True},
                      {0: False, 1: False}], rounds
    g0 = _records(tmp_path, "g0")
    assert [r["step"] for r in g0] == list(range(STEPS)), g0
    states = {(g, r): torch.load(tmp_path / f"{g}-rank{r}.pt", weights_only=True)
              for g in ("g0", "g1b") for r in range(2)}
    for r in range(2):
        for name, tensor in states[("g0", r)]["local"].items():
            assert torch.equal(tensor, states[("g1b", r)]["local"][name]), (r, name)
    losses, params = ft_workers.diloco_reference(rounds, 2, 2, SYNC_EVERY, (0.7, 0.9, True))
    for (g, r), state in states.items():
        for name, value in params.items():
            torch.testing.assert_close(state["full"][name], value, rtol=RTOL, atol=ATOL,
                                       msg=f"{g} rank {r}: {name}")
    torch.testing.assert_close(torch.tensor([r["loss"] for r in g0]), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_an_unreachable_lighthouse_fails_apply_within_the_timeout() -> None:
    import socket

    from composer_par.testing.distributed import run_ranks

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{sock.getsockname()[1]}"
    results = run_ranks(ft_workers.apply_without_lighthouse, 2, args=(address, 3.0),
                        env={"REPLICA_GROUP_ID": "0"}, timeout=180)
    for seconds, error in results:
        assert error.startswith("LighthouseUnreachable: no torchft lighthouse answers at "
                                f"{address} (waited 3 s, the plan's timeout"), error
        assert "composer-par lighthouse" in error
        assert 2.5 <= seconds < 3.0 + 5.0, seconds


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_when_the_lighthouse_dies_the_next_quorum_fails_naming_it(tmp_path: Path) -> None:
    from tests.ft_launch import start_lighthouse, stop

    address, process = start_lighthouse()
    group = None
    try:
        plan = ft_workers.plan_text("fsdp2", address, timeout=4.0).replace(
            "dp_replicate = 2", "dp_replicate = 1")
        group = Group("g0", 2, ft_workers.train_until_it_fails, (plan, str(tmp_path), "g0"),
                      tmp_path, {"REPLICA_GROUP_ID": "0"})
        wait_for(lambda: (tmp_path / "g0-rank0-at3").exists(), "three steps", 180, (group,))
        stop(process)  # the lighthouse dies; the steps already taken are kept
        group.wait(120)
    finally:
        stop(process)
        if group is not None:
            group.kill()
    for rank in range(2):
        result = json.loads((tmp_path / f"g0-rank{rank}-error.json").read_text())
        assert result["error"].startswith(
            "FaultToleranceError: replica group 0: no quorum formed within 4 s (the ft "
            f"plugin's timeout): the lighthouse at {address} did not answer"), result
        assert result["steps"] >= 3 and result["after"] < 4.0 + 30, result


def _torchrun(run: Path, name: str, group: int, mark: str, restarts: int = 0, **train: Any
              ) -> subprocess.Popen[bytes]:
    """One launch of replica group ``group`` by torchrun itself (2 ranks, its own
    rendezvous and store, ``restarts`` restarts); ``name`` tells its files apart."""
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", f"--max-restarts={restarts}", "--monitor-interval=0.5",
            str(root / "tests" / "ft_torchrun.py"),
            json.dumps({"rundir": str(run), "group": name, **train})]
    # A store of its own for each restart: on torch 2.13 a restart that reuses torchrun's
    # store reads the dead ranks' addresses (docs/reliability.md).
    env = {**os.environ, MARK_ENV: mark, "REPLICA_GROUP_ID": str(group),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(root),
           "OMP_NUM_THREADS": "1"}
    with (run / f"{name}-torchrun.log").open("ab") as log:  # the child keeps its copy
        return subprocess.Popen(argv, env=env, cwd=root, stdout=log, stderr=log)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_killed_group_is_dropped_then_heals_fsdp2_under_torchrun(tmp_path: Path) -> None:
    """The documented launch, one torchrun per replica group, FSDP2 inside each: rank 0
    of group 1 SIGKILLs itself inside step KILL_AT; torchrun ends the group and starts
    it again (--max-restarts); group 0's step is discarded and it trains on alone; the
    restarted group 1 heals from group 0 and both finish. Then the whole job restarts
    from group 0's checkpoint."""
    run, mark = tmp_path, new_mark()
    try:
        with lighthouse(log=run / "lighthouse.log") as address:
            plan = ft_workers.plan_text("fsdp2", address)
            g0 = _torchrun(run, "g0", 0, mark, plan=plan, steps=STEPS, wait_for=["g1"],
                           hold_at=HOLD_AT, hold_for="release", save_to=str(run / "ckpt"))
            g1 = _torchrun(run, "g1", 1, mark, restarts=1, plan=plan, steps=STEPS,
                           wait_for=["g0"], die_at=KILL_AT)
            # While group 0 holds, the one group asking for a quorum is the restarted one.
            deadline = time.monotonic() + 400
            while not ((run / "g0-holding").exists()
                       and "only have 1 participants" in quorum_status(address)):
                assert time.monotonic() < deadline and g0.poll() is None, (
                    (run / "g0-torchrun.log").read_text()[-4000:])
                time.sleep(0.2)
            (run / "release").touch()
            assert g0.wait(300) == 0, (run / "g0-torchrun.log").read_text()[-4000:]
            assert g1.wait(300) == 0, (run / "g1-torchrun.log").read_text()[-4000:]
    finally:
        kill_marked(mark)
    assert (run / "g1-died").exists() and _records(run, "g1b")
    schedule = _check(run)
    _resume_whole_job("fsdp2", run, schedule)
