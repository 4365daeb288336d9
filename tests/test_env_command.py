"""``composer-par env``: the machine's report for a bug report, on a machine without
CUDA and without ``nvidia-smi`` too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_par.tools.environment import collect, format_environment


def _env_without(*names: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in names and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(extra)
    return env


def test_env_prints_without_cuda_and_without_nvidia_smi(tmp_path: Path) -> None:
    # A PATH holding only the interpreter's directory: no nvidia-smi can be found.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = _env_without("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                       PATH=str(bin_dir), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "composer_par.cli", "env"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    import torch

    assert f"torch: {torch.__version__}" in text
    assert "no CUDA device: CPU only (gloo)" in text
    assert "gpu topology: nvidia-smi not found" in text
    assert "topology: none inferred (not under torchrun)" in text
    assert "fsdp2: " in text and "meta_init: " in text  # the installed plugins

    done = subprocess.run([sys.executable, "-m", "composer_par.cli", "env", "--json"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    data = json.loads(done.stdout)
    assert done.returncode == 0
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["torch_checked"] is True  # CI's torch is a checked release
    import transformers

    assert data["versions"]["transformers"] == transformers.__version__
    assert data["versions"]["nccl"] is None and data["devices"] == []
    assert data["interconnect"]["gpu_topology"] is None
    assert data["interconnect"]["gpu_topology_note"] == "nvidia-smi not found"
    assert {p["name"] for p in data["plugins"]} >= {"fsdp2", "tp", "meta_init"}


def test_env_infers_the_topology_validate_would_use() -> None:
    environ = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2",
               "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_ID": "42"}
    data = collect(environ)
    launch = data["launcher"]
    assert launch["topology"] == {"nodes": 2, "devices_per_node": 8}
    assert launch["slurm_topology"] == {"nodes": 2, "devices_per_node": 8}
    assert launch["torchrun"]["WORLD_SIZE"] == "16" and launch["slurm"]["SLURM_JOB_ID"] == "42"
    text = format_environment(data)
    assert "topology (from torchrun's variables): 2 node(s) x 8 device(s)" in text
    assert "SLURM allocation: 2 node(s) x 8 task(s)" in text


def test_env_names_a_broken_torchrun_environment() -> None:
    data = collect({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    assert data["launcher"]["topology"] is None
    assert "not a multiple of LOCAL_WORLD_SIZE=4" in data["launcher"]["topology_error"]
    assert "topology: error: WORLD_SIZE=6" in format_environment(data)


@pytest.mark.parametrize("argv", [["env", "extra"], ["env", "--verbose"]])
def test_env_bad_command_line_is_exit_2(argv: list[str]) -> None:
    from composer_par.cli.main import main

    assert main(argv) == 2
