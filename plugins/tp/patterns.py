"""Module-path patterns: globs matched component by component against a model's module
names (``*`` is one path component, as in ``parallelize_module``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from composer_par.plugin import modules_by_clean_name as modules_by_name
from composer_par.plugin import names_near as module_names_near
from composer_par.plugin import path_matches as matches

__all__ = ["generalize", "matches", "modules_by_name", "names_near", "parameters_by_name"]

if TYPE_CHECKING:
    import torch.nn as nn


def names_near(model: nn.Module, modules: Mapping[str, Any], pattern: str, n: int = 5) -> list[
    str
]:
    """Module names close to ``pattern`` (a glob: its stars are read as '0')."""
    import difflib

    close = module_names_near(model, pattern.replace("*", "0"), n=n)
    if not close:  # compare leaf names: a misspelled last component
        names = [m for m in modules if m]
        leaf = pattern.rsplit(".", 1)[-1]
        close = [m for m in names if difflib.get_close_matches(leaf, [m.rsplit(".", 1)[-1]],
                                                               cutoff=0.6)][:n]
    return close


def generalize(name: str) -> str:
    """``layers.3.attention.wq`` -> ``layers.*.attention.wq``: one entry per repeated unit."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def parameters_by_name(modules: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """Each module's own parameters by path (``model.layers.0.mlp.experts.gate_up_proj``)
    -> (owner module, attribute): plan entries may name parameters, as MoE plans do."""
    out: dict[str, tuple[Any, str]] = {}
    for name, module in modules.items():
        for attr, param in module._parameters.items():
            if param is not None:
                out.setdefault(f"{name}.{attr}" if name else attr, (module, attr))
    return out
