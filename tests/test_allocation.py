"""The allocation a job got, read from its launcher's and scheduler's variables, and the
plan's check of it at start (composer_par.allocation; CP306-CP309). No processes: each
case is the environment a rank of such a job sees (the real jobs run in
tests/test_launch_slurm.py and tests/test_integration_ray.py)."""

from __future__ import annotations

import pytest

from composer_par import FSDP2, HSDP, TP, MeshSpec, MetaInit, ParallelPlan, Topology
from composer_par.allocation import (
    TOPOLOGY_ENV,
    Allocation,
    AllocationConflict,
    parse_layout,
    read_allocation,
    tasks_per_node,
    wanted_topology,
)
from composer_par.findings import PlanError
from composer_par.topology import TopologyError

TORCHRUN_4x8 = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "4"}
# torchrun under srun, one task per node, as `composer-par launch --slurm` starts it.
SLURM_8x4 = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "8",
             "SLURM_STEP_NUM_NODES": "8", "SLURM_STEP_TASKS_PER_NODE": "1(x8)",
             "SLURM_JOB_NUM_NODES": "8"}


def conflict(env: dict[str, str]) -> str:
    with pytest.raises(AllocationConflict) as caught:
        read_allocation(env)
    return f"{caught.value.finding.code}: {caught.value}"


def tp_plan() -> ParallelPlan:
    """tp(8) inside each of 4 nodes of 8."""
    return (ParallelPlan(MeshSpec(dp_shard=4, tp=8),
                         topology=Topology(nodes=4, devices_per_node=8))
            .use(FSDP2()).use(TP()).use(MetaInit(seed=0)))


def meta_llama() -> object:
    import torch

    from composer_par.testing.tasks import LlamaTask

    with torch.device("meta"):
        return LlamaTask().build()


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", TOPOLOGY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


# -- reading the environment -----------------------------------------------------------------


def test_no_launcher_no_allocation() -> None:
    assert read_allocation({}) is None
    assert read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}) is None


