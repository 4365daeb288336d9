"""The distribution: its package list is the whole tree, and a wheel built from the
sources installs into a new environment and runs ``composer-par demo`` outside the
checkout, with the package it installed (not the checkout's)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# What a wheel is built from: the rest of the checkout (tests, docs, contrib) is not in it.
SOURCES = ("pyproject.toml", "README.md", "src", "plugins")

SMALL_PLAN = """\
[mesh]
dp_shard = 2

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 0
"""


def packages_on_disk() -> set[str]:
    """Every directory with files in it (code or data), named as setuptools' package-dir
    maps it (src/composer_par -> composer_par, plugins -> composer_par.plugins)."""
    found = set()
    for package, directory in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for path in [ROOT / directory, *(ROOT / directory).rglob("*")]:
            if (not path.is_dir() or "__pycache__" in path.parts
                    or not any(entry.is_file() for entry in path.iterdir())):
                continue
            relative = path.relative_to(ROOT / directory).parts
            if relative and relative[0] == "plugins" and package == "composer_par":
                continue  # composer_par.plugins comes from its own package-dir entry
            found.add(".".join((package, *relative)))
    return found


def test_the_package_list_is_every_directory_of_the_tree() -> None:
    listed = PYPROJECT["tool"]["setuptools"]["packages"]
    assert sorted(listed) == sorted(set(listed)), "a package is listed twice"
    on_disk = packages_on_disk()
    missing, extra = sorted(on_disk - set(listed)), sorted(set(listed) - on_disk)
    assert missing == [], "add them to [tool.setuptools] packages in pyproject.toml"
    assert extra == [], "listed packages without a directory"


def test_the_license_is_an_spdx_expression_that_the_build_requirement_reads() -> None:
    assert PYPROJECT["project"]["license"] == "BSD-3-Clause"
    # PEP 639 license expressions need setuptools 77.
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]


def setuptools_can_build_here() -> bool:
    """Whether this environment's setuptools meets the build requirement, so the wheel
    can be built with it (no isolated build environment to download)."""
    try:
        major = int(metadata.version("setuptools").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


def session_members(session: int) -> list[int]:
    """The live processes of a session (Linux /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def run_in_session(argv: list[str], *, cwd: Path, env: dict[str, str],
                   timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the leader of a new session, and make sure that nothing it started
    outlives it: the test fails if a process is left, and kills what is left."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} ran past {timeout} s:\n{err[-4000:]}")
    deadline = time.monotonic() + 15
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session_members(proc.pid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left behind by {argv[:2]}: {left}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_checked(argv: list[str | Path], *, timeout: float, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_built_wheel_installs_and_runs_the_demo_outside_the_checkout() -> None:
    with tempfile.TemporaryDirectory(prefix="composer-par-wheel-") as temp:
        tmp = Path(temp)
        # Built from a copy, so the build leaves nothing (build/, *.egg-info) in the
        # checkout.
        source = tmp / "source"
        for name in SOURCES:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, source / name, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.egg-info"))
            else:
                source.mkdir(exist_ok=True)
                shutil.copy2(path, source / name)
        isolation = ["--no-build-isolation"] if setuptools_can_build_here() else []
        built = run_checked([sys.executable, "-m", "pip", "wheel", "--no-deps",
                             "--no-cache-dir", *isolation, "-w", tmp / "dist", source],
                            timeout=300)
        assert "Warning" not in built.stdout + built.stderr, built.stderr  # e.g. setuptools'
        [wheel] = (tmp / "dist").glob("composer_par-*.whl")

        venv = tmp / "venv"
        run_checked([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
        python = venv / "bin" / "python"
        run_checked([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                     "--no-index", "--no-cache-dir", wheel], timeout=300)
        # The runtime dependencies (torch, pluggy, ...) come from this environment rather
        # than from a download of several hundred MB: a directory of links to everything
        # in its site-packages except composer_par's own entries (the checkout's editable
        # install and the contrib distributions), named by a .pth file of the new one.
        deps = tmp / "deps"
        deps.mkdir()
        here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        for directory in map(Path, here):
            for entry in directory.iterdir():
                if (entry.name.startswith(("composer_par", "__editable__"))
                        or entry.suffix == ".pth" or (deps / entry.name).exists()):
                    continue
                (deps / entry.name).symlink_to(entry)
        site = run_checked([python, "-c", "import sysconfig; "
                            "print(sysconfig.get_paths()['purelib'])"], timeout=60).stdout
        Path(site.strip(), "composer_par_test_deps.pth").write_text(f"{deps}\n")

        work = tmp / "work"  # outside the checkout: nothing there to import by accident
        work.mkdir()
        (work / "plan.toml").write_text(SMALL_PLAN)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "COMPOSER_PAR_", "VIRTUAL_ENV"))}
        # No bytecode written: the linked dependencies are this environment's files.
        env.update(NO_COLOR="1", PYTHONDONTWRITEBYTECODE="1")
        where = run_checked([python, "-c", (
            "import json, composer_par, composer_par.plugins.fsdp2 as f; "
            "from importlib import resources; "
            "corpus = resources.files('composer_par').joinpath('data/corpus.txt'); "
            "print(json.dumps([composer_par.__file__, f.__file__, len(corpus.read_bytes())]))"
        )], cwd=work, env=env, timeout=120).stdout
        package, plugin, corpus = json.loads(where)
        assert Path(package).is_relative_to(venv) and Path(plugin).is_relative_to(venv)
        assert corpus > 1000
        script = venv / "bin" / "composer-par"
        assert script.read_text().splitlines()[0] == f"#!{python}"

        done = run_in_session(
            [str(script), "demo", "--json", "--plan", "plan.toml", "--nproc", "2", "--steps",
             "2", "--seq-len", "16", "--checkpoint-dir", "ckpt", "--timeout", "60"],
            cwd=work, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads(done.stdout)
        assert result["ok"] and result["nproc"] == 2 and len(result["losses"]) == 2
        assert (work / result["checkpoint"]).is_dir()  # relative to the demo's directory
    assert not Path(temp).exists()


def _dist_info(metadata: dict[str, object]) -> str:
    """A METADATA file from pip's report of a distribution (what pip's resolver reads of an
    installed one: its name, version, Python range and requirements)."""
    lines = ["Metadata-Version: 2.1", f"Name: {metadata['name']}",
             f"Version: {metadata['version']}"]
    if metadata.get("requires_python"):
        lines.append(f"Requires-Python: {metadata['requires_python']}")
    lines += [f"Provides-Extra: {e}" for e in metadata.get("provides_extra") or []]  # type: ignore[attr-defined]
    lines += [f"Requires-Dist: {r}" for r in metadata.get("requires_dist") or []]  # type: ignore[attr-defined]
    return "\n".join(lines) + "\n"


def _resolve(python: Path, requirements: list[str], tmp: Path) -> dict[str, str]:
    """What pip would install into ``python``'s environment for ``requirements``:
    name -> version (a dry run; nothing is installed)."""
    report = tmp / f"report-{len(list(tmp.glob('report-*')))}.json"
    run_checked([sys.executable, "-m", "pip", "--python", python, "install", "--dry-run",
                 "--quiet", "--report", report, *requirements], timeout=900)
    return {entry["metadata"]["name"].lower(): entry["metadata"]["version"]
            for entry in json.loads(report.read_text())["install"]}


@pytest.mark.timeout(1200)
def test_resolving_the_requirements_beside_torch_2_14_1_keeps_it() -> None:
    """A user's environment with torch 2.14.1: pip resolving composer-par's requirements
    (run time and the hf extra) keeps that torch. The torch is installed as pip sees one:
    its distribution metadata, taken from pip's own report on the 2.14.1 wheel, not its
    4 GB of files."""
    project = PYPROJECT["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["hf"]]
    assert [r for r in requirements if r.startswith("torch")] == ["torch>=2.13"]
    with tempfile.TemporaryDirectory(prefix="composer-par-resolve-") as temp:
        tmp = Path(temp)
        venv = tmp / "venv"
        run_checked([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
        python = venv / "bin" / "python"
        report = tmp / "torch.json"
        run_checked([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                     "--ignore-installed", "--no-deps", "--report", report, "torch==2.14.1"],
                    timeout=600)
        [torch_entry] = json.loads(report.read_text())["install"]
        site = run_checked([python, "-c", "import sysconfig; "
                            "print(sysconfig.get_paths()['purelib'])"], timeout=60).stdout
        info = Path(site.strip(), "torch-2.14.1.dist-info")
        info.mkdir()
        (info / "METADATA").write_text(_dist_info(torch_entry["metadata"]))
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")

        chosen = _resolve(python, requirements, tmp)
        assert "torch" not in chosen, f"pip would replace torch 2.14.1 with {chosen['torch']}"
        assert "transformers" in chosen  # the resolution did run
