"""Bounded waits, the forward-before-optimizer guard and the plugin allow-list: each
promise of docs/reliability.md that is not about checkpoints, on real gloo ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest

from composer_par import MeshSpec, ParallelPlan
from composer_par.hangs import ROLL_CALL_S, name_stuck_ranks
from composer_par.mesh import DEFAULT_TIMEOUT_S, as_timeout
from composer_par.plugin.registry import ALLOW_ENV, BLOCK_ENV, Registry
from composer_par.testing import run_ranks
from tests import reliability_workers as workers

# -- the one timeout setting ---------------------------------------------------------------


def test_the_timeout_is_seconds_or_a_timedelta_with_a_default_well_under_torchs() -> None:
    assert ParallelPlan(MeshSpec()).timeout == timedelta(seconds=DEFAULT_TIMEOUT_S)
    assert DEFAULT_TIMEOUT_S <= 600  # torch's gloo default is 1800 s
    assert ParallelPlan(MeshSpec(), timeout=12.5).timeout == timedelta(seconds=12.5)
    assert ParallelPlan(MeshSpec(), timeout=timedelta(minutes=2)).timeout.total_seconds() == 120


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 1e300, True, "10", None])
def test_a_bad_timeout_is_refused_naming_it(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="timeout"):
        as_timeout(bad)
    if bad is not None:
        with pytest.raises((TypeError, ValueError), match="timeout"):
            ParallelPlan(MeshSpec(), timeout=bad)  # type: ignore[arg-type]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_frozen_rank_in_a_subgroup_ends_its_peers_waits_at_the_timeout() -> None:
    # Before the mesh passed a timeout, its groups had torch's 30 minutes: the peers of
    # the frozen rank were still waiting when run_ranks gave up.
    results = run_ranks(workers.frozen_peer_in_a_subgroup, 4, args=(3.0, 12.0), timeout=60)
    for result in results:
        assert result["timeouts"] == {"dp_shard": 3.0, "tp": 3.0}
    for rank in (0, 3):
        assert "Timed out" in results[rank]["error"], results[rank]
        assert 2.5 < results[rank]["waited_s"] < 8.0, results[rank]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_apply_gives_every_group_it_creates_the_plans_timeout() -> None:
    for timeout, expected in ((7.0, 7.0), (None, DEFAULT_TIMEOUT_S)):
        results = run_ranks(workers.plan_groups_get_the_plan_timeout, 4, args=(timeout,),
                            timeout=90)
        assert all(r == {"dp_replicate": expected, "dp_shard": expected} for r in results)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_dim_over_every_rank_runs_on_the_default_group_and_keeps_its_timeout() -> None:
    # run_ranks gives the default group its timeout plus 5 s: 65 s here.
    results = run_ranks(workers.whole_world_dim_keeps_the_default_group, 2, args=(3.0,),
                        timeout=60)
    assert all(r == {"is_default": True, "timeouts": {"dp_shard": 65.0}} for r in results)


# -- the plugin allow-list -----------------------------------------------------------------


@pytest.mark.parametrize("value", ["", " ", ",", " , ,"])
def test_a_set_but_empty_allow_list_allows_nothing(value: str) -> None:
    registry = Registry(environ={ALLOW_ENV: value})
    assert registry.names() == []
    assert "fsdp2" in registry.blocked


@pytest.mark.parametrize("value", ["", " ", ","])
def test_a_set_but_empty_block_list_blocks_nothing(value: str) -> None:
    assert Registry(environ={BLOCK_ENV: value}).names() == Registry(environ={}).names()


def test_allow_and_block_lists_name_exactly_what_they_list() -> None:
    everything = Registry(environ={}).names()
    assert "fsdp2" in everything and "meta_init" in everything
    assert Registry(environ={ALLOW_ENV: " fsdp2 ,"}).names() == ["fsdp2"]
    assert "fsdp2" not in Registry(environ={BLOCK_ENV: "fsdp2"}).names()
    assert Registry(allow=[]).names() == Registry(environ={ALLOW_ENV: ""}).names() == []


# -- the forward-before-optimizer guard ------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_optimizer_built_after_a_forward_fails_its_first_step_naming_the_parameter() -> None:
    # Without the guard FSDP2's root kept its unsharded parameters registered after the
    # forward, the optimizer took them, and the step silently left them untrained.
    good = run_ranks(workers.optimizer_after_forward, 2, args=("before",), timeout=120)
    assert good[0]["held"] == ["DTensor"] and good[0]["error"] is None
    for no_grad in (False, True):
        bad = run_ranks(workers.optimizer_after_forward, 2, args=("after", no_grad),
                        timeout=120)
        for result in bad:
            assert result["held"] == ["DTensor", "Parameter"]
            error = result["error"]
            assert error.startswith("UnshardedParameterError: SGD holds 'tok_embeddings.weight'")
            assert "before any forward" in error and "reshard()" in error
        # Refused before anything was updated: the parameters are still the initial ones.
        assert all((bad[0]["full"][k] == v).all() for k, v in bad[0]["initial"].items())
    assert any((good[0]["full"][k] != v).any() for k, v in good[0]["initial"].items())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_fix_the_error_names_trains_like_an_optimizer_built_first() -> None:
    good = run_ranks(workers.optimizer_after_forward, 2, args=("before",), timeout=120)
    fixed = run_ranks(workers.optimizer_after_forward, 2, args=("after-reshard",), timeout=120)
    assert fixed[0]["held"] == ["DTensor"] and fixed[0]["error"] is None
    for name, value in good[0]["full"].items():
        assert (fixed[0]["full"][name] == value).all(), name


# -- naming the rank that never joined -------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_the_ranks_waiting_for_a_frozen_rank_name_it_soon_after_the_timeout() -> None:
    results = run_ranks(workers.frozen_rank_is_named, 4, args=(3.0, 1), timeout=90)
    assert results[1] == {"frozen": True}
    for rank in (0, 2, 3):
        result = results[rank]
        assert result["stuck"] == (1,) and result["waiting"] == (0, 2, 3), result
        assert result["error"].startswith("rank 1 never joined: ranks 0, 2, 3 timed out "
                                          "after 3 s waiting in a collective"), result
        assert "rank 1: pid " in result["error"] and "py-spy" in result["error"]
        # The timeout, then the roll call: well before torch's 30 minutes (the slack is
        # for a loaded machine, not a speed claim).
        assert 3.0 <= result["seconds"] < 3.0 + ROLL_CALL_S + 30.0, result


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_when_every_rank_timed_out_none_is_named() -> None:
    results = run_ranks(workers.everyone_waits_for_everyone, 2, args=(2.0,), timeout=60)
    for result in results:
        assert result["stuck"] == () and result["waiting"] == (0, 1)
        assert result["error"].startswith("every rank timed out waiting in a collective "
                                          "after 2 s: the ranks are in different collectives")


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_lost_connection_joins_an_open_roll_call_and_is_left_alone_without_one() -> None:
    # gloo closes a pair whose wait timed out: the rank at its other end sees a lost
    # connection, and must not be named as the one that never joined. A lost connection
    # without a roll call is a dead peer: its error goes on unchanged.
    [outcomes] = run_ranks(workers.lost_connections, 1, args=(0.5,), timeout=60)
    (alone, waited), (timed_out, _), (joined, _) = outcomes
    assert alone.startswith("RuntimeError: [pair.cc:553] Connection closed by peer")
    assert 0.5 <= waited < 5
    assert timed_out.startswith("StuckRankError: every rank timed out")
    assert joined.startswith("StuckRankError: every rank timed out")


def test_other_errors_and_errors_outside_a_job_pass_through_unchanged() -> None:
    with pytest.raises(ValueError, match=r"^boom$"), name_stuck_ranks():
        raise ValueError("boom")
    with pytest.raises(RuntimeError, match=r"^Timed out waiting 10ms$"), name_stuck_ranks():
        raise RuntimeError("Timed out waiting 10ms")


# -- the topology torchrun gives -----------------------------------------------------------


def test_from_env_agrees_with_the_number_of_nodes_that_joined() -> None:
    from composer_par.topology import Topology, TopologyError

    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
    assert Topology.from_env(env) == Topology(nodes=2, devices_per_node=2)
    # Two nodes of 2 and 4 processes: the node with 2 would see 3 nodes of 2.
    with pytest.raises(TopologyError, match="GROUP_WORLD_SIZE=2 nodes x LOCAL_WORLD_SIZE=2"):
        Topology.from_env({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"})


# -- the document of these promises -----------------------------------------------------------


def test_every_test_named_in_docs_reliability_exists() -> None:
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    text = (root / "docs" / "reliability.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(named) >= 20
    for path, name in named:
        tree = ast.parse((root / path).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in functions, f"docs/reliability.md names {path}::{name}, which is gone"
