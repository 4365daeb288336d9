"""Meta-tests: every rule code of every installed plugin is documented and tested; every
hook is documented and tested.

The codes are those of ``composer_par.rules.catalogs()``: the core's and the catalog of
every installed plugin (the built-ins, the contrib compress plugin, any other installed).
"Tested" means named by a test that asserts: a code or hook name (a string, a name, an
attribute, a method implementing the hook) inside a test function (or a worker function)
that asserts or expects an exception, or inside a module-level helper, class or constant
such a function uses. Test files are those under tests/ and the contrib plugin's tests/,
this one excepted. This file only looks.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from composer_par.findings import CORE_RULES, RULES, Rule
from composer_par.plugin import hookspecs
from composer_par.plugin.base import PROJECT
from composer_par.plugin.registry import Registry
from composer_par.rules import catalogs, listing, rule_conflicts, sources_text

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "rules.md"
TEST_DIRS = (ROOT / "tests", ROOT / "contrib" / "composer-par-compress" / "tests")
CODE = r"[A-Z]+\d{3}"


@cache
def _entries() -> tuple[tuple[str, Rule], ...]:
    return tuple(catalogs())


@cache
def _rows() -> dict[str, tuple[Rule, str]]:
    """code -> (rule, where it comes from as docs/rules.md shows it)."""
    return {rule.code: (rule, sources_text(sources).replace(" (composer-par)", ""))
            for rule, sources in listing(_entries())}


def _test_files() -> list[Path]:
    return [path for directory in TEST_DIRS for path in sorted(directory.glob("*.py"))
            if path.resolve() != Path(__file__).resolve()]


def _doc_sections() -> dict[str, tuple[str, str]]:
    """code -> (heading title, section text) for every ``### CODE: title`` in the docs."""
    text = DOCS.read_text(encoding="utf-8")
    parts = re.split(rf"^### ({CODE}): (.+)$", text, flags=re.MULTILINE)
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


# -- what the tests name, in code that asserts ----------------------------------------------


def _names_in(node: ast.AST) -> Iterator[str]:
    """Strings, names, attributes and defined names in ``node`` (string constants are
    also split into words, so a code inside a message or a TOML text counts)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value
            yield from re.findall(r"[A-Za-z_][A-Za-z_0-9]*", sub.value)
        elif isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield sub.name
        elif isinstance(sub, ast.keyword) and sub.arg:
            yield sub.arg


def _asserts(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and (
                sub.func.attr in ("raises", "warns", "fail")):
            return True
    return False


def _module_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level functions, classes and assigned names of a test module."""
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node
    return found


def _words_of(tree: ast.Module, *, workers: bool = False) -> frozenset[str]:
    """Every word named by the module's asserting functions (test functions, or in a
    worker module every function) and by what they use of the module: helpers, plugin
    classes, constants, followed transitively."""
    top = _module_level(tree)
    roots = [node for name, node in top.items()
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             and (name.startswith("test_") or workers) and _asserts(node)]
    roots += [item for node in top.values() if isinstance(node, ast.ClassDef)
              and node.name.startswith("Test") for item in node.body
              if isinstance(item, ast.FunctionDef) and _asserts(item)]
    words: set[str] = set()
    seen: set[int] = set()
    pending: list[ast.AST] = list(roots)
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for word in _names_in(node):
            words.add(word)
            if word in top and id(top[word]) not in seen:
                pending.append(top[word])
    return frozenset(words)


@cache
def _named_by_tests() -> dict[str, frozenset[str]]:
    """test file name -> :func:`_words_of` it."""
    return {path.name: _words_of(ast.parse(path.read_text(encoding="utf-8")),
                                 workers=path.name.endswith("_workers.py"))
            for path in _test_files()}


def _tests_naming(word: str) -> list[str]:
    return [name for name, words in _named_by_tests().items() if word in words]


# -- the catalogs --------------------------------------------------------------------------


