"""``composer-par launch --slurm`` against a real SLURM (Debian's slurmctld, slurmd and
munge, started on this machine as two nodes and stopped after): the written batch
script, submitted with ``--submit``, runs examples/train.py (the demo's Llama and
corpus) on 2 nodes x 1 process to the end, its checkpoint committed and reloadable in
one process; and a job started on another layout than its plan's is refused at start,
naming both layouts and the mesh dim that would cross nodes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from composer_par.cli.main import main as cli
from tests.slurm_cluster import SlurmCluster, free_port, missing_programs

pytestmark = [
    pytest.mark.scheduler,
    pytest.mark.distributed,
    pytest.mark.xdist_group("scheduler"),
    pytest.mark.timeout(600),
    pytest.mark.skipif(bool(missing_programs()), reason=(
        f"SLURM / munge not installed ({', '.join(missing_programs())}): ./dev setup "
        "installs Debian's slurmctld, slurmd, slurm-client and munge")),
]

EXAMPLES = Path(__file__).parent.parent / "examples"
STEPS, SEQ_LEN = 4, 32

# One replica per node: the replicate dim crosses the two nodes, as a real job's would.
REPLICAS = """\
[mesh]
dp_replicate = 2

[topology]
nodes = 2
devices_per_node = 1

[plan]
timeout = 120

[[plugins]]
name = "hsdp"

[[plugins]]
name = "meta_init"
seed = 0
"""

# Tensor parallelism inside one node of two processes.
INSIDE_A_NODE = """\
[mesh]
tp = 2

[topology]
nodes = 1
devices_per_node = 2

[plan]
timeout = 120

[[plugins]]
name = "tp"

[[plugins]]
name = "meta_init"
seed = 0
"""


@pytest.fixture(scope="module")
def slurm() -> object:
    cluster = SlurmCluster(nodes=2, cpus=2)
    try:
        yield cluster
    finally:
        left = cluster.stop()
        assert left == [], f"processes left running after SLURM stopped: {left}"


def _launch(tmp_path: Path, plan: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str], slurm: SlurmCluster, *extra: str) -> dict:
    """composer-par launch --slurm --submit, in this process, against the test cluster."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    # The job runs this environment's torchrun and python (sbatch exports the caller's).
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{slurm.env['PATH']}")
    monkeypatch.setenv("COMPOSER_PAR_TEST_MARK", slurm.mark)
    code = cli(["launch", str(plan), "--slurm", "--json", "--submit",
                "--port", str(free_port()), "--job-output", str(tmp_path / "job-%j.out"),
                *extra, "--", str(EXAMPLES / "train.py"), str(plan), "--seq-len",
                str(SEQ_LEN), "--steps", str(STEPS), "--micro-batch", "2",
                "--checkpoint-dir", "ckpt", "--final-weights", "final"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0, data
    assert data["submitted"]["ok"], data
    return data


def test_the_written_sbatch_trains_to_a_committed_reloadable_checkpoint(
        tmp_path: Path, slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from composer_par.plugins.meta_init import MetaInit
    from safetensors.torch import load_file

    from composer_par import MeshSpec, ParallelPlan, checkpoint
    from composer_par.tools.demo import build_model

    plan = tmp_path / "replicas.toml"
    plan.write_text(REPLICAS)
    data = _launch(tmp_path, plan, monkeypatch, capsys, slurm)
    script = Path(data["written"]).read_text()
    assert "#SBATCH --nodes=2" in script and "--nproc-per-node=1" in script
    assert "export COMPOSER_PAR_TOPOLOGY=2x1" in script
    job_id = data["submitted"]["job_id"]
    state = slurm.wait_job(job_id, timeout=420)
    output = (tmp_path / f"job-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", output[-6000:]

    final = tmp_path / "ckpt" / f"step-{STEPS:09d}"
    assert checkpoint.is_committed(final), sorted(p.name for p in final.parent.iterdir())
    assert checkpoint.latest(tmp_path / "ckpt") == final
    # Reloaded in one process, the checkpoint holds the parameters the job exported.
    with torch.device("meta"):
        model = build_model("llama", SEQ_LEN)
    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=0)).apply(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert checkpoint.load(final, model).step == STEPS
    exported: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "final").glob("*.safetensors")):
        exported.update(load_file(path))
    params = dict(model.named_parameters())
    assert exported and exported.keys() == params.keys()
    for name, value in params.items():
        assert torch.equal(value.detach(), exported[name]), name
    assert any(not torch.equal(before[n], params[n].detach()) for n in params), (
        "the checkpoint's parameters are the initial ones: nothing was trained")


def test_a_job_started_on_another_layout_is_refused_at_start(
        tmp_path: Path, slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "tp.toml"
    plan.write_text(INSIDE_A_NODE)
    # The job as written (1 node x 2), not submitted: a copy edited by hand to start one
    # process on each of 2 nodes, as a job written for another plan would.
    monkeypatch.chdir(tmp_path)
    code = cli(["launch", str(plan), "--slurm", "--port", str(free_port()),
                "--job-output", str(tmp_path / "job-%j.out"), "-o", "tp.sbatch", "--",
                str(EXAMPLES / "train.py"), str(plan), "--seq-len", str(SEQ_LEN),
                "--steps", str(STEPS), "--micro-batch", "2", "--checkpoint-dir", "ckpt"])
    assert code == 0, capsys.readouterr()
    written = (tmp_path / "tp.sbatch").read_text()
    assert "--nproc-per-node=2" in written
    (tmp_path / "edited.sbatch").write_text(
        written.replace("--nproc-per-node=2", "--nproc-per-node=1"))
    env = {**slurm.env, "PATH": f"{Path(sys.executable).parent}:{slurm.env['PATH']}"}
    slurm.env, saved = env, slurm.env
    try:
        submitted = slurm.run(["sbatch", "--parsable", "--nodes=2", "edited.sbatch"],
                              cwd=tmp_path)
    finally:
        slurm.env = saved
    job_id = submitted.stdout.strip().split(";")[0]
    state = slurm.wait_job(job_id, timeout=300)
    output = (tmp_path / f"job-{job_id}.out").read_text(errors="replace")
    assert state == "FAILED", output[-6000:]
    assert "CP306" in output, output[-6000:]
    assert "plan wants 1 node x 2, the job has 2 x 1: tp(2) would cross nodes" in output, (
        output[-6000:])
    # Read from SLURM's step as well as torchrun's variables.
    assert "SLURM_STEP_NUM_NODES=2, SLURM_STEP_NODELIST=node[1-2], " \
        "SLURM_STEP_TASKS_PER_NODE=1(x2)" in output, output[-6000:]
    # Refused before training: nothing was saved.
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_job_the_scheduler_refuses_is_exit_1_with_its_reason(
        tmp_path: Path, slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "replicas.toml"
    plan.write_text(REPLICAS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    code = cli(["launch", str(plan), "--slurm", "--json", "--submit", "--partition",
                "nosuch", "--", str(EXAMPLES / "train.py"), str(plan)])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["exit_code"] == 1 and not data["submitted"]["ok"]
    assert "sbatch refused the job (exit 1)" in data["submitted"]["message"]
    assert "invalid partition" in data["submitted"]["message"].lower()
    assert (tmp_path / "replicas.sbatch").exists()  # written, to fix and submit again
