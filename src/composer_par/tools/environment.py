"""What a bug report needs to know about the machine: versions, devices, interconnect,
the topology the environment implies, and the installed plugins.

:func:`collect` gathers it as plain data (JSON-ready); :func:`format_environment` prints
it as text to paste into an issue. Nothing here fails when a tool is missing: a machine
without CUDA, without ``nvidia-smi`` or without InfiniBand says so in its report.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The variables a scheduler or launcher sets that say where a job runs. torchrun's are
# what the plan reads (Topology.from_env); SLURM's are shown beside them, so a report
# from a SLURM job tells whether the two agree.
TORCHRUN_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "RANK",
                      "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                   "SLURM_GPUS_ON_NODE", "SLURM_PROCID", "SLURM_LOCALID")
# How long a system tool may take before its answer is left out.
TOOL_TIMEOUT_S = 10.0
INFINIBAND_SYSFS = Path("/sys/class/infiniband")


def collect(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything the report shows, as JSON-ready data."""
    env = os.environ if environ is None else environ
    return {
        "versions": versions(),
        "platform": {"python": sys.version.split()[0], "system": platform.platform(),
                     "machine": platform.machine(), "cpus": os.cpu_count()},
        "devices": devices(),
        "interconnect": interconnect(),
        "launcher": launcher(env),
        "plugins": plugins(),
    }


def versions() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from composer_par import __version__
    from composer_par.plugin import torch_private

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and dist.is_nccl_available():
        nccl = ".".join(str(n) for n in torch.cuda.nccl.version())
    return {
        "composer_par": __version__,
        "torch": torch.__version__,
        # Whether the features that read FSDP2 internals run on it (CP230, versions.md).
        "torch_checked": torch_private.torch_release(torch.__version__)
        in torch_private.CHECKED_TORCH,
        "cuda": torch.version.cuda,  # the toolkit torch was built with; None: CPU build
        "cuda_available": cuda,
        "nccl": nccl,
        # gloo has no version of its own: it is the one torch was built with.
        "gloo": "built in" if dist.is_available() and dist.is_gloo_available() else None,
        "pluggy": _distribution_version("pluggy"),
        "attrs": _distribution_version("attrs"),
        # the optional extras' libraries (the README's support table)
        "transformers": _distribution_version("transformers"),
        "accelerate": _distribution_version("accelerate"),
        "lightning": _distribution_version("lightning"),
    }


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def devices() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name,
                      "memory_bytes": int(props.total_memory),
                      "capability": f"{props.major}.{props.minor}"})
    return found


def interconnect() -> dict[str, Any]:
    """The GPU topology matrix of ``nvidia-smi topo -m`` (NVLink ``NV#``, PCIe ``PIX``/
    ``PXB``/``PHB``, ``SYS``) and the InfiniBand devices the kernel lists; each None with
    the reason where the tool or the devices are absent."""
    report: dict[str, Any] = {"gpu_topology": None, "gpu_topology_note": None,
                              "infiniband": None, "infiniband_note": None}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        report["gpu_topology_note"] = "nvidia-smi not found"
    else:
        report["gpu_topology"], report["gpu_topology_note"] = _run_tool([smi, "topo", "-m"])
    if INFINIBAND_SYSFS.is_dir():
        report["infiniband"] = [_infiniband_port(d) for d in sorted(INFINIBAND_SYSFS.iterdir())]
    else:
        report["infiniband_note"] = f"no {INFINIBAND_SYSFS}: no InfiniBand/RoCE devices"
    return report


def _run_tool(command: list[str]) -> tuple[str | None, str | None]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(command)} failed: {exc}"
    if done.returncode != 0:
        return None, (f"{' '.join(command)} exited {done.returncode}: "
                      f"{done.stderr.strip()[:200]}")
    return done.stdout.rstrip(), None


