"""The default process group's timeout against the plan's, on real gloo ranks started the
plain way (``init_process_group`` in the user's script, not the test harness): a default
group that waits longer than the plan says is warned about in one line, on rank 0 only,
however many plans are applied; a group given the plan's timeout gets no line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.timeout_workers import rank_main

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _run(tmp_path: Path, timeout_s: float | None) -> list[list[str]]:
    world = 2
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, str(tmp_path / "init"),
                                                 str(outs[r]), timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [json.loads(out.read_text()) for out in outs]


def test_torchs_default_timeout_is_warned_about_once_on_rank_0(tmp_path: Path) -> None:
    rank0, rank1 = _run(tmp_path, None)  # torch's default: 30 minutes on gloo
    assert len(rank0) == 1, rank0
    assert "whose timeout is longer than the plan's" in rank0[0]
    assert "default_group_timeout_s=1800.0" in rank0[0] and "plan_timeout_s=300.0" in rank0[0]
    assert rank1 == []


def test_the_plans_timeout_given_to_the_group_is_not_warned_about(tmp_path: Path) -> None:
    assert _run(tmp_path, 300.0) == [[], []]
