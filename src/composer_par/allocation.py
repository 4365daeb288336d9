"""The allocation a job really got, read from its scheduler's and launcher's environment,
and checked against the layout the plan asks for before the mesh is built.

A plan's ``[topology]`` is what the job asks for; a scheduler can start it on another
layout (``sbatch --nodes 8`` over a script written for 4, a hand-edited manifest), and
then a mesh dim the plan kept inside a node crosses nodes. Each process reads where it
runs from the variables its launcher and scheduler set:

* torchrun (and Ray Train, and Kubeflow's pods, which run torchrun): ``WORLD_SIZE`` and
  ``LOCAL_WORLD_SIZE``: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` agents of ``LOCAL_WORLD_SIZE``
  processes, one agent per node;
* SLURM, inside an ``srun`` step: ``SLURM_STEP_NUM_NODES`` (its node list,
  ``SLURM_STEP_NODELIST``, is named with it) and ``SLURM_STEP_TASKS_PER_NODE``
  (``2(x3),1`` is 2, 2, 2, 1): with torchrun, one task per node (each task is an
  agent); without it, each task is a rank;
  ``SLURM_GPUS_ON_NODE`` where the job asked for GPUs;
* Kubeflow (TrainJob, PyTorchJob): ``PET_NNODES`` and ``PET_NPROC_PER_NODE``, which the
  job's torchrun takes as its ``--nnodes`` and ``--nproc-per-node``.

Where these disagree with each other (two torchrun agents on one node, a pod's torchrun
given other sizes than the job's), the ranks' placement on nodes is not what any
topology can describe: that is CP308 (CP309 for ranks placed round-robin). Where they
agree on a layout other than the plan's, CP306 (an error) names both and what breaks:
``plan wants 4 nodes x 8, the job has 8 x 4: tp(8) would cross nodes``; a layout on
which the plan's rules still hold is CP307 (a warning). ``COMPOSER_PAR_TOPOLOGY``
(``NODESxDEVICES``, written by ``composer-par launch``) names the layout a job was
written for when the plan file has no ``[topology]``.

Reading the environment needs no torch; :mod:`composer_par.plan` calls
:func:`read_allocation` and :func:`allocation_findings` when it starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence

import attrs

from composer_par.findings import Finding, Severity
from composer_par.mesh import MeshSpec
from composer_par.topology import Topology, TopologyError

# The layout a launched job was written for, "NODESxDEVICES" (composer-par launch sets it).
TOPOLOGY_ENV = "COMPOSER_PAR_TOPOLOGY"

_LAYOUT = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
# A task count per node list longer than this is not a real job's (and bounds the work).
_MAX_NODES = 1 << 20


@attrs.frozen
class Allocation:
    """Where the job's processes run: ``nodes`` x ``per_node`` processes, and the
    variables that say so (``evidence``: ``NAME=value`` strings)."""

    nodes: int
    per_node: int
    evidence: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def topology(self) -> Topology:
        return Topology(nodes=self.nodes, devices_per_node=self.per_node)

    def same_layout(self, topology: Topology) -> bool:
        return (self.nodes, self.per_node) == (topology.nodes, topology.devices_per_node)


class AllocationConflict(ValueError):
    """The environment places the ranks on nodes in a way no topology describes; carries
    the finding (CP308 or CP309)."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.message)
        self.finding = finding


def parse_layout(text: str) -> tuple[int, int]:
    """``"4x8"`` -> ``(4, 8)``; ValueError naming the text otherwise."""
    match = _LAYOUT.match(text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"expected NODESxDEVICES with both >= 1 (e.g. 4x8); got {text!r}")
    return int(match.group(1)), int(match.group(2))


def wanted_topology(declared: Topology | None,
                    environ: Mapping[str, str] | None = None) -> Topology | None:
    """The layout the job was written for: ``COMPOSER_PAR_TOPOLOGY`` when a launch set it
    (its flags override the plan file, as ``validate``'s do), else the plan's own."""
    env = os.environ if environ is None else environ
    text = env.get(TOPOLOGY_ENV, "").strip()
    if not text:
        return declared
    try:
        nodes, per_node = parse_layout(text)
    except ValueError as exc:
        raise TopologyError(f"{TOPOLOGY_ENV}: {exc}") from None
    if declared is not None:
        return attrs.evolve(declared, nodes=nodes, devices_per_node=per_node)
    return Topology(nodes=nodes, devices_per_node=per_node)


def tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts, ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.match(part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM task counts {text!r}")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > _MAX_NODES:
            raise ValueError(f"SLURM task counts {text!r} name more than {_MAX_NODES} nodes")
        counts += [int(match.group(1))] * repeat
    return counts


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    return int(text) if text.isdigit() else None


def _conflict(code: str, message: str, fix: str) -> AllocationConflict:
    return AllocationConflict(Finding(code, message, fix=fix))


def read_allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The job's layout from its environment; None outside a launcher or scheduler step.
    Raises :class:`AllocationConflict` when the variables contradict each other."""
    env = os.environ if environ is None else environ
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    step_nodes = _int(env, "SLURM_STEP_NUM_NODES")
    if world is not None and local is not None:
        return _under_torchrun(env, world, local, step_nodes)
    if step_nodes is not None and _int(env, "SLURM_PROCID") is not None:
        return _slurm_tasks(env, step_nodes)
    return None


def _under_torchrun(env: Mapping[str, str], world: int, local: int,
                    step_nodes: int | None) -> Allocation:
    if local < 1 or world % local:
        raise _conflict(
            "CP308", f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: "
            "the nodes run different numbers of processes",
            "give every node the same --nproc-per-node")
    agents = world // local
    evidence = [f"WORLD_SIZE={world}", f"LOCAL_WORLD_SIZE={local}"]
    groups = _int(env, "GROUP_WORLD_SIZE")
    if groups is not None and groups != agents:
        raise _conflict(
            "CP308", f"GROUP_WORLD_SIZE={groups} nodes x LOCAL_WORLD_SIZE={local} processes "
            f"!= WORLD_SIZE={world}: the nodes run different numbers of processes",
            "give every node the same --nproc-per-node")
    if step_nodes is not None:
        evidence += _torchrun_in_slurm(env, agents, step_nodes)
    gpus = _int(env, "SLURM_GPUS_ON_NODE")
    if gpus is not None and gpus < local:
        raise _conflict(
            "CP308", f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE={gpus}) but "
            f"torchrun runs {local} processes on it (LOCAL_WORLD_SIZE={local}): processes "
            "would share a device",
            f"ask SLURM for {local} GPUs per node (--gpus-per-node={local}), or run "
            f"--nproc-per-node={gpus}")
    evidence += _torchrun_in_kubeflow(env, agents, local)
    return Allocation(agents, local, tuple(evidence))


def _torchrun_in_slurm(env: Mapping[str, str], agents: int, step_nodes: int) -> list[str]:
    text = env.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    evidence = [f"SLURM_STEP_NUM_NODES={step_nodes}"]
    nodelist = env.get("SLURM_STEP_NODELIST", "").strip()
    if nodelist:
        evidence.append(f"SLURM_STEP_NODELIST={nodelist}")
    if text:
        try:
            counts = tasks_per_node(text)
        except ValueError:
            counts = []
        evidence.append(f"SLURM_STEP_TASKS_PER_NODE={text}")
        if any(count != 1 for count in counts):
            raise _conflict(
                "CP308", f"SLURM runs {max(counts)} torchrun agents on one node "
                f"(SLURM_STEP_TASKS_PER_NODE={text}): which ranks share a node is up to the "
                "rendezvous, so no topology describes the job",
                "run one torchrun per node (srun --ntasks-per-node=1) with "
                "--nproc-per-node set to the node's devices")
    if step_nodes != agents:
        raise _conflict(
            "CP308", f"torchrun counts {agents} node(s) (WORLD_SIZE / LOCAL_WORLD_SIZE) but "
            f"SLURM ran the step on {step_nodes} (SLURM_STEP_NUM_NODES={step_nodes})",
            "run one torchrun per node of the step, with --nnodes=$SLURM_JOB_NUM_NODES")
    return evidence


def _torchrun_in_kubeflow(env: Mapping[str, str], agents: int, local: int) -> list[str]:
    nnodes = env.get("PET_NNODES", "").strip()
    nproc = env.get("PET_NPROC_PER_NODE", "").strip()
    if not nnodes.isdigit():  # absent, or elastic ("1:4"): torchrun decides
        return []
    evidence = [f"PET_NNODES={nnodes}"] + ([f"PET_NPROC_PER_NODE={nproc}"] if nproc else [])
    if int(nnodes) != agents or (nproc.isdigit() and int(nproc) != local):
        asked = f"{nnodes} x {nproc}" if nproc.isdigit() else f"{nnodes} node(s)"
        raise _conflict(
            "CP308", f"the job asks torchrun for {asked} (PET_NNODES={nnodes}"
            + (f", PET_NPROC_PER_NODE={nproc}" if nproc else "")
            + f") but it runs {agents} x {local}: the container's command gives torchrun "
            "other sizes than the job's",
            "drop --nnodes / --nproc-per-node from the container's torchrun command: it "
            "reads the job's (numNodes, numProcPerNode / nprocPerNode)")
    return evidence


def _slurm_tasks(env: Mapping[str, str], step_nodes: int) -> Allocation | None:
    """Ranks that are srun's tasks themselves (no torchrun); None when SLURM's task
    counts cannot be read as one count per node."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    try:
        counts = tasks_per_node(text) if text else []
    except ValueError:
        counts = []
    if len(counts) != step_nodes:
        return None
    evidence = (f"SLURM_STEP_NUM_NODES={step_nodes}", f"SLURM_STEP_TASKS_PER_NODE={text}")
    if len(set(counts)) > 1:
        raise _conflict(
            "CP308", f"SLURM placed different numbers of tasks on the nodes "
            f"(SLURM_STEP_TASKS_PER_NODE={text}): the plan's topology needs the same "
            "number of processes on every node",
            "ask for the same number per node: sbatch --ntasks-per-node=N")
    per_node = counts[0]
    procid, nodeid = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NODEID")
    if procid is not None and nodeid is not None and nodeid != procid // per_node:
        raise _conflict(
            "CP309", f"task {procid} runs on node {nodeid} (SLURM_NODEID={nodeid}), not on "
            f"node {procid // per_node} where a block layout of {per_node} tasks per node "
            "puts it: SLURM distributed the tasks round-robin or by hand, and the mesh's "
            "rank groups would not be the nodes the plan was checked for",
            "distribute tasks in blocks: srun --distribution=block (the default), and no "
            "--distribution=cyclic or arbitrary task lists")
    return Allocation(step_nodes, per_node, evidence)


# -- the check against the plan -----------------------------------------------------------


def _layout(topology: Topology | Allocation) -> tuple[int, int]:
    if isinstance(topology, Topology):
        return topology.nodes, topology.devices_per_node
    return topology.nodes, topology.per_node


def _consequences(mesh: MeshSpec, wanted: Topology, real: Topology) -> list[str]:
    """Which mesh dims would change sides of the node boundary on the job's layout."""
    if (not mesh.is_resolved or mesh.world_size != real.world_size
            or wanted.world_size != real.world_size):
        return []
    said = []
    for name, size in mesh.dims:
        if size < 2:
            continue
        before, after = wanted.crosses_nodes(mesh, name), real.crosses_nodes(mesh, name)
        if after and not before:
            said.append(f"{name}({size}) would cross nodes")
        elif before and not after:
            said.append(f"{name}({size}) would stay inside a node")
    return said


def allocation_findings(
    mesh: MeshSpec, wanted: Topology | None, allocation: Allocation | None,
    rules_on: Callable[[Topology], Sequence[Finding]],
) -> list[Finding]:
    """CP306 or CP307 when the job's layout is not the one the plan asks for.

    ``mesh`` is the plan's (resolved on the job's world size where it fits);
    ``rules_on(topology)`` gives the plan's findings on a topology (the core's topology
    rules and the plugins' plan checks): an error the job's layout has and the plan's
    layout has not makes the mismatch an error, naming it."""
    if wanted is None or allocation is None or allocation.same_layout(wanted):
        return []
    real = allocation.topology()
    read = f" (read from {', '.join(allocation.evidence)})" if allocation.evidence else ""
    n, d = _layout(wanted)
    head = (f"plan wants {n} node{'s' if n != 1 else ''} x {d}, the job has "
            f"{allocation.nodes} x {allocation.per_node}")
    fix = (f"start the job on {n} node(s) with {d} process(es) each (composer-par launch "
           "writes such a job), or change the plan's [topology] to the job's layout and "
           "validate it there")
    if allocation.world_size != wanted.world_size:
        return [Finding(
            "CP306", f"{head}: {allocation.world_size} ranks where the plan's layout has "
            f"{wanted.world_size}{read}", fix=fix)]
    changes = _consequences(mesh, wanted, real)
    before = {(f.code, f.plugin) for f in rules_on(wanted) if f.severity is Severity.ERROR}
    broken = [f for f in rules_on(real)
              if f.severity is Severity.ERROR and (f.code, f.plugin) not in before]
    what = "; ".join(changes) if changes else "the same mesh dims cross nodes"
    if broken:
        codes = ", ".join(sorted({f.code for f in broken}))
        return [Finding("CP306", f"{head}: {what} ({codes} on the job's layout){read}",
                        fix=fix)]
    return [Finding(
        "CP307", f"{head}: {what}; the plan's rules hold on the job's layout, so it runs "
        f"there{read}",
        fix=f"make [topology] say {allocation.nodes} x {allocation.per_node}, or start the "
        f"job on {n} node(s) with {d} process(es) each")]


__all__ = [
    "TOPOLOGY_ENV",
    "Allocation",
    "AllocationConflict",
    "allocation_findings",
    "parse_layout",
    "read_allocation",
    "tasks_per_node",
    "wanted_topology",
]
