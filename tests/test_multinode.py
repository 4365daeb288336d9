"""Two torchrun agents on this machine stand for two nodes: examples/train.py runs an
HSDP x FSDP2 plan whose replicate dim crosses them, one node's processes are killed
mid-run, torchrun restarts them, and the run resumes from its last committed step to
the parameters an uninterrupted run ends with, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import processes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

EXAMPLES = Path(__file__).parent.parent / "examples"
PLAN = EXAMPLES / "plans" / "hsdp_two_nodes.toml"
STEPS, SAVE_EVERY = 8, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """Two torchrun agents (--nnodes 2, 2 processes each) meeting at a c10d rendezvous."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir = workdir / name
        self.workdir.mkdir()
        self.mark = processes.new_mark()
        port = free_port()
        self.agents: list[subprocess.Popen[bytes]] = []
        for node in range(2):
            log = (self.workdir / f"agent{node}.log").open("wb")
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{name}-{port}",
                "--max-restarts", "1", "--monitor-interval", "0.2",
                str(EXAMPLES / "train.py"), str(PLAN), "--seq-len", "32",
                "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--resume",
                "--checkpoint-dir", "ckpt", "--final-weights", "final",
            ]
            self.agents.append(subprocess.Popen(
                command, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                # Restarts need a fresh store per attempt (docs/multi-node.md).
                env={**os.environ, processes.MARK_ENV: self.mark,
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                start_new_session=True))
            log.close()

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        return [agent.wait(timeout=max(1.0, deadline - time.monotonic()))
                for agent in self.agents]

    def logs(self) -> str:
        return "".join((self.workdir / f"agent{n}.log").read_text(errors="replace")
                       for n in range(2))

    def events(self, name: str) -> list[dict[str, object]]:
        found = []
        for line in self.logs().splitlines():
            if line.startswith("{") and f'"event": "{name}"' in line:
                found.append(json.loads(line))
        return found

    def close(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        processes.kill_marked(self.mark)


def final_weights(directory: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    tensors: dict[str, object] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no weights exported to {directory}"
    return tensors


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_killed_node_restarts_and_resumes_to_the_uninterrupted_parameters_bitwise(
        tmp_path: Path) -> None:
    import torch

    jobs: list[Job] = []
    try:
        whole = Job(tmp_path, "whole")
        jobs.append(whole)
        assert whole.wait() == [0, 0], whole.logs()[-5000:]
        assert not whole.events("resumed")

        killed = Job(tmp_path, "killed")
        jobs.append(killed)
        first = killed.workdir / "ckpt" / f"step-{SAVE_EVERY:09d}" / "COMMITTED"
        wait_for(first.exists, 240, f"the first commit ({first})")
        # The processes of one node, not its agent: torchrun restarts them.
        workers = processes.children(killed.agents[1].pid)
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert killed.wait() == [0, 0], killed.logs()[-5000:]

        left = [pid for job in jobs for pid in processes.marked(job.mark)]
        assert left == [], f"processes left behind: {left}"

        # Each agent ran the command once: a resume at a later step is torchrun's restart.
        [resumed] = killed.events("resumed")
        assert SAVE_EVERY <= int(resumed["step"]) < STEPS, resumed  # type: ignore[call-overload]
        assert [e["step"] for e in whole.events("saved")] == list(range(2, STEPS + 1, 2))
        a, b = final_weights(whole.workdir / "final"), final_weights(killed.workdir / "final")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name  # type: ignore[arg-type]
    finally:
        for job in jobs:
            job.close()
