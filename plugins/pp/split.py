"""Which modules each pipeline stage owns: the split, computed on the (meta) model.

A model is seen as an ordered list of *units*: the blocks, and the subtrees outside them
that own parameters or persistent buffers (the embedding before the blocks, the final
norm and output head after them). Subtrees outside the blocks that own neither (a rotary
table held as a non-persistent buffer, an activation) are *shared*: every stage keeps
them. Three ways to assign units to stages:

* ``"auto"``: the blocks in contiguous runs, one or more per stage, balanced by
  parameter count with the units before the first block counted on the first stage and
  those after the last block on the last (between two blocks: with the block before);
  with more stages than blocks, the units before the first block and those after the
  last are stages of their own;
* ``"pp_plan"``: the same, over the layer container a Hugging Face model names in its
  ``_pp_plan`` (``base_model_pp_plan`` of its config, under its base model prefix);
* explicit: a list of module paths per stage, covering every parameter once.

Nothing here imports torch at module level: the findings run in validation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import clean_name, names_near, tied_registrations

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin import Block


class SplitError(ValueError):
    """The split cannot be made; the message names the culprit (a CP6xx finding's text)."""

    def __init__(self, code: str, message: str, fix: str) -> None:
        super().__init__(message)
        self.code, self.fix = code, fix


@attrs.frozen
class StageSplit:
    """Module paths per stage (in model order), the shared paths, the parameters each
    stage holds, and the blocks each stage runs."""

    stages: tuple[tuple[str, ...], ...]
    shared: tuple[str, ...]
    params: tuple[int, ...]  # parameter count per stage (tied parameters counted once)
    blocks: tuple[tuple[str, ...], ...]  # block paths per stage

    def stage_of(self, path: str) -> int | None:
        for index, paths in enumerate(self.stages):
            if any(path == p or path.startswith(p + ".") for p in paths):
                return index
        return None


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module._modules.items() if m is not None]


def _owns_state(module: nn.Module) -> bool:
    """Parameters or persistent buffers anywhere in the subtree."""
    for sub in module.modules():
        if any(p is not None for p in sub._parameters.values()):
            return True
        if any(b is not None and n not in sub._non_persistent_buffers_set
               for n, b in sub._buffers.items()):
            return True
    return False


def _count(module: nn.Module, seen: set[int]) -> int:
    total = 0
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


@attrs.frozen
class _Units:
    """The model as units in module order: ``(path, kind)`` with kind "block" or "unit"."""

    order: tuple[tuple[str, str], ...]
    shared: tuple[str, ...]
    sizes: Mapping[str, int]


def _units(model: nn.Module, block_paths: Sequence[str]) -> _Units:
    blocks = set(block_paths)
    ancestors = {p.rsplit(".", i)[0] for p in blocks for i in range(1, p.count(".") + 1)}
    order: list[tuple[str, str]] = []
    shared: list[str] = []
    seen: set[int] = set()
    sizes: dict[str, int] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in _children(module):
            path = clean_name(f"{prefix}.{name}" if prefix else name)
            if not path:  # a wrapper component: its inner module stands in its place
                walk(child, prefix)
                continue
            if path in blocks:
                order.append((path, "block"))
                sizes[path] = _count(child, seen)
            elif path in ancestors:
                walk(child, path)
            elif _owns_state(child):
                order.append((path, "unit"))
                sizes[path] = _count(child, seen)
            else:
                shared.append(path)

    walk(model, "")
    return _Units(tuple(order), tuple(shared), sizes)


def units_after_blocks(model: nn.Module, block_paths: Sequence[str]) -> list[str]:
    """The units (subtrees owning parameters or persistent buffers) after the last block,
    in module order: the final norm and the output head of a language model."""
    order = _units(model, block_paths).order
    last = max((i for i, (_, kind) in enumerate(order) if kind == "block"), default=None)
    if last is None:
        return []
    return [path for path, kind in order[last + 1:] if kind == "unit"]


def root_parameters(model: nn.Module) -> list[str]:
    """Parameters registered on the root module itself: no stage can own them alone."""
    return [n for n, p in model._parameters.items() if p is not None]


