"""No privileges: the built-in plugins and the contrib plugin import composer_par only
through the author package, ``composer_par.plugin`` (its namespace, or an advanced
module its docstring names as such), and never another built-in plugin. Read from the
source with ``ast``, every import counts: at the top, inside functions, under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "plugins"  # installed as composer_par.plugins
CONTRIB = ROOT / "contrib" / "composer-par-compress" / "src"
# The modules composer_par.plugin's docstring names as advanced: imported on their own.
ADVANCED = ("composer_par.plugin.initialize", "composer_par.plugin.loader",
            "composer_par.plugin.fsdp_state", "composer_par.plugin.pipeline",
            "composer_par.plugin.torch_private")



def _sources() -> list[Path]:
    return sorted([*PLUGINS.rglob("*.py"), *CONTRIB.rglob("*.py")])


def _plugin_of(path: Path) -> str | None:
    """The built-in plugin a file belongs to: its module, or its package under plugins/;
    a module ``<plugin>_<job>.py`` beside a plugin module ``<plugin>.py`` is one of its
    jobs (fsdp2_estimate.py belongs to fsdp2)."""
    if not path.is_relative_to(PLUGINS):
        return None
    return _owner(path.relative_to(PLUGINS).parts[0].removesuffix(".py"))


def _owner(name: str) -> str:
    """The plugin a top-level name under plugins/ belongs to (see :func:`_plugin_of`)."""
    owner = name.split("_")[0]
    return owner if owner != name and (PLUGINS / f"{owner}.py").exists() else name


def _imports(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``source``, the text of ``path``;
    relative imports resolved."""
    tree = ast.parse(source, filename=str(path))
    if path.is_relative_to(PLUGINS):
        package = ["composer_par", "plugins", *path.relative_to(PLUGINS).parent.parts]
    else:
        package = list(path.relative_to(CONTRIB).parent.parts)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from composer_par import blocks` imports a module too
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names
                      if module in ("composer_par", "composer_par.plugins")]
    return found


def _problems(path: Path, source: str | None = None) -> list[str]:
    """What is wrong with the imports of ``path`` (or of ``source`` as if it were there)."""
    own = _plugin_of(path)
    text = path.read_text(encoding="utf-8") if source is None else source
    out = []
    for line, module in _imports(path, text):
        parts = module.split(".")
        if parts[0] != "composer_par" or module in ("composer_par", "composer_par.plugins"):
            continue  # the packages themselves: what is taken from them is checked
        where = f"{path.relative_to(ROOT)}:{line}: {module}"
        if module == "composer_par.plugin" or module.startswith(
                tuple(f"{name}." for name in ADVANCED)) or module in ADVANCED:
            continue
        if parts[:2] == ["composer_par", "plugin"]:
            out.append(f"{where}: imports a submodule of composer_par.plugin that is not "
                       "one of its advanced modules (take the name from composer_par.plugin)")
            continue
        if parts[:2] == ["composer_par", "plugins"] and len(parts) > 2:
            if _owner(parts[2]) != own:
                out.append(f"{where}: imports another built-in plugin")
            continue
        out.append(f"{where}: imports composer_par outside composer_par.plugin")
    return out


def test_the_files_are_found() -> None:
    names = {p.name for p in _sources()}
    assert {"fsdp2.py", "hsdp.py", "compile.py", "activation_checkpoint.py", "meta_init.py",
            "load_safetensors.py", "load_checkpoint.py", "plugin.py"} <= names
    assert any(p.parent.name == "tp" for p in _sources())


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_composer_par_only_through_the_author_package(path: Path) -> None:
    assert _problems(path) == []


def test_the_check_catches_each_kind_of_import() -> None:
    # sources checked as if they were plugins/tp/x.py and plugins/fsdp2.py (not written)
    in_tp = ["from composer_par.findings import Finding",
             "from composer_par import blocks",
             "from composer_par.plugins.fsdp2 import FSDP2",
             "import composer_par.mesh",
             "def f():\n    from composer_par.plugins.hsdp import HSDP",
             "from ..hsdp import HSDP"]
    in_fsdp2 = ["from composer_par.plugins.activation_checkpoint import MARK",
                "from composer_par.checkpoint import steps",
                "from composer_par.plugins import hsdp",
                "from composer_par.plugin.context import ApplyContext",
                "from composer_par.plugin.wrapping import CHECKPOINT_MARK"]
    fine = ["from composer_par.plugin import Finding",
            "from composer_par.plugin.initialize import post_order",
            "from .styles import STYLES", "from composer_par.plugins.tp import TP",
            "from . import TP", "import torch", "import attrs"]
    tp_file, fsdp2_file = PLUGINS / "tp" / "x.py", PLUGINS / "fsdp2.py"
    assert _problems(tp_file, "\n".join(fine) + "\n") == []
    for bad in in_tp:
        assert len(_problems(tp_file, bad + "\n")) == 1, bad
    for bad in in_fsdp2:
        assert len(_problems(fsdp2_file, bad + "\n")) == 1, bad
    # the loaders too: their base and what it reads are in the author package
    assert len(_problems(PLUGINS / "load_checkpoint.py",
                         "from composer_par.checkpoint import steps\n"
                         "from composer_par.plugins.load_safetensors import WeightsLoader\n")) == 2


def test_the_advanced_modules_are_the_ones_the_author_package_names() -> None:
    import composer_par.plugin as author

    doc = author.__doc__ or ""
    named = doc[doc.index("advanced modules"):]
    for module in ADVANCED:
        assert f":mod:`{module}`" in named, module


def test_every_export_of_the_author_package_is_used_by_a_plugin_or_the_docs() -> None:
    """An export nobody imports is surface a third party may come to rely on for nothing."""
    import composer_par.plugin as author

    sources = [*_sources(), *(ROOT / "docs").rglob("*.md")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in sources)
    unused = [name for name in author.__all__ if not re.search(rf"\b{name}\b", text)]
    assert unused == []
