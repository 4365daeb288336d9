"""composer_par.integrations.ray on a real Ray cluster (a local one of 2 worker CPUs,
started by the test on this machine and shut down after): Ray Train's TorchTrainer,
sized by the plan, trains an FSDP2 plan at parity with one process, every worker's
parameters; the plan's checkpoint is committed in the run's directory and is the one
Ray reports."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray starts a local cluster of its own (under /tmp/ray, which no test would stop) when
# its API is called with none running; only the test's own cluster may run: auto-connect
# off for this test process, set before ray is imported (Ray reads it then).
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'composer-par[ray]'")

from composer_par import ParallelPlan
from composer_par.testing.parity import ParityCase, parity_result
from tests import processes
from tests.ray_workers import PLAN, train_loop

pytestmark = [
    pytest.mark.scheduler, pytest.mark.distributed, pytest.mark.xdist_group("scheduler"),
    pytest.mark.timeout(420),
    # Ray 2.60's trainer makes its data context, whose constructor warns of Ray's own
    # deprecated fields (set to their defaults) as it sets them.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]

ROOT = Path(__file__).resolve().parent.parent
STEPS, LR = 6, 0.05


def descendants(pid: int) -> set[int]:
    found, pending = set(), [pid]
    while pending:
        for child in processes.children(pending.pop()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import ray

    mark = processes.new_mark()
    # No token written into the home directory for a throwaway cluster.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv(processes.MARK_ENV, mark)
    # A short path: Ray's sockets live under it.
    temp = tempfile.mkdtemp(prefix="cp-ray-", dir="/tmp")
    before = descendants(os.getpid())
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        # Ray's daemons (GCS, raylet, its agents, the workers) descend from this process
        # until shutdown; Ray renames its processes, so they are known by this tree.
        started = descendants(os.getpid()) - before
        gc.collect()  # Ray objects' finalizers run while the cluster is still up
        ray.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.2)
        left = sorted(p for p in started if _alive(p))
        for pid in left:  # what shutdown left: stopped here, and reported below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        processes.kill_marked(mark)
        shutil.rmtree(temp, ignore_errors=True)
        assert left == [], f"Ray processes left running 30 s after shutdown: {left}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def test_fsdp2_trains_at_parity_inside_ray_train(ray_cluster: None, tmp_path: Path) -> None:
    import torch
    from ray.train import RunConfig

    from composer_par import checkpoint
    from composer_par.integrations.ray import CHECKPOINT_DIR, plan_trainer

    plan = ParallelPlan.from_toml(PLAN)
    out = tmp_path / "out"
    out.mkdir()
    trainer = plan_trainer(
        plan, train_loop, config={"lr": LR, "steps": STEPS, "out": str(out)},
        resources_per_worker={"CPU": 1},
        run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="fsdp2"))
    result = trainer.fit()
    assert result.error is None, result.error

    views = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [v["world_size"] for v in views] == [2, 2]  # the plan's world size, from Ray
    case = ParityCase(task="tests.ray_workers:TASK", plan=PLAN, world_size=2, steps=STEPS, lr=LR)
    parity_result(case, [(v["losses"], v["params"]) for v in views]).assert_close()

    saved = Path(views[0]["checkpoint"])
    assert saved == tmp_path / "runs" / "fsdp2" / CHECKPOINT_DIR / f"step-{STEPS:09d}"
    assert checkpoint.is_committed(saved)
    assert result.checkpoint is not None and Path(result.checkpoint.path) == saved
    assert result.metrics["loss"] == pytest.approx(views[0]["losses"][-1])
