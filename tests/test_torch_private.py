"""Every private torch symbol composer_par touches is in composer_par.plugin.torch_private's
catalog, is reached only through that module, and exists on the installed torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from composer_par.plugin import torch_private
from composer_par.plugin.torch_private import (
    CHECKED_TORCH,
    SYMBOLS,
    UNCHECKED_ENV,
    PrivateSymbolError,
    UncheckedTorchError,
    check_torch,
    torch_release,
)
from composer_par.testing.distributed import run_ranks
from tests import torch_private_workers

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "src", ROOT / "plugins", ROOT / "contrib" / "composer-par-compress" / "src"]
HOME = ROOT / "src" / "composer_par" / "plugin" / "torch_private.py"

# Private attributes of other libraries, read by the integrations that wrap them and
# exercised by their tests on every installed version: accelerate's Accelerator
# (_models, _optimizers, ...), Lightning's strategies; and os._exit.
OTHER_LIBRARIES = {"_custom_objects", "_dataloaders", "_models", "_optimizers",
                   "_prepare_one", "_schedulers", "_set_size", "_setup_distributed", "_exit"}
# nn.Module's own registries: every module surgery in torch writes them directly too.
DIRECT = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            for root in SOURCES for path in sorted(root.rglob("*.py"))]


def _private_torch_imports(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names = [a.name for a in node.names if a.name.startswith("_")]
            if "._" in (node.module or "") or (node.module or "").startswith("torch._") or names:
                found.append((node.lineno, f"{node.module}: {names}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.startswith("torch") and "._" in a.name]
    return found


def test_no_module_but_torch_private_imports_a_private_torch_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {what}"
             for path, tree in _trees() if path != HOME
             for line, what in _private_torch_imports(tree)]
    assert not found, "reach these through composer_par.plugin.torch_private:\n" + "\n".join(
        found)


def test_every_private_attribute_read_outside_the_module_is_ours_or_listed() -> None:
    """A ``x._name`` anywhere but torch_private is one of composer_par's own (assigned or
    defined somewhere in the sources), nn.Module's registries, or another library's."""
    ours: set[str] = set()
    reads: dict[str, list[str]] = {}
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.alias):
                ours.add(node.asname or node.name.rpartition(".")[2])
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                if isinstance(node.ctx, ast.Store):
                    ours.add(node.attr)
                elif path != HOME:
                    reads.setdefault(node.attr, []).append(
                        f"{path.relative_to(ROOT)}:{node.lineno}")
    unknown = {name: where for name, where in reads.items()
               if name not in ours | OTHER_LIBRARIES | DIRECT}
    assert not unknown, (
        "private attributes read outside composer_par.plugin.torch_private that nothing in "
        f"composer_par defines: {unknown}; if they are torch's, catalog them there")


def test_the_catalog_names_each_symbol_once_and_says_why() -> None:
    names = [s.symbol for s in SYMBOLS]
    assert len(names) == len(set(names))
    assert all(s.why and s.area for s in SYMBOLS)
    direct = {s.symbol.rpartition(".")[2] for s in SYMBOLS if s.area == "module and tensor "
              "internals" and "accessed directly" in s.why}
    assert direct == DIRECT


@pytest.mark.parametrize("symbol", [s.symbol for s in SYMBOLS if s.importable])
def test_every_importable_symbol_exists_on_this_torch(symbol: str) -> None:
    if symbol.startswith("torchft."):  # the ft extra's: present wherever it is installed
        pytest.importorskip("torchft")
    torch_private._reach(symbol)


@pytest.mark.distributed
def test_every_attribute_symbol_exists_on_the_objects_torch_makes() -> None:
    results = run_ranks(torch_private_workers.live_attributes, 2, timeout=240)
    attributes = [s.symbol for s in SYMBOLS if not s.importable]
    for found in results:
        assert set(found) == set(attributes)
        missing = [name for name, present in found.items() if not present]
        assert not missing, f"torch {torch.__version__} lacks {missing}"


@pytest.mark.distributed
def test_the_accessors_read_what_torch_holds() -> None:
    results = run_ranks(torch_private_workers.accessors, 2, timeout=240)
    for rank, result in enumerate(results):
        # Linear(4, 3) over 2 shards: weight rows 2 + 1 (padded to 2), bias 2 + 1.
        assert result["layout"] == [("weight", 8, (2 - rank, 4), (4, 1)),
                                    ("bias", 2, (2 - rank,), (1,))]
        assert result["reduce_scatters"] is True
        assert result["divide_factor"] is None
        assert result["replicated"] is True and result["sharded_replicated"] is False
        assert result["local"] == [[4.0 * rank, 4.0 * rank + 1], [4.0 * rank + 2,
                                                                   4.0 * rank + 3]]
        assert result["offset"] == ((2, 2), (2 * rank, 0))
        assert result["flat"] == (("a_b",), 2)
        assert result["joined"] == ("b", "a_b")
        assert result["timeout"] == 7.0
        assert result["default_store"] is True


def test_a_missing_symbol_names_itself_and_what_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.tensor import placement_types

    monkeypatch.delattr(placement_types, "_StridedShard")
    with pytest.raises(PrivateSymbolError, match=r"has no torch\.distributed\.tensor\."
                       r"placement_types\._StridedShard \(composer_par needs it for: FSDP2 "
                       "over TP's split"):
        torch_private.strided_shard()


def test_installed_torch_is_a_checked_release() -> None:
    # Fails loudly on a torch upgrade: run the suite on the new torch, read its changes to
    # the symbols in torch_private.SYMBOLS, then add the release to CHECKED_TORCH.
    assert torch_release(torch.__version__) in CHECKED_TORCH, (
        f"torch {torch.__version__} is not in CHECKED_TORCH {CHECKED_TORCH}")
    check_torch()


@pytest.mark.parametrize("version", ["2.16.0", "3.0.0+cu130", "2.12.1"])
def test_an_unchecked_torch_is_refused_with_the_way_on(version: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    with pytest.raises(UncheckedTorchError, match=rf"torch_private.*{UNCHECKED_ENV}=1"):
        check_torch(version)


def test_the_environment_variable_turns_the_refusal_into_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    with pytest.warns(UserWarning, match="going on unchecked"):
        check_torch("2.16.0")


def test_release_parsing() -> None:
    assert torch_release("2.13.0+cpu") == (2, 13)
    assert torch_release("2.13.0a0+git1234") == (2, 13)
    assert torch_release("2.15.0+cu132") == (2, 15)
    assert torch_release("2.13") == (2, 13)


def _plan_findings(plan: object, model: object) -> list[object]:
    return [f for f in plan.validate(model, world_size=2).findings  # type: ignore[attr-defined]
            if f.code == "CP230"]


@pytest.mark.parametrize(("plan", "reads"), [
    ("fsdp2_factor", "gradient_divide_factor=1"),
    ("hsdp_alone_factor", "gradient_divide_factor=2"),
    ("fsdp2_plain", None),
])
def test_cp230_refuses_a_plan_reading_fsdp2_internals_on_an_unchecked_torch(
        plan: str, reads: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from composer_par import FSDP2, HSDP, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.tasks import llama

    plans = {
        "fsdp2_factor": ParallelPlan(MeshSpec(dp_shard=2)).use(
            FSDP2(gradient_divide_factor=1.0)),
        "hsdp_alone_factor": ParallelPlan(MeshSpec(dp_replicate=2)).use(
            HSDP(gradient_divide_factor=2.0)),
        "fsdp2_plain": ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()),
    }
    with torch.device("meta"):
        model = llama.build()
    chosen = plans[plan].use(MetaInit())
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    assert _plan_findings(chosen, model) == []  # the installed torch is a checked one
    monkeypatch.setattr(torch_private, "CHECKED_TORCH", ((2, 12),))
    found = _plan_findings(chosen, model)
    if reads is None:
        assert found == []
        return
    [finding] = found
    assert finding.severity.value == "error"  # type: ignore[attr-defined]
    assert reads in finding.message and torch.__version__ in finding.message  # type: ignore[attr-defined]
    assert "COMPOSER_PAR_UNCHECKED_TORCH=1" in finding.fix  # type: ignore[attr-defined]
    monkeypatch.setenv(UNCHECKED_ENV, "1")
    assert _plan_findings(chosen, model) == []
