"""The ft plugin without replica groups running: its rules (CP971-CP977), options, plan
files, the mesh one launch lays out, explain and estimate, the lighthouse command and
check, and what a healing group accepts. tests/test_ft_groups.py runs the groups."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from composer_par.plugins.ft.findings import CATALOG
from composer_par.plugins.ft.lighthouse import (
    LighthouseUnreachable,
    lighthouse_address,
    wait_for_lighthouse,
)
from composer_par.plugins.ft.runtime import FaultToleranceError, group_index

from composer_par import (
    FSDP2,
    HSDP,
    FaultTolerance,
    MeshSpec,
    MetaInit,
    ParallelPlan,
    PlanFileError,
    Topology,
)
from composer_par.estimate import ModelShape, Workload, estimate_plan


def plan_text(mesh: str, ft: str = "", hsdp: bool = True) -> str:
    tables = ['[[plugins]]\nname = "hsdp"\n'] if hsdp else []
    tables += ['[[plugins]]\nname = "fsdp2"\n', f'[[plugins]]\nname = "ft"\n{ft}']
    return f"[mesh]\n{mesh}\n\n" + "\n".join(tables)


GOOD = "dp_replicate = 2\ndp_shard = 2"


@pytest.fixture(autouse=True)
def _no_group_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)


# -- rules ----------------------------------------------------------------------------------

CASES = {
    "CP971": ("dp_shard = 2\ndp_replicate = 2", "", True),
    "CP972": (GOOD, "", False),
    "CP973": ("dp_replicate = 2\ndp_shard = -1", "", True),
    "CP974": (GOOD, "min_replicas = 3\n", True),
    "CP975": (GOOD, "group = 2\n", True),
    "CP976": (GOOD, 'method = "ddp"\nsync_every = 8\n', True),
    "CP977": ("dp_replicate = 1\ndp_shard = 2", "", True),
}


@pytest.mark.parametrize("code", sorted(CASES))
def test_each_rule_finds_its_plan(code: str) -> None:
    mesh, ft, hsdp = CASES[code]
    report = ParallelPlan.from_toml(plan_text(mesh, ft, hsdp)).validate()
    found = [f for f in report.findings if f.code == code]
    assert found and found[0].plugin == "ft" and found[0].fix, report.format()
    rule = next(r for r in CATALOG if r.code == code)
    assert found[0].severity is rule.severity


def test_an_inferred_size_is_refused_when_the_world_size_would_resolve_it() -> None:
    # In a job the mesh is resolved on the launch's world size before the plugins check
    # it: a dim inside a group sized -1 must still be refused (CP973), not sized anew by
    # every relaunch.
    plan = ParallelPlan.from_toml(plan_text("dp_replicate = 2\ndp_shard = -1"))
    assert "CP973" in plan.validate(world_size=2).codes()


def test_a_good_plan_has_no_findings_and_its_catalog_examples_find_their_codes() -> None:
    assert ParallelPlan.from_toml(plan_text(GOOD, "group = 1\nmin_replicas = 2\n")).validate(
        world_size=2).findings == ()
    for rule in CATALOG:
        assert rule.code in ParallelPlan.from_toml(rule.example).validate().codes(), rule.code


def test_the_fix_of_an_inner_dim_listed_first_names_the_order() -> None:
    report = ParallelPlan.from_toml(plan_text("tp = 2\ndp_replicate = 3", hsdp=True)
                                    .replace('name = "fsdp2"', 'name = "tp"')).validate()
    (finding,) = [f for f in report.findings if f.code == "CP971"]
    assert finding.fix == "list it first: dp_replicate = 3, tp = 2"


def test_the_group_index_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = ParallelPlan.from_toml(plan_text(GOOD))
    monkeypatch.setenv("REPLICA_GROUP_ID", "5")
    assert "CP975" in plan.validate().codes()
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    assert plan.validate(world_size=2).findings == ()
    assert [plan.data_shard(rank, 2) for rank in range(2)] == [(2, 4), (3, 4)]
    assert group_index(None) == 1
    monkeypatch.setenv("REPLICA_GROUP_ID", "one")
    with pytest.raises(FaultToleranceError, match="REPLICA_GROUP_ID is 'one'"):
        group_index(None)


# -- options and plan files ---------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "async"}, "method must be one of"),
    ({"min_replicas": 0}, "min_replicas must be an int >= 1"),
    ({"lighthouse": "no port"}, "is not host:port"),
    ({"outer_momentum": 1.0}, "outer_momentum must be a number >= 0 and < 1"),
    ({"outer_lr": 0}, "outer_lr must be a number > 0"),
    ({"timeout": -1}, "timeout must be a number > 0"),
    ({"group": -1}, "group must be an int >= 0"),
    ({"store": ""}, "store must be a non-empty string"),
])
def test_bad_options_name_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        FaultTolerance(**options)


def test_a_plan_file_round_trips_every_option() -> None:
    text = plan_text(GOOD, 'lighthouse = "lh.example:29510"\nmin_replicas = 2\n'
                           'method = "diloco"\nsync_every = 50\nouter_lr = 0.5\n'
                           'outer_momentum = 0.8\nouter_nesterov = false\ninit_sync = false\n'
                           'timeout = 120\nstore = "node0:29500"\nhostname = "node0"\n'
                           "group = 1\n")
    plan = ParallelPlan.from_toml(text)
    ft = plan.plugin("ft")
    assert ft == FaultTolerance(lighthouse="http://lh.example:29510", min_replicas=2,
                                method="diloco", sync_every=50, outer_lr=0.5,
                                outer_momentum=0.8, outer_nesterov=False, init_sync=False,
                                timeout=120, store="node0:29500", hostname="node0", group=1)
    assert ParallelPlan.from_toml(plan.to_toml()).plugin("ft") == ft
    with pytest.raises(PlanFileError, match="method"):
        ParallelPlan.from_toml(plan_text(GOOD, 'method = "fast"\n'))


# -- explain and estimate -----------------------------------------------------------------


def test_explain_shows_the_groups_and_the_hook() -> None:
    plan = ParallelPlan.from_toml(plan_text(GOOD, 'group = 0\nlighthouse = "lh:1"\n'))
    text = plan.explain(world_size=2).format()
    assert "dp_replicate(2) spans 2 replica group(s), one launch each (this one: group 0)" in text
    assert "gradient all-reduce by ft's comm hook" in text
    assert "lighthouse http://lh:1" in text
    assert "dp_replicate(2): [0, 2] [1, 3]" in text


def _estimate(method: str, sync_every: int) -> Any:
    plan = (ParallelPlan(MeshSpec(dp_replicate=4, dp_shard=8),
                         topology=Topology(nodes=1, devices_per_node=8))
            .use(HSDP()).use(FSDP2())
            .use(FaultTolerance(method=method, sync_every=sync_every)).use(MetaInit()))
    model = ModelShape.from_numbers(params=1_000_000_000, layers=16, hidden=2048, heads=16,
                                    vocab=32000)
    return estimate_plan(plan, model, Workload(seq=2048))


def test_the_estimate_states_each_methods_communication() -> None:
    ddp, diloco = _estimate("ddp", 1), _estimate("diloco", 10)
    replicate = {e: next(t for t in est.traffic if t.dim.name == "dp_replicate")
                 for e, est in (("ddp", ddp), ("diloco", diloco))}
    # Every step: the gradients' all-reduce across groups (the replicate dim's, counted as
    # HSDP's), crossing nodes: each group is a launch on nodes of its own.
    assert replicate["ddp"].dim.crosses_nodes
    assert replicate["ddp"].calls() == {"all_reduce": 17}
    assert any("quorum" in note for note in ddp.notes)
    # DiLoCo: the pseudo-gradients every 10 steps, stated per step.
    (collective,) = replicate["diloco"].collectives
    assert "pseudo-gradients" in collective.why
    assert collective.payload == replicate["ddp"].payload // 10
    assert diloco.memory.extra == {"ft: diloco outer momentum": replicate["ddp"].payload}


# -- the lighthouse -------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_lighthouse_fails_within_the_timeout_naming_it() -> None:
    address = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(LighthouseUnreachable) as caught:
        wait_for_lighthouse(address, 1.0, interval_s=0.2)
    assert time.monotonic() - started < 5
    assert address in str(caught.value) and "composer-par lighthouse" in str(caught.value)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        lighthouse_address(None)
    assert lighthouse_address("[::1]:29510") == "http://[::1]:29510"


def test_the_lighthouse_command_prints_its_address_and_stops() -> None:
    pytest.importorskip("torchft")
    exe = Path(sys.executable).with_name("composer-par")
    done = subprocess.run([str(exe), "lighthouse", "--json", "--bind", "127.0.0.1:0",
                           "--min-replicas", "2", "--for", "0.5"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] and document["min_replicas"] == 2
    assert document["address"].startswith("http://127.0.0.1:")
    bad = subprocess.run([str(exe), "lighthouse", "--json", "--bind", "nowhere",
                          "--min-replicas", "1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not host:port" in json.loads(bad.stdout)["error"]


# -- what a healing group accepts ---------------------------------------------------------


def test_a_healing_group_takes_only_plain_state_of_its_own_layout() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft")
    from composer_par.plugins.ft.state import (
        ReplicaLayoutError,
        load_model_state,
        load_optimizer_state,
        model_state,
        optimizer_state,
    )
    from composer_par.plugins.ft.transport import _plain_leaves

    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(source.parameters())
    source(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    sent = {"models": model_state([source]), "optimizers": [optimizer_state(optimizer)]}
    _plain_leaves(sent)  # tensors, numbers and containers only
    load_model_state([target], sent["models"])
    assert torch.equal(target.weight, source.weight)
    other = torch.optim.AdamW(target.parameters())
    load_optimizer_state(other, sent["optimizers"][0])
    assert torch.equal(other.state[target.weight]["exp_avg"],
                       optimizer.state[source.weight]["exp_avg"])
    with pytest.raises(ReplicaLayoutError, match="weight: the live group's local part is"):
        load_model_state([torch.nn.Linear(4, 2)], sent["models"])
    with pytest.raises(ReplicaLayoutError, match="every replica group must build the same"):
        load_model_state([torch.nn.Linear(3, 2, bias=False)], sent["models"])
    with pytest.raises(TypeError, match=r"state\['x'\] is a Linear"):
        _plain_leaves({"x": source})


def test_a_heal_compares_the_groups_layouts() -> None:
    torch = pytest.importorskip("torch")
    from composer_par.plugins.ft.state import ReplicaLayoutError, check_layout, layout

    model = torch.nn.Linear(3, 2)
    mine = layout((("dp_replicate", 1), ("dp_shard", 2)), [model])
    assert mine == {"mesh": [["dp_replicate", 1], ["dp_shard", 2]],
                    "placements": {"0:weight": "whole", "0:bias": "whole"}}
    check_layout(mine, mine)
    with pytest.raises(ReplicaLayoutError, match=r"launch mesh is \[\['dp_replicate', 1\], "
                                                  r"\['tp', 2\]\], this group's"):
        check_layout({**mine, "mesh": [["dp_replicate", 1], ["tp", 2]]}, mine)
    other = {**mine, "placements": {**mine["placements"],
                                    "0:weight": "('tp',) ('Shard(dim=0)',)"}}
    with pytest.raises(ReplicaLayoutError, match=r"weight: the live group splits it as "
                                                  r"\('tp',\) \('Shard\(dim=0\)',\), this "
                                                  r"group as whole \(1 tensor\(s\) differ\)"):
        check_layout(other, mine)


def test_the_estimate_takes_one_launchs_world_size() -> None:
    from composer_par.estimate import EstimateError

    plan = (ParallelPlan(MeshSpec(dp_replicate=4, dp_shard=8)).use(HSDP()).use(FSDP2())
            .use(FaultTolerance()).use(MetaInit()))
    model = ModelShape.from_numbers(params=10_000_000, layers=4, hidden=256, heads=4,
                                    vocab=1000)
    assert estimate_plan(plan, model, Workload(seq=128), world_size=8).layout.mesh == (
        MeshSpec(dp_replicate=4, dp_shard=8))
    with pytest.raises(EstimateError, match=r"dp_replicate: separate launches; the world "
                                            r"size is one launch's"):
        estimate_plan(plan, model, Workload(seq=128), world_size=32)
