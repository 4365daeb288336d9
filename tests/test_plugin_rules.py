"""Each plugin's own rule catalog: how a finding's severity is found, composer_par.RULES,
the catalogs' examples, conflicting codes (CP222 and ``composer-par rules``), and a
third-party distribution's codes listed with where they come from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

import composer_par
from composer_par import (
    FSDP2,
    ActivationCheckpoint,
    Compile,
    MeshSpec,
    MetaInit,
    ParallelPlan,
    PlanFileError,
)
from composer_par.findings import CORE_RULES, RULES, Finding, Rule, Severity, rule_for
from composer_par.plugin import Plugin, hookimpl
from composer_par.rules import catalogs, listing, rule_conflicts, sources_text

ROOT = Path(__file__).resolve().parent.parent


# -- Rule and the severity of a finding ------------------------------------------------------


def test_a_rule_is_a_frozen_value_whose_severity_is_converted() -> None:
    rule = Rule("XMP101", "warning", "a meaning", "a fix", "[mesh]\n")
    assert rule.severity is Severity.WARNING
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        rule.title = "another"  # type: ignore[misc]
    with pytest.raises(ValueError):
        Rule("XMP102", "fatal", "no such severity")
    assert rule.to_dict() == {"code": "XMP101", "severity": "warning", "title": "a meaning",
                              "fix": "a fix", "example": "[mesh]\n"}
    assert rule.means_the_same_as(attrs.evolve(rule, fix="other words"))
    assert not rule.means_the_same_as(attrs.evolve(rule, severity=Severity.ERROR))


@attrs.frozen
class Loud(Plugin):
    """Its own code TSTA01 is an error; it also reports a code only Quiet's catalog has."""

    name: ClassVar[str] = "loud"
    rules: ClassVar[tuple[Rule, ...]] = (Rule("TSTA01", Severity.ERROR, "loud's meaning"),)

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        return [Finding("TSTA01", "from loud"), Finding("TSTB01", "borrowed"),
                Finding("TSTZ99", "in no catalog"), Finding("CP201", "a core code")]


@attrs.frozen
class Quiet(Plugin):
    """Gives TSTA01 another meaning (a warning) and owns TSTB01 (info)."""

    name: ClassVar[str] = "quiet"
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule("TSTA01", Severity.WARNING, "quiet's meaning"),
        Rule("TSTB01", Severity.INFO, "quiet's own"),
    )

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        return [Finding("TSTA01", "from quiet")]


def test_a_findings_severity_comes_from_the_core_then_its_plugin_then_any_catalog() -> None:
    report = ParallelPlan(MeshSpec()).use(Loud()).use(Quiet()).validate()
    got = {(f.plugin, f.code, f.message): f.severity for f in report.findings}
    # each plugin's own catalog decides for the findings its hooks make
    assert got[("loud", "TSTA01", "from loud")] is Severity.ERROR
    assert got[("quiet", "TSTA01", "from quiet")] is Severity.WARNING
    # a code the current plugin lacks: any known catalog's; a code none has: an error
    assert got[("loud", "TSTB01", "borrowed")] is Severity.INFO
    assert got[("loud", "TSTZ99", "in no catalog")] is Severity.ERROR
    assert got[("loud", "CP201", "a core code")] is CORE_RULES["CP201"].severity
    # outside any hook: the plugin named, else any catalog
    assert Finding("TSTA01", "x", plugin="quiet").severity is Severity.WARNING
    assert Finding("TSTA01", "x", plugin="loud").severity is Severity.ERROR
    assert rule_for("TSTB01") == Quiet.rules[1]
    assert Finding("TSTA01", "x", severity="info").severity is Severity.INFO  # given wins


def test_the_plans_plugins_giving_one_code_two_meanings_is_cp222() -> None:
    report = ParallelPlan(MeshSpec()).use(Loud()).use(Quiet()).validate()
    (conflict,) = [f for f in report.findings if f.code == "CP222"]
    assert conflict.severity is Severity.WARNING and conflict.plugin == "quiet"
    assert "TSTA01" in conflict.message and "loud's meaning" in conflict.message
    assert "quiet's meaning" in conflict.message and "prefix" in conflict.fix
    # one plugin alone, or one used twice, agrees with itself
    alone = ParallelPlan(MeshSpec()).use(Loud()).use(Loud()).validate()
    assert "CP222" not in alone.codes() and "CP204" in alone.codes()


