"""``composer-par launch`` without a scheduler: what it writes for SLURM and torchrun
(read back by bash and by torchrun's own argument parser), its refusals (CP981-CP985),
its files, and its exit codes. The real schedulers run the jobs in
tests/test_launch_slurm.py (SLURM), tests/test_launch_kubernetes.py (the manifests
against Kubeflow's CRDs) and tests/test_integration_ray.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer_par.cli.main import main as cli
from composer_par.tools.kubernetes_job import to_yaml
from composer_par.tools.launch import job_name

EXAMPLES = Path(__file__).parent.parent / "examples" / "plans"
HSDP_TP = str(EXAMPLES / "hsdp_fsdp_tp.toml")  # [topology] 2 nodes x 4

TWO_BY_EIGHT = """\
[mesh]
dp_replicate = 2
dp_shard = 8

[topology]
nodes = 2
devices_per_node = 8

[[plugins]]
name = "hsdp"

[[plugins]]
name = "fsdp2"
"""


def launch(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = cli(["launch", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def torchrun_args(words: list[str]) -> Any:
    """torchrun's own parser over a command line's torchrun part."""
    from torch.distributed.run import get_args_parser

    start = words.index("torchrun") + 1
    return get_args_parser().parse_args(words[start:])


@pytest.fixture
def plan_2x8(tmp_path: Path) -> str:
    path = tmp_path / "two_by_eight.toml"
    path.write_text(TWO_BY_EIGHT)
    return str(path)


def test_the_sbatch_script_asks_for_the_plan_s_layout_and_passes_options_through(
        plan_2x8: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, data = launch(capsys, plan_2x8, "--slurm", "--dry-run", "--gpus-per-node", "8",
                        "--gpu-type", "h100", "--partition", "gpu", "--account", "proj",
                        "--time", "4:00:00", "--cpus-per-task", "96",
                        "--sbatch-option=--qos=high", "--port", "29555", "--max-restarts",
                        "2", "--env", "NCCL_DEBUG=WARN", "--", "train.py", "plan file.toml",
                        "--steps", "9")
    assert code == 0, data
    script = data["text"]
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=two-by-eight", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=h100:8", "#SBATCH --cpus-per-task=96",
        "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=4:00:00",
        "#SBATCH --qos=high"]
    assert "export COMPOSER_PAR_TOPOLOGY=2x8" in script
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script  # restarts allowed
    assert "export NCCL_DEBUG=WARN" in script
    # bash reads it, and the srun line's torchrun part is what torchrun itself parses.
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    srun = script[script.index("srun "):].replace("\\\n", " ")
    expanded = srun.replace("$SLURM_JOB_NUM_NODES", "2").replace("$SLURM_JOB_ID", "77") \
        .replace("$rdzv_host", "node1")
    words = shlex.split(expanded)
    assert words[:4] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                         "--cpus-per-task=96"]
    args = torchrun_args(words)
    assert (args.nnodes, args.nproc_per_node) == ("2", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "c10d", "node1:29555", "77")
    assert args.max_restarts == 2
    assert [args.training_script, *args.training_script_args] == [
        "train.py", "plan file.toml", "--steps", "9"]


def test_the_torchrun_form_is_one_command_per_node(
        plan_2x8: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, data = launch(capsys, plan_2x8, "--torchrun", "--dry-run", "--rdzv-host", "10.0.0.1",
                        "--", "train.py", "plan.toml")
    assert code == 0, data
    commands = [line for line in data["text"].splitlines() if not line.startswith("#")]
    assert len(commands) == 2 and commands[0] == commands[1]
    words = shlex.split(commands[0])
    assert words[0] == "COMPOSER_PAR_TOPOLOGY=2x8"
    args = torchrun_args(words)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint) == (
        "2", "8", "c10d", "10.0.0.1:29500")
    subprocess.run(["sh", "-n"], input=data["text"], text=True, check=True)
    # One node needs no address: torchrun's standalone rendezvous.
    code, data = launch(capsys, HSDP_TP, "--torchrun", "--dry-run", "--nodes", "1",
                        "--devices-per-node", "8", "--", "train.py")
    one = [line for line in data["text"].splitlines() if not line.startswith("#")]
    assert code == 0 and len(one) == 1 and torchrun_args(shlex.split(one[0])).standalone


def test_what_stops_a_job(plan_2x8: str, capsys: pytest.CaptureFixture[str],
                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    no_size = tmp_path / "no_size.toml"
    no_size.write_text('[mesh]\ndp_shard = -1\n\n[[plugins]]\nname = "fsdp2"\n')
    code, data = launch(capsys, str(no_size), "--slurm", "--", "train.py")
    assert code == 1 and [f["code"] for f in data["findings"]] == ["CP981"]
    # ...which --nodes / --devices-per-node give.
    code, data = launch(capsys, str(no_size), "--slurm", "--dry-run", "--nodes", "2",
                        "--devices-per-node", "4", "--", "train.py")
    assert code == 0 and "--nproc-per-node=4" in data["text"]
    code, data = launch(capsys, plan_2x8, "--slurm", "--gpus-per-node", "4", "--",
                        "train.py")
    assert code == 1 and [f["code"] for f in data["findings"]] == ["CP982"]
    assert "--gpus-per-node 4 but the plan runs 8 process(es) per node" in \
        data["findings"][0]["message"]
    code, data = launch(capsys, plan_2x8, "--torchrun", "--", "train.py")
    assert code == 1 and [f["code"] for f in data["findings"]] == ["CP984"]
    # A plan with errors on its topology writes no job: tp(2) across nodes of 1.
    code, data = launch(capsys, HSDP_TP, "--slurm", "--nodes", "8", "--devices-per-node",
                        "1", "--", "train.py")
    assert code == 1 and "CP302" in [f["code"] for f in data["findings"]]
    assert list(tmp_path.glob("*.sbatch")) == []


def test_the_job_is_written_where_asked(plan_2x8: str, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, data = launch(capsys, plan_2x8, "--slurm", "--", "train.py")
    assert code == 0 and data["written"] == "two-by-eight.sbatch"
    assert (tmp_path / "two-by-eight.sbatch").read_text() == data["text"]
    code, data = launch(capsys, plan_2x8, "--torchrun", "--rdzv-host", "n0", "-o",
                        "nodes.sh", "--name", "run-7", "--", "train.py")
    assert code == 0 and os.access(tmp_path / "nodes.sh", os.X_OK)
    assert "--rdzv-id=run-7" in (tmp_path / "nodes.sh").read_text()
    # Text output says where it went.
    assert cli(["launch", plan_2x8, "--kubernetes", "--image", "i", "--", "train.py"]) == 0
    assert "wrote two-by-eight.yaml: 2 node(s) x 8 process(es)" in capsys.readouterr().out


def test_submitting_needs_the_scheduler_s_client(
        plan_2x8: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code = cli(["launch", plan_2x8, "--kubernetes", "--image", "i", "--submit", "--",
                "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and "--submit: kubectl is not on PATH here; the job is written to " \
        "two-by-eight.yaml" in err
    assert (tmp_path / "two-by-eight.yaml").exists()  # written, for submitting elsewhere
    code = cli(["launch", plan_2x8, "--torchrun", "--rdzv-host", "n0", "--submit", "--",
                "train.py"])
    assert code == 2 and "torchrun has no scheduler to submit to" in capsys.readouterr().err
    code = cli(["launch", plan_2x8, "--slurm", "--submit", "--dry-run", "--", "train.py"])
    assert code == 2


def test_bad_command_lines_are_exit_2(plan_2x8: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in [
        ([plan_2x8, "--slurm"], "give the training script after --"),
        ([plan_2x8, "--slurm", "--env", "=x", "--", "t.py"], "expected NAME=VALUE"),
        ([plan_2x8, "--slurm", "--env", "COMPOSER_PAR_TOPOLOGY=9x9", "--", "t.py"],
         "--env COMPOSER_PAR_TOPOLOGY: launch sets it from the plan"),
        ([plan_2x8, "--slurm", "--sbatch-option", "qos=high", "--", "t.py"],
         "expected one sbatch option"),
        ([plan_2x8, "--", "t.py"], "one of the arguments --slurm --kubernetes --torchrun"),
        ([plan_2x8, "--slurm", "--torchrun", "--", "t.py"], "not allowed with argument"),
    ]:
        code, data = launch(capsys, *argv)
        assert code == 2 and said in data["error"], (argv, data)
    code, data = launch(capsys, "/no/such/plan.toml", "--slurm", "--", "t.py")
    assert code == 2 and data["findings"][0]["code"] == "CP501"


def test_the_words_after_the_separator_belong_to_the_script(
        plan_2x8: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["launch", plan_2x8, "--slurm", "--dry-run", "--", "train.py", "--json",
                "--slurm", "--"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("#!/bin/bash")
    assert out.rstrip().endswith("train.py --json --slurm --")


def test_names_and_yaml() -> None:
    assert job_name("HSDP_fsdp tp") == "hsdp-fsdp-tp"
    assert job_name("7b-plan") == "plan-7b-plan"
    assert job_name("___") == "plan"
    assert len(job_name("x" * 100)) == 63
    tricky = {"a": ["yes", "no", "2x8", "-x", "", "a: b", "#c", "null", "1e3", "x y",
                    "ünïcode", "--max-restarts=1", "nvidia.com/gpu", 3, True],
              "nvidia.com/gpu": 4, "empty": {}, "none": [], "nested": [{"k": "v", "n": 1}]}
    assert yaml.safe_load(to_yaml(tricky, "two\nlines")) == tricky