def _infiniband_port(device: Path) -> dict[str, Any]:
    ports = {}
    for port in sorted((device / "ports").glob("*")):
        ports[port.name] = {name: _read(port / name) for name in ("state", "rate", "link_layer")}
    return {"device": device.name, "ports": ports}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def launcher(environ: Mapping[str, str]) -> dict[str, Any]:
    """The launcher variables set here and the Topology a plan infers from them (what
    ``validate`` and ``apply`` use when neither the plan nor the flags give one)."""
    from composer_par.topology import Topology, TopologyError

    topology: dict[str, Any] | None = None
    problem = None
    try:
        found = Topology.from_env(environ)
        topology = found.to_dict() if found is not None else None
    except TopologyError as exc:
        problem = str(exc)
    slurm = {k: environ[k] for k in SLURM_VARIABLES if k in environ}
    return {
        "torchrun": {k: environ[k] for k in TORCHRUN_VARIABLES if k in environ},
        "slurm": slurm,
        "topology": topology,
        "topology_error": problem,
        "slurm_topology": _slurm_topology(slurm),
    }


def _slurm_topology(slurm: Mapping[str, str]) -> dict[str, int] | None:
    """Nodes x tasks per node as SLURM states them (``SLURM_NTASKS_PER_NODE`` may read
    ``4(x2)``: the count before the parenthesis); None when it does not say both."""
    nodes = slurm.get("SLURM_NNODES", "")
    per_node = slurm.get("SLURM_NTASKS_PER_NODE", "").partition("(")[0]
    if nodes.isdigit() and per_node.isdigit():
        return {"nodes": int(nodes), "devices_per_node": int(per_node)}
    return None


def plugins() -> list[dict[str, Any]]:
    from composer_par.plugin.registry import Registry

    return [{k: row[k] for k in ("name", "version", "distribution", "error") if k in row}
            for row in Registry().describe()]


def format_environment(data: Mapping[str, Any]) -> str:
    """The report as text: ``key: value`` lines under a few headings, to paste into an
    issue as it is."""
    v, p, link, launch = (data["versions"], data["platform"], data["interconnect"],
                          data["launcher"])
    lines = ["versions"]
    lines += [f"  {name}: {value if value is not None else 'none'}"
              for name, value in v.items()]
    lines += ["platform", f"  python: {p['python']}", f"  system: {p['system']}",
              f"  machine: {p['machine']}", f"  cpus: {p['cpus']}", "devices"]
    if data["devices"]:
        lines += [f"  cuda:{d['index']}: {d['name']}, {d['memory_bytes'] / 2**30:.1f} GiB, "
                  f"compute capability {d['capability']}" for d in data["devices"]]
    else:
        lines.append("  no CUDA device: CPU only (gloo)")
    lines.append("interconnect")
    if link["gpu_topology"]:
        lines.append("  nvidia-smi topo -m:")
        lines += [f"    {row}" for row in link["gpu_topology"].splitlines()]
    else:
        lines.append(f"  gpu topology: {link['gpu_topology_note']}")
    if link["infiniband"]:
        for device in link["infiniband"]:
            for port, state in device["ports"].items():
                lines.append(f"  {device['device']} port {port}: {state['state']}, "
                             f"{state['rate']}, {state['link_layer']}")
    else:
        lines.append(f"  infiniband: {link['infiniband_note']}")
    lines.append("launcher")
    for kind in ("torchrun", "slurm"):
        found = launch[kind]
        shown = ", ".join(f"{k}={val}" for k, val in found.items()) or "none set"
        lines.append(f"  {kind} variables: {shown}")
    if launch["topology_error"]:
        lines.append(f"  topology: error: {launch['topology_error']}")
    elif launch["topology"]:
        t = launch["topology"]
        lines.append(f"  topology (from torchrun's variables): {t['nodes']} node(s) x "
                     f"{t['devices_per_node']} device(s)")
    else:
        lines.append("  topology: none inferred (not under torchrun); plans need "
                     "[topology] or --nodes/--devices-per-node")
    if launch["slurm_topology"]:
        t = launch["slurm_topology"]
        lines.append(f"  SLURM allocation: {t['nodes']} node(s) x {t['devices_per_node']} "
                     "task(s) (plans check it against torchrun's at start: docs/multi-node.md)")
    lines.append("plugins")
    for row in data["plugins"]:
        state = f"ERROR {row['error']}" if "error" in row else row["version"] or "-"
        lines.append(f"  {row['name']}: {state} ({row['distribution']})")
    if not data["plugins"]:
        lines.append("  none installed")
    return "\n".join(lines)


__all__ = ["collect", "format_environment"]
