"""What every scheduler's job of a plan holds, and the torchrun command each node runs.

A :class:`Job` is sized from the plan's topology (nodes, processes per node, one device
each) and carries the rendezvous (torchrun's c10d backend on a port of the first node)
and the environment the job needs. :mod:`composer_par.tools.slurm_job` and
:mod:`composer_par.tools.kubernetes_job` write it for their schedulers;
:func:`node_commands` writes it as one shell command per node. What a scheduler needs
and a plan does not know (partition, account, image, time limit, GPUs per node) is
passed through as given; :func:`job_findings` refuses a job that cannot run (CP981-
CP985). Nothing here imports torch.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

import attrs

from composer_par.allocation import TOPOLOGY_ENV
from composer_par.findings import Finding
from composer_par.topology import Topology

DEFAULT_PORT = 29500
# Names schedulers accept: a Kubernetes object name is an RFC 1035 label (TrainJob's
# CRD checks it), and SLURM takes the same without complaint.
NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63
# torch 2.13's torchrun keeps the store it shares with its workers across restarts, so a
# restarted group reads dead workers' addresses; this gives every attempt a fresh one.
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@attrs.frozen
class Job:
    """A plan's job: ``nodes`` x ``per_node`` processes running ``command`` (the script
    and its arguments) under torchrun."""

    name: str
    nodes: int
    per_node: int
    command: tuple[str, ...]
    port: int = DEFAULT_PORT
    max_restarts: int = 0
    gpus_per_node: int | None = None
    # Extra variables as given (``--env NAME=VALUE``), after the ones the job needs.
    extra_env: tuple[tuple[str, str], ...] = ()
    launcher: str = "torchrun"

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def layout(self) -> str:
        return f"{self.nodes}x{self.per_node}"

    def environment(self) -> list[tuple[str, str]]:
        """The variables every process gets: the layout the job was written for (each
        rank checks its allocation against it at start), a fresh rendezvous store per
        restart when restarts are allowed, then the ones given."""
        env = [(TOPOLOGY_ENV, self.layout)]
        if self.max_restarts:
            env.append((FRESH_STORE_ENV, "1"))
        return env + list(self.extra_env)

    def torchrun_options(self, *, nnodes: str | None = None, endpoint: str | None = None,
                         rdzv_id: str | None = None) -> list[str]:
        """torchrun's options for this job: sizes, c10d rendezvous, restarts. ``nnodes``,
        ``endpoint`` and ``rdzv_id`` may be shell expressions a scheduler fills in."""
        options = [f"--nnodes={nnodes or self.nodes}", f"--nproc-per-node={self.per_node}"]
        if endpoint is not None:
            options += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                        f"--rdzv-id={rdzv_id or self.name}"]
        else:
            options.append("--standalone")
        return [*options, f"--max-restarts={self.max_restarts}"]


def job_name(text: str) -> str:
    """A scheduler-safe name derived from ``text`` (the plan file's stem): lowercase,
    runs of other characters as '-', starting with a letter, at most 63 characters."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"plan-{name}".rstrip("-")
    return name[:MAX_NAME].rstrip("-")


def job_findings(topology: Topology | None, *, scheduler: str, name: str,
                 gpus_per_node: int | None = None, image: str | None = None,
                 rdzv_host: str | None = None) -> list[Finding]:
    """What stops a job from being written (CP981-CP985)."""
    found: list[Finding] = []
    if topology is None:
        found.append(Finding(
            "CP981", "the plan has no [topology] and no --nodes / --devices-per-node were "
            "given: the job's number of nodes and processes per node are not known",
            fix="add [topology] nodes = N, devices_per_node = M to the plan, or pass "
            "--nodes and --devices-per-node"))
    elif gpus_per_node is not None and gpus_per_node != topology.devices_per_node:
        found.append(Finding(
            "CP982", f"--gpus-per-node {gpus_per_node} but the plan runs "
            f"{topology.devices_per_node} process(es) per node, one device each",
            fix=f"ask for --gpus-per-node {topology.devices_per_node}, or change the "
            "plan's devices_per_node (and its mesh) to the GPUs a node has"))
    if scheduler == "kubernetes" and not image:
        found.append(Finding(
            "CP983", "a Kubernetes job runs in a container and no --image was given",
            fix="pass --image with an image holding the training script, torch and "
            "composer-par"))
    if (scheduler == "torchrun" and topology is not None and topology.nodes > 1
            and not rdzv_host):
        found.append(Finding(
            "CP984", f"{topology.nodes} nodes meet at a rendezvous on the first node, and "
            "no --rdzv-host says where it is",
            fix="pass --rdzv-host with the first node's address (a name or IP the other "
            "nodes reach)"))
    if not NAME_PATTERN.match(name) or len(name) > MAX_NAME:
        found.append(Finding(
            "CP985", f"job name {name!r} is not a name the scheduler accepts",
            fix="give --name lowercase letters, digits and '-', starting with a letter and "
            f"ending with a letter or digit, at most {MAX_NAME} characters"))
    return found


def shell_words(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def node_commands(job: Job, rdzv_host: str | None) -> list[str]:
    """One shell command per node: the same on every node (c10d assigns node ranks),
    each line exporting the job's variables first."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in job.environment())
    endpoint = f"{rdzv_host}:{job.port}" if rdzv_host else None
    line = f"{exports} " + shell_words(
        [*job.launcher.split(), *job.torchrun_options(endpoint=endpoint), *job.command])
    return [line for _ in range(job.nodes)]


def format_node_commands(job: Job, rdzv_host: str | None, source: str) -> str:
    """The torchrun form as a text to read: a header, then each node's command."""
    lines = [f"# {source}: {job.nodes} node(s) x {job.per_node} process(es) = "
             f"{job.world_size} ranks; run on every node, the same line:"]
    for node, command in enumerate(node_commands(job, rdzv_host)):
        lines += [f"# node {node}" + (f" (hosts the rendezvous at {rdzv_host}:{job.port})"
                                      if node == 0 and rdzv_host else ""), command]
    return "\n".join(lines) + "\n"


__all__ = [
    "DEFAULT_PORT",
    "FRESH_STORE_ENV",
    "Job",
    "format_node_commands",
    "job_findings",
    "job_name",
    "node_commands",
    "shell_words",
]
