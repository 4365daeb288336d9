"""``launch``: a validated plan's job for the scheduler a cluster uses.

    composer-par launch plan.toml --slurm --partition gpu -- train.py plan.toml
    composer-par launch plan.toml --kubernetes --image registry/train:1 -- train.py plan.toml
    composer-par launch plan.toml --torchrun --rdzv-host node0 -- train.py plan.toml

The job is sized from the plan's ``[topology]`` (or ``--nodes`` / ``--devices-per-node``):
nodes, processes per node, torchrun's c10d rendezvous on the first node, the variables
the job needs; the words after ``--`` are the script and its arguments, run by torchrun
on every node. The plan is validated on that topology first: a plan with errors writes
no job. ``--dry-run`` prints the job; otherwise it is written (``--output``, default a
file named after the job) and, with ``--submit``, handed to ``sbatch`` or ``kubectl``.

Exit codes: 0 written (or printed, or submitted), 1 the plan or the job has errors
(nothing written) or the scheduler refused the job, 2 unreadable input (the plan file,
the command line, no scheduler client for ``--submit``). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

from composer_par.allocation import TOPOLOGY_ENV
from composer_par.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    InputError,
    Output,
    bounded_int,
    load_plan_for,
    plan_arguments,
    situation,
)
from composer_par.findings import Report
from composer_par.tools.kubernetes_job import DEFAULT_GPU_RESOURCE, DEFAULT_RUNTIME
from composer_par.tools.launch import DEFAULT_PORT, FRESH_STORE_ENV

SCHEDULERS = ("slurm", "kubernetes", "torchrun")
# Variables the job gets from the plan, which --env may not set otherwise.
RESERVED_ENV = {TOPOLOGY_ENV: "the layout the job was written for: --nodes / "
                "--devices-per-node change it",
                FRESH_STORE_ENV: "when --max-restarts allows restarts"}
SUFFIX = {"slurm": ".sbatch", "kubernetes": ".yaml", "torchrun": ".sh"}
# How long a scheduler's client may take to accept a job.
SUBMIT_TIMEOUT_S = 120.0


def launch_arguments(parser: argparse.ArgumentParser) -> None:
    plan_arguments(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--slurm", dest="scheduler", action="store_const", const="slurm",
                       help="a SLURM batch script (sbatch): one torchrun per node via srun")
    which.add_argument("--kubernetes", dest="scheduler", action="store_const",
                       const="kubernetes", help="a Kubeflow Trainer TrainJob manifest "
                       "(--pytorchjob: a training-operator PyTorchJob)")
    which.add_argument("--torchrun", dest="scheduler", action="store_const", const="torchrun",
                       help="the torchrun command each node runs")
    parser.add_argument("--name", help="the job's name (default: from the plan file's name)")
    parser.add_argument("--port", type=bounded_int(1, 65535), default=DEFAULT_PORT,
                        help=f"the rendezvous port on the first node (default {DEFAULT_PORT})")
    parser.add_argument("--max-restarts", type=bounded_int(0, 1000), default=0,
                        help="torchrun's restarts of every node's processes after a failure "
                        "(default 0)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        type=_env_pair, help="a variable for every process (repeatable)")
    parser.add_argument("--launcher", default="torchrun",
                        help="the torchrun command on the nodes (default torchrun; e.g. "
                        "'python -m torch.distributed.run')")
    passed = parser.add_argument_group("for the scheduler, passed through as given")
    passed.add_argument("--gpus-per-node", type=bounded_int(1, 4096), metavar="N",
                        help="GPUs to ask for per node (must be the plan's devices per node)")
    passed.add_argument("--gpu-type", metavar="TYPE",
                        help="SLURM: the GPU type (--gpus-per-node=TYPE:N)")
    passed.add_argument("--partition", help="SLURM: the partition")
    passed.add_argument("--account", help="SLURM: the account")
    passed.add_argument("--time", metavar="LIMIT", help="SLURM: the time limit (e.g. 4:00:00)")
    passed.add_argument("--cpus-per-task", type=bounded_int(1, 65536), metavar="N",
                        help="SLURM: CPUs for each node's torchrun and its processes")
    passed.add_argument("--job-output", metavar="PATTERN",
                        help="SLURM: where the job's output goes (--output=PATTERN)")
    passed.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                        type=_sbatch_option,
                        help="SLURM: a further #SBATCH option, given as --sbatch-option=--qos=high "
                        "(repeatable)")
    passed.add_argument("--image", help="Kubernetes: the container image")
    passed.add_argument("--namespace", help="Kubernetes: the namespace")
    passed.add_argument("--runtime", default=DEFAULT_RUNTIME,
                        help=f"Kubernetes: the TrainJob's runtime (default {DEFAULT_RUNTIME})")
    passed.add_argument("--gpu-resource", default=DEFAULT_GPU_RESOURCE,
                        help=f"Kubernetes: the GPU resource name (default {DEFAULT_GPU_RESOURCE})")
    passed.add_argument("--pytorchjob", action="store_true",
                        help="Kubernetes: a PyTorchJob (kubeflow.org/v1) instead of a TrainJob")
    passed.add_argument("--rdzv-host", metavar="HOST",
                        help="torchrun: the first node's address (needed for 2+ nodes)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--dry-run", action="store_true", help="print the job; write nothing")
    out.add_argument("-o", "--output", type=Path, metavar="FILE",
                     help="write the job here (default: NAME.sbatch / NAME.yaml / NAME.sh)")
    parser.add_argument("--submit", action="store_true",
                        help="after writing, submit it (sbatch, kubectl create)")
    parser.epilog = ("the words after -- are the training script and its arguments, run by "
                     "torchrun on every node; " + (parser.epilog or ""))


def _env_pair(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE; got {text!r}")
    return name, value


def _sbatch_option(text: str) -> str:
    if not text.startswith("-") or any(c in text for c in "\n\r"):
        raise argparse.ArgumentTypeError(
            f"expected one sbatch option such as --qos=high; got {text!r}")
    return text


def run_launch(args: argparse.Namespace, out: Output) -> int:
    from composer_par.tools.launch import Job, job_findings, job_name

    command = list(getattr(args, "trailing", None) or [])
    if not command:
        raise InputError("give the training script after --: composer-par launch PLAN "
                         "--slurm -- train.py PLAN [ARGS]")
    if args.submit and args.dry_run:
        raise InputError("--submit and --dry-run exclude each other")
    for name, _ in args.env:
        if name in RESERVED_ENV:
            raise InputError(f"--env {name}: launch sets it from the plan "
                             f"({RESERVED_ENV[name]})")
    plan, world = load_plan_for(args)
    topology = plan.effective_topology()
    if world is None and topology is not None:
        world = topology.world_size
    source = "stdin" if args.plan == "-" else Path(args.plan).name
    name = args.name or job_name(Path(args.plan).stem if args.plan != "-" else "plan")
    report = Report.of([*plan.validate(world_size=world).findings,
                        *job_findings(topology, scheduler=args.scheduler, name=name,
                                      gpus_per_node=args.gpus_per_node, image=args.image,
                                      rdzv_host=args.rdzv_host)])
    data: dict[str, Any] = {"plan": args.plan, "scheduler": args.scheduler,
                            "world_size": world, **report.to_dict()}
    if not report.ok or topology is None:
        data["exit_code"] = EXIT_ERRORS
        out.result(data, f"{args.plan}: {situation(plan, world)}\n"
                   f"{out.severities(report.format())}\nno job written: fix the errors above")
        return EXIT_ERRORS
    job = Job(name=name, nodes=topology.nodes, per_node=topology.devices_per_node,
              command=tuple(command), port=args.port, max_restarts=args.max_restarts,
              gpus_per_node=args.gpus_per_node, extra_env=tuple(args.env),
              launcher=args.launcher)
    text, document = _write(job, args, source)
    data.update({"job": {"name": job.name, "nodes": job.nodes, "per_node": job.per_node,
                         "world_size": job.world_size, "command": list(job.command),
                         "environment": dict(job.environment())},
                 "text": text})
    if document is not None:
        data["manifest"] = document
    notes = [out.severities(report.format())] if report.findings else []
    if args.dry_run:
        data.update({"written": None, "exit_code": EXIT_OK})
        out.result(data, "\n".join([*notes, text]))
        return EXIT_OK
    path = args.output or Path(f"{job.name}{SUFFIX[args.scheduler]}")
    path.write_text(text, encoding="utf-8")
    if args.scheduler == "torchrun":
        path.chmod(0o755)
    data["written"] = str(path)
    lines = [*notes, f"wrote {path}: {job.nodes} node(s) x {job.per_node} process(es) "
             f"({args.scheduler})"]
    code = EXIT_OK
    if args.submit:
        code, said = _submit(args.scheduler, str(path))
        data["submitted"] = said
        lines.append(said["message"])
    data["exit_code"] = code
    out.result(data, "\n".join(lines))
    return code


def _write(job: Any, args: argparse.Namespace, source: str) -> tuple[str, Any]:
    """The job's text, and its manifest as data for Kubernetes (None otherwise)."""
    if args.scheduler == "slurm":
        from composer_par.tools.slurm_job import SlurmOptions, sbatch_script

        options = SlurmOptions(partition=args.partition, account=args.account, time=args.time,
                               gpu_type=args.gpu_type, cpus_per_task=args.cpus_per_task,
                               output=args.job_output, extra=tuple(args.sbatch_option))
        return sbatch_script(job, options, source), None
    if args.scheduler == "kubernetes":
        from composer_par.tools.kubernetes_job import KubernetesOptions, manifest

        k8s = KubernetesOptions(image=args.image, namespace=args.namespace,
                                runtime=args.runtime, gpu_resource=args.gpu_resource)
        document, text = manifest(job, k8s, source,
                                  form="pytorchjob" if args.pytorchjob else "trainjob")
        return text, document
    from composer_par.tools.launch import format_node_commands

    return "#!/bin/sh\n" + format_node_commands(job, args.rdzv_host, source), None


