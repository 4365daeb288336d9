"""A third-party plugin distribution, built here from the hello-world of
docs/writing-plugins.md and installed the way pip installs one (a package and its
``.dist-info`` with an entry point, on the path): it imports only ``composer_par.plugin``,
is listed by ``composer-par plugins`` and ``composer-par rules``, is traced, reports its own
finding, and takes part in a plan applied on two real ranks."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from composer_par.testing import run_ranks

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("third_party_plugin")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "writing-plugins.md"


def hello_world_source() -> str:
    """The first Python block under the page's "Hello, plugin" heading."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Hello, plugin", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "docs/writing-plugins.md lost its hello-world plugin"
    return match.group(1)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out as pip lays out an installed distribution."""
    site = tmp_path_factory.mktemp("site")
    package = site / "composer_par_hello"
    package.mkdir()
    (package / "__init__.py").write_text(hello_world_source(), encoding="utf-8")
    info = site / "composer_par_hello-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: composer-par-hello\nVersion: 0.1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[composer_par.plugins]\nfreeze = composer_par_hello:Freeze\n", encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")
    return site


def cli(site: Path, *args: str, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(site), **(env or {})}
    environ.pop("COMPOSER_PAR_PLUGINS_ALLOW", None)
    environ.pop("COMPOSER_PAR_PLUGINS_BLOCK", None)
    return subprocess.run([sys.executable, "-m", "composer_par.cli", *args], env=environ,
                          capture_output=True, text=True, timeout=120, input=stdin)


def test_the_plugin_imports_only_the_author_package() -> None:
    tree = ast.parse(hello_world_source())
    modules = {node.module for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module}
    modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    ours = {m for m in modules if m.split(".")[0] == "composer_par"}
    assert ours == {"composer_par.plugin"}


def test_listed_by_plugins_and_rules(site: Path) -> None:
    listed = cli(site, "plugins", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)["plugins"]}
    assert rows["freeze"]["distribution"] == "composer-par-hello"
    assert rows["freeze"]["version"] == "0.1.0"
    assert rows["freeze"]["stages"] == ["convert"]

    rules = cli(site, "rules", "--json")
    assert rules.returncode == 0, rules.stderr
    codes = {r["code"]: r for r in json.loads(rules.stdout)["rules"]}
    assert codes["HELLO01"]["severity"] == "error"


PLAN = """
[mesh]
dp_shard = 2

[[plugins]]
name = "freeze"

[[plugins]]
name = "fsdp2"
"""


def test_traced_by_the_trace_switch(site: Path) -> None:
    run = cli(site, "validate", "-", env={"COMPOSER_PAR_TRACE_HOOKS": "1"}, stdin=PLAN)
    assert run.returncode == 0, run.stdout + run.stderr
    # pluggy's trace shows each hook call and its answers: the plugin's declaration.
    assert "composer_par_declare" in run.stderr
    assert "plugin='freeze'" in run.stderr


def test_its_finding_is_reported_before_anything_changes(site: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from composer_par import ParallelPlan
    from composer_par.findings import Severity
    from composer_par.plugin.registry import Registry
    from composer_par.testing.tasks import LlamaTask

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("COMPOSER_PAR_PLUGINS_ALLOW", raising=False)
    monkeypatch.delenv("COMPOSER_PAR_PLUGINS_BLOCK", raising=False)
    plan = ParallelPlan.from_toml(PLAN.replace('name = "freeze"', 'name = "freeze"\n'
                                               'prefix = "embedding"'), registry=Registry())
    with torch.device("meta"):
        model = LlamaTask().build()
    report = plan.validate(model, world_size=2)
    (finding,) = [f for f in report.findings if f.code == "HELLO01"]
    assert finding.plugin == "freeze"
    assert finding.severity is Severity.ERROR  # from the plugin's own catalog
    assert "'embedding'" in finding.message


@pytest.mark.distributed
def test_takes_part_in_a_plan_on_two_ranks(site: Path) -> None:
    results = run_ranks("tests.third_party_workers:train_with_the_plugin", 2,
                        args=(str(site), 2), timeout=120)
    for result in results:
        assert result["plugin_module"] == "composer_par_hello"
        assert result["applied"][0] == ("convert", "freeze",
                                        "froze 1 parameter(s) named tok_embeddings*")
        assert not result["requires_grad"]["tok_embeddings.weight"]
        assert not result["changed"]["tok_embeddings.weight"]
        trained = [n for n, changed in result["changed"].items() if changed]
        assert "output.weight" in trained and len(trained) == len(result["changed"]) - 1