def test_catalogs_hold_the_core_and_every_installed_plugin() -> None:
    entries = _entries()
    sources = {source for source, _ in entries}
    registry = Registry()
    for name in registry.names():
        cls = registry.get(name)
        if cls.rules:
            assert f"{name} ({registry.info(name).distribution})" in sources, name
    codes = {rule.code for _, rule in entries}
    assert set(CORE_RULES) <= codes
    # the built-ins' codes live with their plugins, not in the core's catalog
    owned = {"fsdp2": {"CP216", "CP230", "CP303", "CP304", "CP424", "CP425", "CP426",
                       "CP427", "CP428", "CP429", "CP430", "CP441"},
             "hsdp": {"CP230"},
             "compile": {"CP217", "CP221", "CP410", "CP411", "CP412", "CP413"},
             "activation_checkpoint": {"CP224", "CP411", "CP422", "CP423"},
             "meta_init": {"CP224", "CP404"},
             "tp": {"CP212", "CP213", "CP214", "CP406", "CP407", "CP408", "CP409", "CP420",
                    "CP421", "CP431", "CP432", "CP433"},
             "load_safetensors": {f"CP41{i}" for i in range(4, 10)},
             "load_checkpoint": {f"CP41{i}" for i in range(4, 10)},
             "ep": {"CP801", "CP802", "CP803", "CP804", "CP805", "CP806"}}
    for plugin, expected in owned.items():
        assert {r.code for r in registry.get(plugin).rules} == expected, plugin
        assert not expected & set(CORE_RULES), plugin
    # composer_par.RULES maps every code known
    assert codes <= set(RULES)


def test_installed_catalogs_agree() -> None:
    assert rule_conflicts(_entries()) == {}


@pytest.mark.parametrize("code", sorted(_rows()))
def test_every_rule_has_a_fix_and_an_example(code: str) -> None:
    rule, _ = _rows()[code]
    assert rule.title and rule.fix.strip() and rule.example.strip(), code


# -- docs/rules.md ------------------------------------------------------------------------


def test_docs_cover_exactly_the_catalogs() -> None:
    documented = set(_doc_sections())
    assert documented - set(_rows()) == set(), "docs/rules.md documents codes no catalog has"
    assert set(_rows()) - documented == set(), "codes missing from docs/rules.md"


@pytest.mark.parametrize("code", sorted(_rows()))
def test_rule_is_documented_with_severity_example_and_fix(code: str) -> None:
    sections = _doc_sections()
    assert code in sections, f"docs/rules.md has no '### {code}: ...' section"
    rule, source = _rows()[code]
    title, body = sections[code]
    assert title == rule.title, f"{code}: heading says {title!r}, the catalog {rule.title!r}"
    severity = re.search(r"\*\*Severity:\*\*\s*(\w+)", body)
    assert severity and severity.group(1) == rule.severity.value, f"{code}: severity"
    origin = re.search(r"\*\*From:\*\*\s*(.+)", body)
    assert origin and origin.group(1).strip() == source, f"{code}: From: should be {source}"
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


def test_summary_table_matches_the_catalogs() -> None:
    text = DOCS.read_text(encoding="utf-8")
    rows = {
        m.group(1): (m.group(2), m.group(3), m.group(4))
        for m in re.finditer(rf"^\| ({CODE}) \| (\w+) \| (.+?) \| (.+?) \|$", text,
                             flags=re.MULTILINE)
    }
    assert rows == {code: (rule.severity.value, rule.title, source)
                    for code, (rule, source) in _rows().items()}


# -- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(_rows()))
def test_rule_code_appears_in_a_test(code: str) -> None:
    assert _tests_naming(code), f"no asserting test names {code}"


# -- hooks ---------------------------------------------------------------------------------


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


def test_every_hook_is_named_in_a_test() -> None:
    untested = sorted(hook for hook in _hooks() if not _tests_naming(hook))
    assert untested == [], f"hooks no asserting test calls or implements: {untested}"


def test_the_meta_tests_see_only_asserting_code() -> None:
    """A name in a function that asserts nothing does not count; one in a helper, class or
    constant an asserting test uses does."""
    source = (
        "CASES = ['CP901']\n"
        "class Impl:\n"
        "    def composer_par_example_hook(self): ...\n"
        "def helper():\n"
        "    return 'CP902'\n"
        "def unused():\n"
        "    return 'CP904'\n"
        "def test_quiet():\n"
        "    print('CP903')\n"
        "def test_loud():\n"
        "    assert helper() and Impl() and CASES\n"
    )
    words = _words_of(ast.parse(source))
    assert {"CP901", "CP902", "composer_par_example_hook"} <= words
    assert not {"CP903", "CP904"} & words
    # in a worker module every asserting function counts
    assert "CP903" not in _words_of(ast.parse(source), workers=True)
    assert "CP905" in _words_of(ast.parse("def work():\n    assert 'CP905'\n"),
                                workers=True)