def balanced(costs: Sequence[int], stages: int, first: int, last: int) -> list[int]:
    """How many of the contiguous ``costs`` go to each of ``stages`` stages (each at least
    one), minimizing the largest stage total, ``first`` added to the first stage and
    ``last`` to the last. Ties go to the split whose stages are the most even in count."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: (largest total, count spread) splitting costs[:j] into s + 1 stages.
    best: list[list[tuple[float, int]]] = [[(inf, 0)] * (n + 1) for _ in range(stages)]
    choice = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        extra = first + (last if stages == 1 else 0)
        best[0][j] = (prefix[j] + extra, 0)
    even = n / stages
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                extra = last if s == stages - 1 else 0
                prev = best[s - 1][i]
                worst = max(prev[0], prefix[j] - prefix[i] + extra)
                spread = prev[1] + round(abs((j - i) - even) * 1000)
                if (worst, spread) < best[s][j]:
                    best[s][j] = (worst, spread)
                    choice[s][j] = i
    counts: list[int] = []
    j = n
    for s in range(stages - 1, 0, -1):
        i = choice[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def pp_plan_paths(model: nn.Module) -> list[str]:
    """The module paths of a Hugging Face model's pipeline plan, relative to ``model``:
    the config's ``base_model_pp_plan`` (under ``base_model_prefix`` for a model with a
    head) and every module's own ``_pp_plan`` (under that module's path)."""
    import torch.nn as nn

    paths: list[str] = []
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    base = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if isinstance(base, Mapping):
        paths += [f"{prefix}.{key}" if has_base else key for key in base]
    for path, module in model.named_modules():
        own = getattr(module, "_pp_plan", None)
        if isinstance(own, Mapping):
            for key in own:
                full = f"{clean_name(path)}.{key}" if path else key
                if full not in paths:
                    paths.append(full)
    return paths


def _pp_plan_blocks(model: nn.Module) -> list[str]:
    import torch.nn as nn

    paths = pp_plan_paths(model)
    if not paths:
        raise SplitError(
            "CP608", f"split = \"pp_plan\", but {type(model).__name__} has no Hugging Face "
            "pipeline plan (_pp_plan or config.base_model_pp_plan)",
            "use split = \"auto\", or list the module paths of each stage")
    modules = dict(model.named_modules())
    containers = [p for p in paths
                  if isinstance(modules.get(p), (nn.ModuleList, nn.ModuleDict, nn.Sequential))]
    if len(containers) != 1:
        raise SplitError(
            "CP608", f"the pipeline plan of {type(model).__name__} names "
            f"{len(containers)} layer containers ({containers}) among {paths}: the split "
            "needs exactly one (its children are the blocks)",
            "use split = \"auto\", or list the module paths of each stage")
    return [f"{containers[0]}.{name}" for name, child in _children(modules[containers[0]])]


def compute_split(model: nn.Module, blocks: Sequence[Block], split: Any,
                  num_stages: int) -> StageSplit:
    """The split of ``model`` into ``num_stages`` stages; raises :class:`SplitError`."""
    roots = root_parameters(model)
    if roots:
        raise SplitError(
            "CP610", f"{type(model).__name__} registers parameters on its root module "
            f"({', '.join(roots)}): a pipeline stage owns submodules, so no stage can hold "
            "them alone",
            "move them into a submodule (e.g. an nn.Module holding the parameter), which a "
            "stage then owns")
    if isinstance(split, str):
        block_paths = (_pp_plan_blocks(model) if split == "pp_plan"
                       else [clean_name(p) for p, _ in blocks])
        return _balanced_split(model, block_paths, num_stages, split)
    return _explicit_split(model, [clean_name(p) for p, _ in blocks], split, num_stages)


def _balanced_split(model: nn.Module, block_paths: list[str], num_stages: int,
                    how: str) -> StageSplit:
    units = _units(model, block_paths)
    # Units between blocks travel with the block before them.
    lead: list[str] = []
    groups: list[list[str]] = []
    trail: list[str] = []
    for path, kind in units.order:
        if kind == "block":
            groups.append([path])
        elif not groups:
            lead.append(path)
        else:
            groups[-1].append(path)
    # Units after the last block are the last stage's, not the last block's.
    while groups and len(groups[-1]) > 1:
        trail.insert(0, groups[-1].pop())
    ends = [part for part in (lead, trail) if part]
    if len(groups) + len(ends) < num_stages:
        where = "the pipeline plan's layer container" if how == "pp_plan" else "the model"
        most = len(groups) + len(ends)
        raise SplitError(
            "CP602", f"{num_stages} pipeline stages need a block each, or the parts before "
            f"the first block or after the last, and {where} has {len(groups)} block(s) "
            f"and {len(ends)} such part(s)",
            f"use at most {most} stages (pp size x stages_per_rank), or split a model with "
            "more blocks")
    # More stages than blocks: the parts before the first block (the embedding) and
    # after the last (the final norm and output head) become stages of their own, as in
    # the Llama 3 405B pipeline, whose first and last stages ran only those.
    alone = len(groups) < num_stages
    if alone:
        groups = ([lead] if lead else []) + groups + ([trail] if trail else [])
    costs = [sum(units.sizes[p] for p in g) for g in groups]
    first = 0 if alone else sum(units.sizes[p] for p in lead)
    last = 0 if alone else sum(units.sizes[p] for p in trail)
    counts = balanced(costs, num_stages, first, last)
    block_set = set(block_paths)
    stages: list[list[str]] = []
    blocks: list[list[str]] = []
    start = 0
    for count in counts:
        chunk = groups[start:start + count]
        start += count
        stages.append([p for g in chunk for p in g])
        blocks.append([g[0] for g in chunk if g[0] in block_set])
    if not alone:
        stages[0][:0] = lead
        stages[-1].extend(trail)
    params = [sum(units.sizes[p] for p in s) for s in stages]
    return StageSplit(tuple(map(tuple, stages)), units.shared, tuple(params),
                      tuple(map(tuple, blocks)))


def _explicit_split(model: nn.Module, block_paths: list[str], split: Sequence[Sequence[str]],
                    num_stages: int) -> StageSplit:
    if len(split) != num_stages:
        raise SplitError(
            "CP608", f"split lists {len(split)} stage(s) of module paths, and the plan runs "
            f"{num_stages} pipeline stages (pp size x stages_per_rank)",
            f"give {num_stages} lists of module paths, one per stage")
    modules = {clean_name(n): m for n, m in model.named_modules() if clean_name(n)}
    owner: dict[str, int] = {}
    for index, paths in enumerate(split):
        for path in paths:
            if path not in modules:
                near = names_near(model, path)
                raise SplitError(
                    "CP608", f"split stage {index} names {path!r}, which is no module of "
                    f"{type(model).__name__}" + (f"; nearest: {', '.join(near)}" if near else ""),
                    "name modules by their paths in model.named_modules()")
            for other, at in owner.items():
                if path == other or path.startswith(other + ".") or other.startswith(path + "."):
                    raise SplitError(
                        "CP608", f"split stage {index} names {path!r} and stage {at} names "
                        f"{other!r}: one module in two stages",
                        "give each module to one stage")
            owner[path] = index

    def stage_of(path: str) -> int | None:
        for p, index in owner.items():
            if path == p or path.startswith(p + "."):
                return index
        return None

    for block in block_paths:
        inside = [p for p in owner if p.startswith(block + ".")]
        if inside:
            raise SplitError(
                "CP608", f"split names {inside[0]!r}, inside block {block!r}: a block runs "
                "whole on one stage",
                f"name {block!r} itself in one stage")
    seen: set[int] = set()
    uncovered = []
    counts = [0] * num_stages
    for path, module in modules.items():
        for pname, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            owning = stage_of(path)
            if owning is None:
                uncovered.append(f"{path}.{pname}")
            else:
                counts[owning] += param.numel()
        for bname, buf in module._buffers.items():
            persistent = bname not in module._non_persistent_buffers_set
            if buf is not None and persistent and stage_of(path) is None:
                uncovered.append(f"{path}.{bname}")
    if uncovered:
        shown = ", ".join(uncovered[:4]) + (f" and {len(uncovered) - 4} more"
                                            if len(uncovered) > 4 else "")
        raise SplitError(
            "CP608", f"split gives no stage the parameters or buffers {shown}",
            "name the modules that own them in one stage's list")
    blocks = [[b for b in block_paths if stage_of(b) == s] for s in range(num_stages)]
    order = list(modules)
    stages = [sorted(paths, key=order.index) for paths in split]
    covered = set(owner)
    shared = [p for p, _ in _children_paths(model)
              if stage_of(p) is None and not any(c.startswith(p + ".") for c in covered)]
    return StageSplit(tuple(map(tuple, stages)), tuple(shared), tuple(counts),
                      tuple(map(tuple, blocks)))


def _children_paths(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-most subtrees that own no state and hold no named module: kept everywhere."""
    out: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in _children(module):
            path = clean_name(f"{prefix}.{name}" if prefix else name)
            if _owns_state(child):
                walk(child, path)
            else:
                out.append((path, child))

    walk(model, "")
    return out


def tied_across(model: nn.Module, split: StageSplit) -> list[tuple[str, str, int, int]]:
    """Parameters registered under two names that the split puts on different stages:
    ``(name, other name, its stage, the other's stage)``."""
    def stage(name: str) -> int | None:
        module = name.rpartition(".")[0]
        return split.stage_of(module) if module else None

    out = []
    for (first, _, _), *others in tied_registrations(model, every_path=True):
        at = stage(first)
        for name, _, _ in others:
            there = stage(name)
            if there != at:
                out.append((first, name, at if at is not None else -1,
                            there if there is not None else -1))
    return out


__all__ = ["SplitError", "StageSplit", "balanced", "compute_split", "pp_plan_paths",
           "root_parameters", "tied_across", "units_after_blocks"]