def test_a_plugin_redefining_a_core_code_is_cp222() -> None:
    @attrs.frozen
    class Rogue(Plugin):
        name: ClassVar[str] = "rogue"
        rules: ClassVar[tuple[Rule, ...]] = (Rule("CP201", Severity.INFO, "something else"),)

        def declare(self) -> Any:  # built from scratch: the catalog still travels
            from composer_par.plugin import Declaration

            return Declaration(plugin="rogue")

    report = ParallelPlan(MeshSpec()).use(Rogue()).validate()
    (conflict,) = [f for f in report.findings if f.code == "CP222"]
    assert conflict.plugin == "rogue" and "core" in conflict.message
    assert "must not redefine a core code" in conflict.fix
    # the core's meaning stays the one findings get
    assert Finding("CP201", "x", plugin="rogue").severity is Severity.ERROR


def test_plugins_sharing_one_rule_do_not_conflict() -> None:
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint())
            .use(Compile(backend="eager")).use(MetaInit()))
    assert "CP222" not in plan.validate().codes()
    assert ActivationCheckpoint.rules[0] is next(r for r in Compile.rules if r.code == "CP411")


# -- composer_par.RULES --------------------------------------------------------------------


def test_rules_is_a_read_only_mapping_of_every_known_code() -> None:
    assert composer_par.RULES is RULES
    assert set(CORE_RULES) <= set(RULES)
    for code in ("CP216", "CP411", "CP414", "CP404", "CP212"):  # the built-ins' own
        assert code in RULES and code not in CORE_RULES
    # A plugin class defined here is not installed: not listed, yet its findings take
    # their severities from its catalog (tested above).
    assert "TSTB01" not in RULES
    assert list(RULES) == sorted(RULES)
    with pytest.raises(TypeError):
        RULES["XMP999"] = Rule("XMP999", "error", "x")  # type: ignore[index]


