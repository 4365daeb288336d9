"""Meta-tests: every rule code is documented and tested; every hook is documented and tested.

"Tested" means named in a test file under tests/ other than this one: a rule code in an
assertion about a report, a hook name in a plugin a test uses. This file only looks.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from composer_par.findings import RULES
from composer_par.plugin import PROJECT, hookspecs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "rules.md"
TESTS = Path(__file__).resolve().parent


def _test_sources() -> dict[str, str]:
    return {
        path.name: path.read_text(encoding="utf-8")
        for path in sorted(TESTS.glob("*.py"))
        if path.name != Path(__file__).name
    }


def _doc_sections() -> dict[str, tuple[str, str]]:
    """code -> (heading title, section text) for every ``### CPxxx: title`` in the docs."""
    text = DOCS.read_text(encoding="utf-8")
    parts = re.split(r"^### (CP\d{3}): (.+)$", text, flags=re.MULTILINE)
    sections: dict[str, tuple[str, str]] = {}
    for code, title, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        body = re.split(r"^## ", body, flags=re.MULTILINE)[0]  # stop at the next group
        assert code not in sections, f"{code} is documented twice"
        sections[code] = (title.strip(), body)
    return sections


def _hooks() -> dict[str, object]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{PROJECT}_spec")
    }


# -- rule codes --------------------------------------------------------------------------------


def test_docs_cover_exactly_the_catalog() -> None:
    documented = set(_doc_sections())
    assert documented - set(RULES) == set(), "docs/rules.md documents codes RULES lacks"
    assert set(RULES) - documented == set(), "codes missing from docs/rules.md"


@pytest.mark.parametrize("code", sorted(RULES))
def test_rule_is_documented_with_severity_example_and_fix(code: str) -> None:
    sections = _doc_sections()
    assert code in sections, f"docs/rules.md has no '### {code}: ...' section"
    rule = RULES[code]
    title, body = sections[code]
    assert title == rule.title, f"{code}: heading says {title!r}, the catalog {rule.title!r}"
    severity = re.search(r"\*\*Severity:\*\*\s*(\w+)", body)
    assert severity and severity.group(1) == rule.severity.value, f"{code}: severity"
    meaning = re.search(r"\*\*Meaning:\*\*\s*(\S.*)", body)
    assert meaning, f"{code}: no **Meaning:**"
    example = body.find("**Example:**")
    assert example >= 0, f"{code}: no **Example:**"
    fix = body.find("**Fix:**")
    assert fix > example, f"{code}: no **Fix:** after the example"
    shown = body[example:fix]
    # The example shows the report it gives: a fenced block holding the finding's code.
    assert re.search(rf"```text\n\s*{rule.severity.value.upper()} {code}\b", shown), (
        f"{code}: the example does not show the report line"
    )
    assert body[fix + len("**Fix:**") :].strip(), f"{code}: empty fix"


def test_summary_table_matches_the_catalog() -> None:
    text = DOCS.read_text(encoding="utf-8")
    rows = dict(
        (m.group(1), (m.group(2), m.group(3)))
        for m in re.finditer(r"^\| (CP\d{3}) \| (\w+) \| (.+?) \|$", text, flags=re.MULTILINE)
    )
    assert rows == {c: (r.severity.value, r.title) for c, r in RULES.items()}


@pytest.mark.parametrize("code", sorted(RULES))
def test_rule_code_appears_in_a_test(code: str) -> None:
    where = [name for name, source in _test_sources().items() if code in source]
    assert where, f"no test file under tests/ mentions {code}"


# -- hooks -------------------------------------------------------------------------------------


def test_hookspecs_module_has_hooks() -> None:
    hooks = _hooks()
    assert len(hooks) >= 13
    stage_hooks = {
        "composer_par_convert", "composer_par_tensor_parallel",
        "composer_par_activation_checkpoint", "composer_par_compile",
        "composer_par_data_parallel", "composer_par_materialize", "composer_par_finalize",
    }
    assert stage_hooks <= set(hooks)


@pytest.mark.parametrize("hook", sorted(_hooks()))
def test_hook_has_a_docstring(hook: str) -> None:
    doc = inspect.getdoc(_hooks()[hook])
    assert doc and len(doc) >= 30, f"{hook} needs a docstring saying when it is called"


UNTESTED_HOOKS = sorted(
    hook for hook in _hooks() if not any(hook in s for s in _test_sources().values())
)


@pytest.mark.xfail(
    condition=bool(UNTESTED_HOOKS),
    reason=f"hooks no test file under tests/ names yet: {', '.join(UNTESTED_HOOKS)}",
    strict=False,
)
def test_every_hook_is_named_in_a_test() -> None:
    assert UNTESTED_HOOKS == [], f"untested hooks: {UNTESTED_HOOKS}"
