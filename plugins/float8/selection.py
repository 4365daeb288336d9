"""Which ``nn.Linear`` layers the float8 plugin converts, and why each other one stays in
high precision: pure logic over the module tree (torch is imported inside)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import clean_name, path_matches

if TYPE_CHECKING:
    import torch.nn as nn

#: float8 matmuls need every dim of both operands divisible by 16 (the hardware's tile).
MULTIPLE = 16


@attrs.frozen
class Choice:
    """The layers to convert, and each left out with its reason."""

    converted: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...] = ()
    # Patterns of ``modules`` that name no Linear layer.
    unmatched: tuple[str, ...] = ()
    # Layers ``modules`` names whose dims float8 cannot take: (path, in, out).
    misfits: tuple[tuple[str, int, int], ...] = ()

    def summary(self, limit: int = 6) -> str:
        text = f"{len(self.converted)} Linear layer(s) to float8"
        if self.left_out:
            shown = "; ".join(f"{p} ({why})" for p, why in self.left_out[:limit])
            more = f"; +{len(self.left_out) - limit} more" if len(self.left_out) > limit else ""
            text += f"; left in high precision: {shown}{more}"
        return text


def linears(model: nn.Module) -> list[tuple[str, Any]]:
    """Every ``nn.Linear`` (float8 ones excluded) by clean path, in module order."""
    import torch.nn as nn

    from .torchao_api import is_float8_linear

    return [(clean_name(name), module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not is_float8_linear(module)]


def _inside(path: str, blocks: list[str]) -> bool:
    return any(path == b or path.startswith(b + ".") for b in blocks)


def ends(paths: list[str], blocks: list[str]) -> set[str]:
    """The model's first and last layers: the Linear layers outside its blocks (an input
    projection, the output head); with no blocks, the first and the last Linear."""
    if blocks:
        return {p for p in paths if not _inside(p, blocks)}
    return {paths[0], paths[-1]} if paths else set()


def _fits(module: Any) -> bool:
    return module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0


def choose(model: nn.Module, blocks: list[tuple[str, Any]], *,
           modules: tuple[str, ...] | None, skip: tuple[str, ...],
           convert_ends: bool) -> Choice:
    """The layers of ``model`` to convert: those ``modules`` names (globs, ``*`` one path
    component; None: every Linear), less those ``skip`` names, less, by default, the
    model's ends (:func:`ends`) and the layers whose dims are not multiples of 16."""
    found = linears(model)
    block_paths = [clean_name(p) for p, _ in blocks]
    edge = set() if convert_ends else ends([p for p, _ in found], block_paths)
    converted: list[str] = []
    left: list[tuple[str, str]] = []
    misfits: list[tuple[str, int, int]] = []
    named = {p for p, _ in found if modules is None
             or any(path_matches(pattern, p) for pattern in modules)}
    for path, module in found:
        if any(path_matches(pattern, path) for pattern in skip):
            left.append((path, "skipped by the skip option"))
        elif path not in named:
            left.append((path, "not named by the modules option"))
        elif not _fits(module):
            why = (f"in {module.in_features} x out {module.out_features}: not multiples of "
                   f"{MULTIPLE}")
            left.append((path, why))
            if modules is not None:
                misfits.append((path, module.in_features, module.out_features))
        elif modules is None and path in edge:
            left.append((path, "the model's first or last layer (convert_ends = false)"))
        else:
            converted.append(path)
    unmatched = tuple(p for p in modules or () if not any(path_matches(p, q) for q, _ in found))
    return Choice(tuple(converted), tuple(left), unmatched, tuple(misfits))


__all__ = ["MULTIPLE", "Choice", "choose", "ends", "linears"]
