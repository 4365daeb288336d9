"""pp's ``overlap``: DualPipeV's overlapped forward and backward run at once, one
microbatch's expert all-to-alls while the other computes.

The turn-taking itself (composer_par.plugin.overlap) on two threads; what validation
refuses (CP613); the estimate's share of all-to-alls that runs behind the paired
compute, against torch's own DualPipeV order; and on 4 gloo ranks, pp(2) x ep(2) with
FSDP2 over ep, with and without full activation checkpointing, against one process:
every rank's parameters, with the pairs seen to run and their turns taken in one order
on every rank; with HSDP in place of FSDP2, and on transformers' Mixtral.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from composer_par import EP, FSDP2, PP, TP, MeshSpec, ParallelPlan
from composer_par.plugin import overlap
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import assert_every_rank
from tests.ep_pp_workers import Case, reference
from tests.test_ep_pp import EP as EP_TABLE
from tests.test_ep_pp import FSDP2 as FSDP2_TABLE
from tests.test_ep_pp import _held_part_close, plan_toml, pp

# -- taking turns ---------------------------------------------------------------------


class _Logged(torch.autograd.Function):
    """Stands for a collective: logs its span in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[tuple[str, str]], who: str
                ) -> torch.Tensor:
        ctx.log, ctx.who = log, who
        _span(log, who)
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _span(ctx.log, ctx.who)
        return grad, None, None


def _span(log: list[tuple[str, str]], who: str) -> None:
    log.append((who, "start"))
    time.sleep(0.01)  # long enough for the other thread to run into it if it could
    log.append((who, "end"))


def _marked_comms(x: torch.Tensor, n: int, log: list[tuple[str, str]], who: str
                  ) -> torch.Tensor:
    for _ in range(n):
        x = x * 2  # compute
        x = overlap.comm_ends(_Logged.apply(overlap.comm_begins(x), log, who))
    return x


def _segments(log: list[tuple[str, str]]) -> list[str]:
    """Who held each comm span, in order; asserts no two spans overlapped."""
    order = []
    for (who, what), (after, then) in zip(log[::2], log[1::2], strict=True):
        assert (what, then) == ("start", "end") and who == after, log
        order.append(who)
    return order


def test_turns_alternate_backward_first_and_never_overlap() -> None:
    log: list[tuple[str, str]] = []
    with overlap.marking():
        # the backward's graph made before the pair, as a pipeline's earlier forward is
        x = torch.ones(3, requires_grad=True)
        loss = _marked_comms(x, 3, log, "B").sum()
        log.clear()
        overlap.paired(
            lambda: _marked_comms(torch.ones(3, requires_grad=True), 5, log, "F"),
            loss.backward)
    # strictly alternating from the backward's; the forward's two extra spans after the
    # backward has finished
    assert _segments(log) == ["B", "F", "B", "F", "B", "F", "F", "F"]
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 8.0))


def test_marks_are_plain_outside_a_pair_and_made_only_while_marking() -> None:
    x = torch.ones(2, requires_grad=True)
    assert overlap.comm_begins(x) is x and overlap.comm_ends(x) is x
    with overlap.marking():
        marked = overlap.comm_begins(x)
        assert marked is not x and marked.grad_fn is not None
    # outside a pair, the marks' backward waits for nothing
    (marked * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0))


def test_a_failing_backward_thread_releases_the_forward_and_raises_here() -> None:
    log: list[tuple[str, str]] = []

    def backward() -> None:
        raise ValueError("backward failed")

    with overlap.marking(), pytest.raises(ValueError, match="backward failed"):
        overlap.paired(lambda: _marked_comms(torch.ones(2, requires_grad=True), 2, log, "F"),
                       backward)
    assert _segments(log) == ["F", "F"]
    assert not [t for t in threading.enumerate() if t.name.startswith("composer_par paired")]
    with pytest.raises(RuntimeError, match="already running"):
        overlap.paired(lambda: overlap.paired(lambda: None, lambda: None), lambda: None)