def test_torchrun_ray_and_slurm_layouts() -> None:
    assert read_allocation(TORCHRUN_4x8) == Allocation(
        4, 8, ("WORLD_SIZE=32", "LOCAL_WORLD_SIZE=8"))
    # Ray Train's workers carry the same variables (and NODE_RANK).
    ray = read_allocation({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"})
    assert ray is not None and (ray.nodes, ray.per_node) == (2, 2)
    slurm = read_allocation(SLURM_8x4)
    assert slurm is not None and (slurm.nodes, slurm.per_node) == (8, 4)
    assert "SLURM_STEP_NUM_NODES=8" in slurm.evidence
    # Kubeflow's pods: torchrun took PET_NNODES / PET_NPROC_PER_NODE as its sizes.
    pods = read_allocation({**TORCHRUN_4x8, "PET_NNODES": "4", "PET_NPROC_PER_NODE": "8"})
    assert pods is not None and "PET_NNODES=4" in pods.evidence
    # An elastic range and "auto" leave the sizes to torchrun.
    assert read_allocation({**TORCHRUN_4x8, "PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "auto"})


def test_srun_tasks_as_ranks() -> None:
    env = {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_PROCID": "5", "SLURM_NODEID": "1"}
    found = read_allocation(env)
    assert found is not None and (found.nodes, found.per_node) == (2, 4)
    assert conflict({**env, "SLURM_NODEID": "0"}).startswith(
        "CP309: task 5 runs on node 0 (SLURM_NODEID=0), not on node 1")
    assert conflict({**env, "SLURM_STEP_TASKS_PER_NODE": "4,2"}).startswith(
        "CP308: SLURM placed different numbers of tasks on the nodes")
    # Counts that cannot be read as one per node say nothing to check.
    assert read_allocation({**env, "SLURM_STEP_TASKS_PER_NODE": "junk"}) is None


def test_launcher_and_scheduler_disagreeing_is_cp308() -> None:
    several = conflict({**SLURM_8x4, "SLURM_STEP_NUM_NODES": "4",
                        "SLURM_STEP_TASKS_PER_NODE": "2(x4)"})
    assert several.startswith("CP308: SLURM runs 2 torchrun agents on one node")
    fewer = conflict({**SLURM_8x4, "SLURM_STEP_NUM_NODES": "4",
                      "SLURM_STEP_TASKS_PER_NODE": "1(x4)"})
    assert "torchrun counts 8 node(s)" in fewer and "SLURM_STEP_NUM_NODES=4" in fewer
    gpus = conflict({**TORCHRUN_4x8, "SLURM_GPUS_ON_NODE": "4"})
    assert "SLURM gave this node 4 GPU(s)" in gpus and "LOCAL_WORLD_SIZE=8" in gpus
    # More GPUs than processes share nothing.
    assert read_allocation({**TORCHRUN_4x8, "SLURM_GPUS_ON_NODE": "8"}) is not None
    pods = conflict({**TORCHRUN_4x8, "PET_NNODES": "4", "PET_NPROC_PER_NODE": "4"})
    assert "asks torchrun for 4 x 4" in pods and "it runs 4 x 8" in pods
    uneven = conflict({"WORLD_SIZE": "10", "LOCAL_WORLD_SIZE": "4"})
    assert uneven.startswith("CP308: WORLD_SIZE=10 is not a multiple of LOCAL_WORLD_SIZE=4")
    groups = conflict({**TORCHRUN_4x8, "GROUP_WORLD_SIZE": "3"})
    assert groups.startswith("CP308: GROUP_WORLD_SIZE=3 nodes")


def test_slurm_task_counts_and_layouts() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="cannot read SLURM task counts"):
        tasks_per_node("2(x")
    with pytest.raises(ValueError, match="more than"):
        tasks_per_node("1(x99999999)")
    assert parse_layout("4x8") == (4, 8) and parse_layout(" 2 X 1 ") == (2, 1)
    for bad in ("4", "0x8", "4x", "x8", "4x8x2"):
        with pytest.raises(ValueError, match="NODESxDEVICES"):
            parse_layout(bad)


def test_the_launch_s_layout_is_the_wanted_one() -> None:
    declared = Topology(nodes=2, devices_per_node=8, inter_node_gbps=100)
    assert wanted_topology(declared, {}) is declared
    assert wanted_topology(None, {TOPOLOGY_ENV: "4x2"}) == Topology(nodes=4, devices_per_node=2)
    relaid = wanted_topology(declared, {TOPOLOGY_ENV: "4x4"})
    assert relaid == Topology(nodes=4, devices_per_node=4, inter_node_gbps=100)
    with pytest.raises(TopologyError, match=f"{TOPOLOGY_ENV}: expected NODESxDEVICES"):
        wanted_topology(None, {TOPOLOGY_ENV: "lots"})


# -- the plan's check at start ---------------------------------------------------------------


def test_a_job_on_8_x_4_refuses_a_plan_for_4_x_8_naming_both(
        monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, SLURM_8x4)
    plan = tp_plan()
    [finding] = plan.allocation_report().findings
    assert finding.code == "CP306" and finding.severity.value == "error"
    assert finding.message.startswith(
        "plan wants 4 nodes x 8, the job has 8 x 4: tp(8) would cross nodes (CP302 on the "
        "job's layout) (read from WORLD_SIZE=32, LOCAL_WORLD_SIZE=4, SLURM_STEP_NUM_NODES=8")
    assert "start the job on 4 node(s) with 8 process(es) each" in finding.fix
    with pytest.raises(PlanError, match="CP306"):
        plan.check_allocation()
    # apply refuses before it builds anything (there is no process group here).
    with pytest.raises(PlanError) as caught:
        plan.apply(meta_llama())  # type: ignore[arg-type]
    assert "CP306" in caught.value.report.codes()


def test_the_same_layout_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TORCHRUN_4x8)
    assert tp_plan().allocation_report().findings == ()
    tp_plan().check_allocation()


def test_another_world_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "8"})
    [finding] = tp_plan().allocation_report().findings
    assert finding.code == "CP306"
    assert "plan wants 4 nodes x 8, the job has 8 x 8: 64 ranks where the plan's layout " \
        "has 32" in finding.message


def test_a_layout_the_plan_holds_on_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # HSDP written for 2 nodes x 8, started on one node of 16: nothing crosses any more.
    set_env(monkeypatch, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "16"})
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=8),
                         topology=Topology(nodes=2, devices_per_node=8))
            .use(HSDP()).use(FSDP2()).use(MetaInit(seed=0)))
    [finding] = plan.allocation_report().findings
    assert finding.code == "CP307" and finding.severity.value == "warning"
    assert finding.message.startswith(
        "plan wants 2 nodes x 8, the job has 1 x 16: dp_replicate(2) would stay inside a node; "
        "the plan's rules hold on the job's layout")
    plan.check_allocation()  # a warning does not stop the job


def test_the_launch_s_variable_stands_for_a_missing_topology(
        monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", TOPOLOGY_ENV: "1x2"})
    plan = ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit(seed=0))
    [finding] = plan.allocation_report().findings
    assert finding.message.startswith(
        "plan wants 1 node x 2, the job has 2 x 1: tp(2) would cross nodes")


def test_without_a_wanted_layout_the_rules_run_on_the_job_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"})
    plan = ParallelPlan(MeshSpec(tp=2)).use(TP()).use(MetaInit(seed=0))
    assert plan.allocation_report().findings == ()
    with pytest.raises(PlanError) as caught:
        plan.apply(meta_llama())  # type: ignore[arg-type]
    assert caught.value.report.codes() == ["CP302"]


def test_a_contradicting_environment_refuses_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, {**SLURM_8x4, "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
                          "SLURM_STEP_NUM_NODES": "4"})
    with pytest.raises(PlanError, match="CP308"):
        tp_plan().check_allocation()
    # Static validation, on a laptop or a login node, does not read the allocation.
    assert "CP308" not in tp_plan().validate().codes()
