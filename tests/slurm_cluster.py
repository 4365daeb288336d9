"""A SLURM cluster on this machine for the tests: munged, slurmctld and one slurmd per
node (each slurmd its own node, on its own port, all on loopback), from Debian's
packages, with a generated slurm.conf in a temporary directory.

Every daemon runs in the foreground as a child of the test, marked (tests.processes),
and :meth:`SlurmCluster.stop` ends them, cancels what is left of the jobs first, and
reports any marked process still alive. Nothing is read from or written to /etc.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests import processes

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
# Job states after which a job runs no more (scontrol's JobState).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


# Daemons live in sbin, which a user's PATH may leave out.
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def program(name: str) -> str:
    """The path of a SLURM or munge program (its name where it is not installed)."""
    return shutil.which(name, path=SEARCH) or name


def missing_programs() -> list[str]:
    """The SLURM and munge programs not installed here (``./dev setup`` installs them)."""
    return [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p, path=SEARCH) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(root: Path, nodes: int, cpus: int) -> str:
    names = [f"node{i + 1}" for i in range(nodes)]
    lines = [
        "ClusterName=composerpar",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.socket",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.%n.log",
        f"PlugStackConfig={root}/plugstack.conf",
        # No cgroups or accounting on a test machine: processes tracked by their parents.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        # Several slurmd on one host: each node takes the CPUs slurm.conf gives it.
        "SlurmdParameters=config_overrides",
        "MinJobAge=600",
        "SlurmdTimeout=60",
        "KillWait=5",
    ]
    for name in names:
        lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 "
                     f"Port={free_port()} CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(names)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """``nodes`` SLURM nodes on this machine, ``cpus`` CPUs each, started at once."""

    def __init__(self, nodes: int = 2, cpus: int = 2, *, timeout: float = 60.0) -> None:
        # A short path: munge's socket path must fit in a sockaddr_un.
        self.root = Path(tempfile.mkdtemp(prefix="cp-slurm-", dir="/tmp"))
        self.mark = processes.new_mark()
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.daemons: list[subprocess.Popen[bytes]] = []
        for sub in ("state", "spool", "jobs"):
            (self.root / sub).mkdir()
        (self.root / "plugstack.conf").write_text("")
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(_config(self.root, nodes, cpus))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), processes.MARK_ENV: self.mark}
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.out").open("wb")
        self.daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env, start_new_session=True))
        log.close()

    def _start(self, timeout: float) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # --force: munged refuses to run as root, and a /tmp path, without it.
        self._spawn("munged", [
            program("munged"), "--foreground", "--force", f"--socket={self.root}/munge.socket",
            f"--key-file={key}", f"--log-file={self.root}/munged.log",
            f"--pid-file={self.root}/munged.pid", f"--seed-file={self.root}/munged.seed"])
        self._wait(lambda: (self.root / "munge.socket").exists(), timeout, "munged's socket")
        self._spawn("slurmctld", [program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}",
                        [program("slurmd"), "-D", "-f", str(self.conf), "-N", node])
        self._wait(self._all_idle, timeout, f"{len(self.nodes)} idle SLURM nodes")

    def _all_idle(self) -> bool:
        for daemon in self.daemons:
            if daemon.poll() is not None:
                raise RuntimeError(f"a SLURM daemon exited ({daemon.args}): "
                                   + self.logs()[-3000:])
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return sorted(states) == sorted(self.nodes) and all(
            s == "idle" for s in states.values())

    def _wait(self, condition: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; logs:\n"
                                   + self.logs()[-3000:])
            time.sleep(0.2)

    def run(self, argv: list[str], *, check: bool = True, cwd: Path | None = None,
            timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A SLURM client command against this cluster."""
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=cwd,
                              timeout=timeout, check=False)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): "
                               f"{done.stderr.strip()}")
        return done

    def job_state(self, job_id: str) -> str:
        shown = self.run(["scontrol", "show", "job", job_id], check=False).stdout
        for word in shown.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float) -> str:
        """The job's final state, waiting at most ``timeout`` seconds (then cancelled)."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) not in FINISHED:
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")
            time.sleep(0.5)
        return state

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            with contextlib.suppress(OSError):
                parts.append(f"== {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> list[int]:
        """Cancel the jobs, stop the daemons (slurmd first), and return the pids of marked
        processes that were still alive after (then killed)."""
        if any(d.poll() is None for d in self.daemons[1:]):
            self.run(["scancel", "--full", "-u", "root"], check=False)
            with contextlib.suppress(TimeoutError):
                self._wait(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(),
                           20, "the jobs to end")
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.pid, signal.SIGKILL)
                    daemon.wait()
        deadline = time.monotonic() + 10
        while processes.marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes.marked(self.mark)
        processes.kill_marked(self.mark)
        shutil.rmtree(self.root, ignore_errors=True)
        return left
