"""Rule-code ranges are data: the core's (``CORE_CODE_RANGES``) and each installed plugin's
(``code_ranges``). Every catalog's codes lie in its own ranges or the shared ones, no two
ranges overlap, and the table in docs/rules.md is the data's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest

from composer_par.findings import CORE_CODE_RANGES, CodeRange, Rule, Severity
from composer_par.plugin import Plugin
from composer_par.rules import CORE, catalogs, code_ranges, range_problems, sources_text

DOCS = Path(__file__).resolve().parent.parent / "docs" / "rules.md"


def test_every_catalogs_codes_lie_in_its_ranges_and_no_ranges_overlap() -> None:
    entries, ranges = catalogs(), code_ranges()
    sources = {source for source, _ in entries}
    # the built-ins that keep codes of their own, and the contrib plugin, declare them
    declared = {source.partition(" (")[0] for source, _ in ranges}
    assert {"core", "pp", "ep", "cp", "offload", "float8", "ft", "compress"} <= declared
    assert {"core", "pp", "tp", "fsdp2", "compress"} <= {s.partition(" (")[0] for s in sources}
    assert range_problems(entries, ranges) == []


def test_a_code_outside_its_ranges_and_overlapping_ranges_are_named() -> None:
    pp = ("pp (composer-par)", CodeRange("CP", 601, 699, "pipeline parallelism"))
    ep = ("ep (composer-par)", CodeRange("CP", 801, 819, "expert parallelism"))
    core = [(CORE, r) for r in CORE_CODE_RANGES]
    entries = [("pp (composer-par)", Rule("CP612", Severity.ERROR, "in its own range")),
               ("pp (composer-par)", Rule("CP433", Severity.ERROR, "in the shared model area")),
               ("pp (composer-par)", Rule("CP805", Severity.ERROR, "in EP's range")),
               ("pp (composer-par)", Rule("CP150", Severity.ERROR, "in the core's own")),
               (CORE, Rule("CP640", Severity.ERROR, "the core in PP's range"))]
    problems = range_problems(entries, [*core, pp, ep])
    assert problems == [
        "CP805 (pp (composer-par)) lies outside its own ranges (CP6xx) and the shared ones",
        "CP150 (pp (composer-par)) lies outside its own ranges (CP6xx) and the shared ones",
        "CP640 (core) lies outside its own ranges (CP1xx, CP2xx, CP3xx, CP4xx, CP5xx, "
        "CP701-CP709, CP711-CP729, CP901-CP949, CP981-CP989) and the shared ones"]
    wide = ("x (acme)", CodeRange("CP", 815, 825, "too wide"))
    assert range_problems([], [*core, pp, ep, wide]) == [
        "CP801-CP819 (ep (composer-par)) overlaps CP815-CP825 (x (acme))"]


def test_a_plugin_declares_its_ranges_on_its_class() -> None:
    class Acme(Plugin):
        name: ClassVar[str] = "acme"
        rules: ClassVar[tuple[Rule, ...]] = (Rule("ACME101", Severity.ERROR, "a rule"),)
        code_ranges: ClassVar[tuple[CodeRange, ...]] = (CodeRange("ACME", 101, 199, "acme"),)

    (acme_range,) = Acme.code_ranges
    assert "ACME101" in acme_range and "ACME200" not in acme_range
    assert "CP101" not in acme_range and "ACME1" not in acme_range
    assert range_problems([("acme", r) for r in Acme.rules], [("acme", acme_range)]) == []
    assert Plugin.code_ranges == ()


def test_range_text_and_bounds() -> None:
    assert str(CodeRange("CP", 401, 499, "model")) == "CP4xx"
    assert str(CodeRange("CP", 801, 819, "ep")) == "CP801-CP819"
    assert CodeRange("CP", 801, 819, "ep").overlaps(CodeRange("CP", 819, 830, "x"))
    assert not CodeRange("CP", 801, 819, "ep").overlaps(CodeRange("CPC", 801, 819, "x"))
    with pytest.raises(ValueError, match="last"):
        CodeRange("CP", 819, 801, "backwards")
    with pytest.raises(ValueError):
        CodeRange("cp", 101, 199, "lower-case prefix")


def test_the_docs_table_is_the_data() -> None:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("| codes | look at | from |")
    table = text[start:text.index("\n\n", start)].splitlines()[2:]
    rows = [tuple(cell.strip() for cell in row.strip("|").split("|")) for row in table]
    expected = []
    for source, found in sorted(code_ranges(), key=lambda e: (e[1].prefix, e[1].first)):
        where = sources_text([source]).replace(" (composer-par)", "")
        expected.append((f"`{found}`", found.about,
                         f"{where} and any plugin" if found.shared else where))
    assert rows == expected
    # every range's section heading in the docs starts with its codes
    headings = re.findall(r"^## (CP\S+):", text, flags=re.MULTILINE)
    assert {"CP1xx", "CP6xx", "CP801-CP819", "CP971-CP979"} <= set(headings)