# -- validation -------------------------------------------------------------------------


def _codes(plan: ParallelPlan) -> list[str]:
    return [f.code for f in plan.validate(world_size=plan.mesh.world_size).findings]


def test_cp613_overlap_needs_dualpipev_and_marked_collectives() -> None:
    ep_plan = ParallelPlan(MeshSpec(pp=2, dp_shard=1, ep=2)).use(
        PP(schedule="DualPipeV", overlap=True)).use(FSDP2()).use(EP())
    assert _codes(ep_plan) == []
    one = ParallelPlan(MeshSpec(pp=2)).use(PP(schedule="1F1B", overlap=True))
    report = one.validate(world_size=2)
    assert [f.code for f in report.findings] == ["CP613"]
    assert "1F1B has none" in report.findings[0].message
    with_tp = ParallelPlan(MeshSpec(pp=2, dp_shard=1, ep=2, tp=2)).use(
        PP(schedule="DualPipeV", overlap=True)).use(TP()).use(FSDP2()).use(EP())
    found = [f for f in with_tp.validate(world_size=16).findings if f.code == "CP613"]
    assert len(found) == 1 and "the tp plugin's collectives over tp(2)" in found[0].message
    with pytest.raises(ValueError, match="overlap"):
        PP(overlap="yes")  # type: ignore[arg-type]


# -- the estimate ----------------------------------------------------------------------


def test_paired_shares_are_torchs_dualpipev_pairs() -> None:
    from composer_par.plugins.pp.estimate import paired_shares
    from composer_par.plugins.pp.timeline import timeline

    # torch's DualPipeV, rank r of p over n microbatches: its steady state pairs
    # 2 (n - 2p + r + 1) - [r = p - 1] forwards of the rank's first stage and
    # p - r - 1 more of its second: the rank's share of its 2n passes, per stage
    for p, n in ((2, 4), (4, 8), (16, 120)):
        shares = paired_shares(timeline("DualPipeV", p, 2, n), n)
        for r in range(p):
            pairs = 2 * (n - 2 * p + r + 1) - (r == p - 1) + (p - r - 1)
            assert shares[r] == shares[2 * p - 1 - r] == pytest.approx(pairs / (2 * n))
    assert paired_shares(timeline("Interleaved1F1B", 2, 2, 4), 4) == {}


def test_the_estimate_hides_the_paired_all_to_alls_behind_compute() -> None:
    from composer_par.estimate import Workload, estimate_plan, preset

    def estimate(over: bool) -> Any:
        plan = ParallelPlan(MeshSpec(pp=4, dp_shard=2, ep=8)).use(
            PP(schedule="DualPipeV", microbatches=16, overlap=over)).use(FSDP2()).use(EP())
        return estimate_plan(plan, preset("mixtral-8x7b"), Workload(seq=4096),
                             world_size=64)

    alone, paired = estimate(False), estimate(True)
    shown = {t.dim.name: t for t in paired.traffic}["ep"]
    before = {t.dim.name: t for t in alone.traffic}["ep"]
    assert before.overlapped_seconds == 0
    assert shown.seconds == pytest.approx(before.seconds, rel=1e-3)
    # pp 4 over 16 microbatches: the least paired stage pairs 2n - 3p + 1 = 21 of 32
    assert shown.overlapped_seconds / shown.seconds == pytest.approx(21 / 32, abs=0.05)
    assert paired.step.seconds < alone.step.seconds


