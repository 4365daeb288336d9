"""A plan's job as a SLURM batch script: one torchrun per node, started by ``srun``.

The script asks for the plan's nodes with one task each (``--ntasks-per-node=1``): the
task is the node's torchrun, which starts the node's processes (``--nproc-per-node``,
the plan's devices per node) and meets the other nodes' at a c10d rendezvous on the
job's first node, where SLURM runs the batch script itself. torchrun's node count is the
allocation's (``$SLURM_JOB_NUM_NODES``), not a copy of the plan's: a job submitted with
another ``--nodes`` starts, and its processes refuse the layout at start, naming it
(:mod:`composer_par.allocation`), instead of waiting at a rendezvous that never fills.
Options a plan does not know (partition, account, time limit, GPUs per node, further
``#SBATCH`` lines) are written as given.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import attrs

from composer_par.tools.launch import Job, shell_words


@attrs.frozen
class SlurmOptions:
    """``#SBATCH`` settings passed through as given; None leaves SLURM's default."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    gpu_type: str | None = None
    cpus_per_task: int | None = None
    output: str | None = None
    extra: tuple[str, ...] = ()  # whole options, e.g. "--qos=high"


def _directive(option: str, value: object | None) -> list[str]:
    return [] if value is None else [f"#SBATCH --{option}={value}"]


def sbatch_script(job: Job, options: SlurmOptions, source: str) -> str:
    """The batch script; ``source`` names the plan it was written from."""
    gpus = None
    if job.gpus_per_node is not None:
        gpus = f"{options.gpu_type}:{job.gpus_per_node}" if options.gpu_type else \
            job.gpus_per_node
    lines = [
        "#!/bin/bash",
        f"# Written by composer-par launch from {source}: {job.nodes} node(s) x "
        f"{job.per_node} process(es) = {job.world_size} ranks.",
        "# One task per node: the node's torchrun, which starts its processes.",
        *_directive("job-name", job.name),
        *_directive("nodes", job.nodes),
        "#SBATCH --ntasks-per-node=1",
        *_directive("gpus-per-node", gpus),
        *_directive("cpus-per-task", options.cpus_per_task),
        *_directive("partition", options.partition),
        *_directive("account", options.account),
        *_directive("time", options.time),
        *_directive("output", options.output),
        *(f"#SBATCH {extra}" for extra in options.extra),
        "set -euo pipefail",
        "",
        "# The layout this job was written for: each process checks the allocation",
        "# it got against it before building its mesh.",
        *(f"export {name}={shlex.quote(value)}" for name, value in job.environment()),
        "",
        "# torchrun's c10d rendezvous on the job's first node, where this script runs.",
        'rdzv_host="$(hostname)"',
        "",
        *_srun(job, options),
    ]
    return "\n".join(lines) + "\n"


def _srun(job: Job, options: SlurmOptions) -> list[str]:
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if options.cpus_per_task is not None:
        # srun does not take it from the batch step in every SLURM release.
        srun.append(f"--cpus-per-task={options.cpus_per_task}")
    # Shell expressions stay unquoted so the job fills them in; the rest is quoted.
    torchrun = job.torchrun_options(
        nnodes='"$SLURM_JOB_NUM_NODES"', endpoint=f'"$rdzv_host:{job.port}"',
        rdzv_id='"$SLURM_JOB_ID"')
    sizes, rendezvous, restarts = torchrun[:2], torchrun[2:-1], torchrun[-1:]
    return [
        " ".join(srun) + " \\",
        f"    {shell_words(job.launcher.split())} " + " ".join(sizes) + " \\",
        "    " + " ".join(rendezvous) + " \\",
        "    " + " ".join(restarts) + " \\",
        f"    {shell_words(job.command)}",
    ]


def submit_command(path: str) -> Sequence[str]:
    return ["sbatch", "--parsable", path]


__all__ = ["SlurmOptions", "sbatch_script", "submit_command"]