def _submit(scheduler: str, path: str) -> tuple[int, dict[str, Any]]:
    """Hand the written job to the scheduler's client; (exit code, what happened)."""
    if scheduler == "torchrun":
        raise InputError("--submit: torchrun has no scheduler to submit to; run the "
                         f"written command on every node ({path})")
    if scheduler == "slurm":
        from composer_par.tools.slurm_job import submit_command
    else:
        from composer_par.tools.kubernetes_job import submit_command  # type: ignore[assignment]
    command = list(submit_command(path))
    if shutil.which(command[0]) is None:
        raise InputError(f"--submit: {command[0]} is not on PATH here; the job is written "
                         f"to {path}: submit it where {command[0]} is")
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=SUBMIT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return EXIT_ERRORS, {"command": command, "ok": False, "message":
                             f"{command[0]} did not answer in {SUBMIT_TIMEOUT_S:.0f} s"}
    said = (done.stdout.strip() or done.stderr.strip())
    if done.returncode:
        return EXIT_ERRORS, {"command": command, "ok": False, "returncode": done.returncode,
                             "message": f"{command[0]} refused the job (exit "
                             f"{done.returncode}): {done.stderr.strip() or said}"}
    result: dict[str, Any] = {"command": command, "ok": True,
                              "message": f"submitted with {command[0]}: {said}"}
    if scheduler == "slurm":
        result["job_id"] = said.split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"
    return EXIT_OK, result


__all__ = ["launch_arguments", "run_launch"]