def test_suggest_pairs_microbatches_only_beside_marked_collectives() -> None:
    from composer_par.plugins.pp.suggest import suggest_axes

    from composer_par.estimate import Workload, preset
    from composer_par.plugin import Role, SuggestContext, Topology

    plugin = PP(schedule="DualPipeV", overlap=True)
    model, topology = preset("mixtral-8x7b"), Topology(2, 8)
    (axis,) = suggest_axes(plugin, model, topology)
    roles = {"pp": Role.OTHER, "ep": Role.MODEL_PARALLEL, "tp": Role.MODEL_PARALLEL}

    def picked(**sizes: int) -> Any:
        ctx = SuggestContext(sizes, 8, topology, model, Workload(seq=4096), roles,
                             ("ep",), ("ep",))
        return [(c.label, c.options["overlap"]) for c in axis.choices(ctx)]

    assert picked(pp=2, ep=8) == [("PP 2 DualPipeV overlap", True)]
    assert picked(pp=2, ep=4, tp=2) == [("PP 2 DualPipeV", False)]


# -- on 4 gloo ranks ------------------------------------------------------------------


def _train_counting(cases: list[Case]) -> list[Any]:
    """Each case trained (tests/ep_pp_workers.py), with how many pairs ran and who held
    each turn at the marked collectives, in order."""
    from tests.ep_pp_workers import train

    turns: list[str] = []
    pairs = [0]
    begin, paired = overlap._Turns.begin, overlap.paired

    def counted_begin(self: Any, side: str) -> None:
        begin(self, side)
        if self._depth[side] == 1:
            turns.append(side[0])

    def counted_paired(*args: Any) -> None:
        pairs[0] += 1
        paired(*args)

    overlap._Turns.begin = counted_begin  # type: ignore[method-assign]
    overlap.paired = counted_paired  # type: ignore[assignment]
    out = []
    for case in cases:
        turns.clear()
        pairs[0] = 0
        out.append((train(case), pairs[0], "".join(turns)))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_overlap_on_four_ranks_matches_one_process_on_every_rank() -> None:
    mesh = "pp = 2\ndp_shard = 1\nep = 2"
    schedule = pp("DualPipeV", "\noverlap = true")
    cases = {
        "DualPipeV overlap": Case("moe_llama", plan_toml(mesh, schedule, FSDP2_TABLE,
                                                         EP_TABLE), 4, 4),
        # the recomputation runs the all-to-alls again on the backward's thread
        "DualPipeV overlap, full checkpointing": Case(
            "moe_llama", plan_toml(mesh, schedule, FSDP2_TABLE, EP_TABLE,
                                   'name = "activation_checkpoint"\nmode = "full"'), 4, 4),
        # HSDP's all-reduce on the backward's thread at each stage's last backward
        "DualPipeV overlap, HSDP over ep": Case(
            "moe_llama", plan_toml("pp = 2\ndp_replicate = 1\nep = 2", schedule,
                                   'name = "hsdp"', EP_TABLE), 4, 4),
        # transformers' Mixtral, its router loss carried from stage to stage; four
        # stages over its blocks leave one holding no experts
        "Mixtral, DualPipeV overlap": Case(
            "mixtral", plan_toml(mesh, schedule, FSDP2_TABLE, EP_TABLE), 4, 4, lr=0.1),
    }
    results = run_ranks(_train_counting, 4, args=(list(cases.values()),), timeout=280)
    for i, (name, case) in enumerate(cases.items()):
        ranks = [r[i] for r in results]
        ref_losses, ref_params = reference(case, 2)
        for (losses, _), pairs, turns in ranks:
            assert losses == pytest.approx(ref_losses, rel=2e-6, abs=1e-5), name
            # 3 steps; pp rank 0 pairs 3 of its actions a step (torch's DualPipeV at
            # p = 2, n = 4), rank 1 likewise
            assert pairs == 9, (name, pairs)
            assert ("bf" in turns and turns.startswith("b")) or case.task == "mixtral", (
                name, turns)
        # both ep ranks of a stage took their turns in one order
        assert ranks[0][2] == ranks[1][2] and ranks[2][2] == ranks[3][2], name
        assert_every_rank([params for (_, params), _, _ in ranks], _held_part_close(ref_params))
        assert {k for (_, params), _, _ in ranks for k in params} == set(ref_params)
