"""A plan's job as a Kubernetes manifest: a Kubeflow Trainer ``TrainJob``
(``trainer.kubeflow.org/v1alpha1``), or a ``PyTorchJob`` (``kubeflow.org/v1``, the
training operator's) for clusters that have not moved to Trainer v2.

Both run torchrun in each node's pod, and both tell it the job's sizes through the
variables their controllers set (``PET_NNODES``, ``PET_NPROC_PER_NODE``, the node rank
and the first pod's address), which torchrun reads as its options: the manifest states
the plan's nodes (``numNodes``; Master + Workers) and processes per node
(``numProcPerNode``; ``nprocPerNode``) once, and the command gives torchrun no sizes of
its own. The image, namespace, runtime and GPU resource are passed through as given.
The YAML is written here (strings quoted where YAML would read them as something else),
so no YAML library is needed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from composer_par.tools.launch import Job

TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
DEFAULT_RUNTIME = "torch-distributed"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
# The container name PyTorchJob's controller looks for (its ports and variables go there).
PYTORCHJOB_CONTAINER = "pytorch"


@attrs.frozen
class KubernetesOptions:
    image: str
    namespace: str | None = None
    runtime: str = DEFAULT_RUNTIME
    gpu_resource: str = DEFAULT_GPU_RESOURCE


def _metadata(job: Job, options: KubernetesOptions) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": job.name}
    if options.namespace:
        meta["namespace"] = options.namespace
    return meta


def _command(job: Job) -> list[str]:
    restarts = [f"--max-restarts={job.max_restarts}"] if job.max_restarts else []
    return [*job.launcher.split(), *restarts, *job.command]


def _env(job: Job) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in job.environment()]


def _gpus(job: Job, options: KubernetesOptions) -> dict[str, Any] | None:
    if job.gpus_per_node is None:
        return None
    return {"limits": {options.gpu_resource: job.gpus_per_node}}


def trainjob(job: Job, options: KubernetesOptions) -> dict[str, Any]:
    """The TrainJob: ``numNodes`` pods of ``numProcPerNode`` processes, on the runtime
    named (``torch-distributed``, Kubeflow's torchrun runtime, by default)."""
    trainer: dict[str, Any] = {
        "image": options.image,
        "numNodes": job.nodes,
        "numProcPerNode": job.per_node,
        "command": _command(job),
        "env": _env(job),
    }
    resources = _gpus(job, options)
    if resources is not None:
        trainer["resourcesPerNode"] = resources
    return {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": _metadata(job, options),
        "spec": {"runtimeRef": {"name": options.runtime}, "trainer": trainer},
    }


def pytorchjob(job: Job, options: KubernetesOptions) -> dict[str, Any]:
    """The PyTorchJob: one Master pod and ``nodes - 1`` Worker pods, ``nprocPerNode``
    processes each. Pods are not restarted one by one (``restartPolicy: Never``): a
    replaced pod could not rejoin its peers' rendezvous; restarts are torchrun's."""
    container: dict[str, Any] = {
        "name": PYTORCHJOB_CONTAINER,
        "image": options.image,
        "command": _command(job),
        "env": _env(job),
    }
    resources = _gpus(job, options)
    if resources is not None:
        container["resources"] = resources

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "Never",
                "template": {"spec": {"containers": [container]}}}

    specs = {"Master": replicas(1)}
    if job.nodes > 1:
        specs["Worker"] = replicas(job.nodes - 1)
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": _metadata(job, options),
        "spec": {"nprocPerNode": str(job.per_node), "pytorchReplicaSpecs": specs},
    }


# -- YAML ------------------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z_/.][A-Za-z0-9_./-]*$")
# Plain words YAML 1.1 readers take for booleans or null.
_SPECIAL = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _SPECIAL:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def _is_block(value: Any) -> bool:
    return isinstance(value, dict | list) and bool(value)


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if _is_block(item):
                out.append(f"{pad}{_scalar(key)}:")
                out += _lines(item, indent + 2)
            else:
                empty = "{}" if isinstance(item, dict) else "[]" if isinstance(item, list) \
                    else _scalar(item)
                out.append(f"{pad}{_scalar(key)}: {empty}")
        return out
    for item in value:
        if _is_block(item):
            inner = _lines(item, indent + 2)
            out.append(f"{pad}- {inner[0].lstrip()}")
            out += inner[1:]
        else:
            out.append(f"{pad}- {_scalar(item)}")
    return out


def to_yaml(document: dict[str, Any], comment: str = "") -> str:
    """``document`` as block YAML, after ``comment`` lines (each starting with '# ')."""
    head = [f"# {line}" if line else "#" for line in comment.splitlines()]
    return "\n".join([*head, *_lines(document, 0)]) + "\n"


def manifest(job: Job, options: KubernetesOptions, source: str, *,
             form: str = "trainjob") -> tuple[dict[str, Any], str]:
    """The manifest (``form``: ``trainjob`` or ``pytorchjob``) and its YAML text."""
    document = pytorchjob(job, options) if form == "pytorchjob" else trainjob(job, options)
    comment = (f"Written by composer-par launch from {source}: {job.nodes} node(s) x "
               f"{job.per_node} process(es) = {job.world_size} ranks.\n"
               "torchrun in each pod takes its sizes from the job (PET_NNODES, "
               "PET_NPROC_PER_NODE).")
    return document, to_yaml(document, comment)


def submit_command(path: str) -> list[str]:
    return ["kubectl", "create", "-f", path]


__all__ = [
    "DEFAULT_GPU_RESOURCE",
    "DEFAULT_RUNTIME",
    "KubernetesOptions",
    "manifest",
    "pytorchjob",
    "submit_command",
    "to_yaml",
    "trainjob",
]