def test_rules_loads_the_installed_plugins_without_torch() -> None:
    code = ("import sys, composer_par\n"
            "assert 'composer_par_compress' not in sys.modules\n"
            "rule = composer_par.RULES['CPC101']\n"
            "assert 'composer_par_compress' in sys.modules, 'loaded on first use'\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print(rule.severity.value, rule.title)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("COMPOSER_PAR_PLUGINS_ALLOW", "COMPOSER_PAR_PLUGINS_BLOCK")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("error compression on a plan")


# -- the catalogs' examples ---------------------------------------------------------------


def _plan_file_examples() -> list[tuple[str, Rule]]:
    return [(source, rule) for source, rule in catalogs() if rule.example.startswith("[")]


@pytest.mark.parametrize(("source", "rule"), _plan_file_examples(),
                         ids=lambda v: v.code if isinstance(v, Rule) else None)
def test_each_plan_file_example_triggers_its_code(source: str, rule: Rule) -> None:
    try:
        report = ParallelPlan.from_toml(rule.example).validate()
    except PlanFileError as exc:
        report = exc.report
    assert rule.code in report.codes(), (
        f"{source}: {rule.code}'s example is a plan file, so validating it alone must report "
        f"{rule.code} (a rule that needs a model gives a Python example); it gives\n"
        + report.format())


def test_most_static_codes_have_a_plan_file_example() -> None:
    examples = {rule.code for _, rule in _plan_file_examples()}
    static = {code for code in CORE_RULES if code[2] in "1235"}
    # those left out need a plugin of the example's own (CP206, CP211, CP218-CP220,
    # CP222), a running job (CP102; CP306-CP309, read from the job's environment) or a
    # missing file (CP501)
    assert static - examples == {"CP102", "CP206", "CP210", "CP211", "CP218", "CP219",
                                 "CP220", "CP222", "CP306", "CP307", "CP308", "CP309",
                                 "CP501"}


# -- composer-par rules and a third-party distribution --------------------------------------

THIRD_PARTY = '''
from typing import ClassVar

import attrs
from composer_par.plugin import Finding, Plugin, Rule, Severity, hookimpl

RULE = Rule("ACME101", Severity.WARNING, "the widget is loose", "tighten the widget",
            '[mesh]\\n\\n[[plugins]]\\nname = "acme"\\n')


@attrs.frozen
class Acme(Plugin):
    name: ClassVar[str] = "acme"
    rules: ClassVar[tuple[Rule, ...]] = (RULE,)

    @hookimpl
    def composer_par_validate_plan(self) -> list[Finding]:
        return [Finding("ACME101", "loose")]


@attrs.frozen
class Rival(Plugin):
    name: ClassVar[str] = "rival"
    rules: ClassVar[tuple[Rule, ...]] = (Rule("ACME101", Severity.ERROR, "a rival meaning"),)
'''


def _install(site: Path, *entry_points: str) -> Path:
    """A distribution laid out as pip installs one: its package and a .dist-info."""
    (site / "acme_plugins.py").write_text(THIRD_PARTY, encoding="utf-8")
    info = site / "acme_plugins-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-plugins\nVersion: 1.2.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[composer_par.plugins]\n" + "".join(f"{e}\n" for e in entry_points),
        encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")
    return site


def _cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("COMPOSER_PAR_PLUGINS_ALLOW", None)
    env.pop("COMPOSER_PAR_PLUGINS_BLOCK", None)
    return subprocess.run([sys.executable, "-m", "composer_par.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_rules_lists_a_third_party_plugins_codes_with_their_source(tmp_path: Path) -> None:
    site = _install(tmp_path, "acme = acme_plugins:Acme")
    text = _cli(site, "rules")
    assert text.returncode == 0, text.stderr
    header, *lines = text.stdout.splitlines()
    assert header.split() == ["CODE", "SEVERITY", "TITLE", "SOURCE"]
    (acme,) = [line for line in lines if line.startswith("ACME101")]
    assert "warning" in acme and "the widget is loose" in acme
    assert acme.rstrip().endswith("acme (acme-plugins)")
    assert any(line.startswith("CP216") and line.rstrip().endswith("fsdp2 (composer-par)")
               for line in lines)
    data = json.loads(_cli(site, "rules", "--json").stdout)
    rows = {r["code"]: r for r in data["rules"]}
    assert rows["ACME101"] == {"code": "ACME101", "severity": "warning",
                               "title": "the widget is loose", "fix": "tighten the widget",
                               "example": '[mesh]\n\n[[plugins]]\nname = "acme"\n',
                               "source": "acme (acme-plugins)",
                               "sources": ["acme (acme-plugins)"]}
    assert rows["CP101"]["source"] == "core"
    assert rows["CP411"]["sources"] == ["activation_checkpoint (composer-par)",
                                        "compile (composer-par)"]
    assert data["conflicts"] == []


def test_rules_exits_1_on_two_catalogs_giving_one_code_two_meanings(tmp_path: Path) -> None:
    site = _install(tmp_path, "acme = acme_plugins:Acme", "rival = acme_plugins:Rival")
    text = _cli(site, "rules")
    assert text.returncode == 1, text.stdout + text.stderr
    (error,) = [line for line in text.stdout.splitlines() if line.startswith("ERROR")]
    assert "ACME101" in error and "the widget is loose" in error
    assert "a rival meaning" in error and "prefix" in error
    # both meanings are listed, each with its source
    assert sum(line.startswith("ACME101") for line in text.stdout.splitlines()) == 2
    run = _cli(site, "rules", "--json")
    assert run.returncode == 1
    (conflict,) = json.loads(run.stdout)["conflicts"]
    assert conflict["code"] == "ACME101"
    assert [(d["source"], d["severity"]) for d in conflict["definitions"]] == [
        ("acme (acme-plugins)", "warning"), ("rival (acme-plugins)", "error")]


def test_catalogs_name_each_source_and_listing_merges_shared_rules() -> None:
    entries = catalogs()
    assert ("core", CORE_RULES["CP101"]) in entries
    rows = {rule.code: sources for rule, sources in listing(entries)}
    assert rows["CP414"] == ["load_checkpoint (composer-par)", "load_safetensors (composer-par)"]
    assert sources_text(rows["CP414"]) == "load_checkpoint, load_safetensors (composer-par)"
    assert sources_text(["core"]) == "core"
    a, b = Rule("X01", "error", "one"), Rule("X01", "error", "two")
    assert list(rule_conflicts([("p", a), ("q", attrs.evolve(a, fix="f"))])) == []
    assert rule_conflicts([("p", a), ("q", b)]) == {"X01": [("p", a), ("q", b)]}
