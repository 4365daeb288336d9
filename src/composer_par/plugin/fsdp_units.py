"""The FSDP units a model asks for beside its blocks: a Hugging Face model's own FSDP plan
read, and a unit of small parameters joined with a neighbour.

transformers 5.x gives each model an FSDP plan (``_fsdp_plan``: ``model.layers.*``,
``model.embed_tokens``, ``model.norm``, ``lm_head``), each entry a module ``fully_shard``
groups and its style: ``free_full_weight`` (resharded after forward, gathered again for
backward) or ``keep_full_weight`` (kept gathered from forward to backward).
:func:`own_units` reads it as units beside the blocks.

Every unit costs one all-gather in forward, another in backward when it is resharded,
and one reduce-scatter (one all-reduce more per replicate dim) per step, however few
parameters it holds. A unit whose parameters are all small (none with more than one
tensor dim: a norm's weight, biases) pays that latency for almost no bytes, so
:func:`join_small_units` puts it with a neighbour: the unit next to it in module order
(no block between them), which then holds both and keeps the neighbour's style (the
small unit's own style changes a few bytes of memory, the neighbour's decides the
collectives); else, when the root holds parameters of its own, the root's unit (kept
gathered from forward to backward by torch's default). transformers joins its final
norm with the output head the same way (both kept whole: one unit). Units join only
when their parameters have one dtype, one ``requires_grad`` and one device mesh, as
``fully_shard`` needs of one group.

Names are clean module paths (:func:`composer_par.blocks.clean_name`); nothing here
imports torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.blocks import clean_name
from composer_par.ties import tied_outside

if TYPE_CHECKING:
    from composer_par.blocks import Block

#: transformers' FSDP styles -> whether the unit reshards after forward.
FSDP_STYLES = {"free_full_weight": True, "keep_full_weight": False}
#: What a unit joined when it joined the root's unit (its modules are left to the root).
ROOT = "root"

__all__ = ["FSDP_STYLES", "JoinedUnit", "OwnUnit", "join_small_units", "own_units",
           "small_remainder"]


@attrs.frozen
class OwnUnit:
    """A unit of the model's own FSDP plan: its entry (entries joined by `` + ``), the
    modules it shards together (clean names, and the names to look them up by) and its
    style."""

    key: str
    paths: tuple[str, ...]
    raw: tuple[str, ...]
    style: str


@attrs.frozen
class JoinedUnit:
    """A unit of small parameters that joined a neighbour: its key, the key of the unit
    it joined (:data:`ROOT` for the root's), and how many parameters (elements) it
    holds."""

    key: str
    into: str
    numel: int

    def describe(self) -> str:
        where = "the root's unit" if self.into == ROOT else self.into
        return f"{self.key} ({self.numel} small parameter(s)) with {where}"


def _plan_pattern(key: str) -> Any:
    # transformers numbers layers with "*": one path component.
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*)", key)))


def own_units(model: Any, blocks: list[Block]) -> tuple[list[OwnUnit], list[tuple[str, str]]]:
    """The model's own FSDP plan (a Hugging Face model's ``_fsdp_plan``) as units beside
    ``blocks``: ``(units, [(entry, why it is left to its parent's unit)])``. Entries that
    match no module are dropped (transformers' default plan names ``embed_tokens`` and
    ``layers.*`` under every base model, whatever its modules are called), and so are
    those that are the blocks. Each entry is a unit of its own here; see
    :func:`join_small_units`."""
    plan = getattr(model, "_fsdp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return [], []
    named = {clean_name(n): n for n, _ in model.named_modules() if n}
    block_paths = {p for p, _ in blocks}
    units: list[OwnUnit] = []
    left: list[tuple[str, str]] = []
    for entry, style in plan.items():
        keys = tuple(entry) if isinstance(entry, (tuple, list)) else (str(entry),)
        patterns = [_plan_pattern(k) for k in keys]
        paths = tuple(n for n in named if any(p.fullmatch(n) for p in patterns))
        label = " + ".join(keys)
        if not paths or set(paths) <= block_paths:
            continue
        if style not in FSDP_STYLES:
            left.append((label, f"its style {style!r} is none of {sorted(FSDP_STYLES)}"))
            continue
        overlap = next((p for p in paths for b in block_paths
                        if p == b or p.startswith(b + ".") or b.startswith(p + ".")), None)
        if overlap is not None:
            left.append((label, f"{overlap} overlaps the blocks"))
            continue
        # A tie inside the unit is fine; one with a module outside it would put one
        # parameter in two units.
        ties = [(a, b) for path in paths
                for _, a, b in tied_outside(model, [(path, model.get_submodule(named[path]))])
                if not any(b.startswith(q + ".") for q in paths)]
        if ties:
            left.append((label, f"{ties[0][0]} is tied to {ties[0][1]} outside it"))
            continue
        units.append(OwnUnit(label, paths, tuple(named[p] for p in paths), str(style)))
    return units, left


def _params(model: Any, raw: tuple[str, ...]) -> list[Any]:
    seen: dict[int, Any] = {}
    for name in raw:
        for param in model.get_submodule(name).parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def _small(params: list[Any]) -> bool:
    return bool(params) and all(p.dim() <= 1 for p in params)


def _kind(params: list[Any]) -> set[tuple[Any, bool, Any]]:
    """What ``fully_shard`` needs to be one of a group: dtype, requires_grad, mesh."""
    return {(p.dtype, p.requires_grad, getattr(p, "device_mesh", None)) for p in params}


def join_small_units(model: Any, blocks: list[Block], units: list[OwnUnit]
                     ) -> tuple[list[OwnUnit], list[JoinedUnit]]:
    """``units`` with each unit of small parameters joined with a neighbour (see the
    module's docstring), in module order, and what joined what. A unit joined with the
    root's is dropped from the list: its modules stay in the root's unit."""
    if not units:
        return [], []
    order: dict[str, int] = {}
    for index, (name, _) in enumerate(model.named_modules()):
        order.setdefault(clean_name(name), index)
    block_at = sorted(order[clean_name(p)] for p, _ in blocks if clean_name(p) in order)

    def at(unit: OwnUnit) -> int:
        return min(order.get(p, len(order)) for p in unit.paths)

    rows = sorted(units, key=at)
    params = {u.key: _params(model, u.raw) for u in rows}
    joined: list[JoinedUnit] = []
    # The root's own parameters: those of no block and no unit.
    taken = {id(p) for ps in params.values() for p in ps}
    for _, block in blocks:
        if block is not None:
            taken.update(id(p) for p in block.parameters())
    root = [p for p in model.parameters() if id(p) not in taken]
    i = 0
    while i < len(rows):
        unit = rows[i]
        mine = params[unit.key]
        if not _small(mine):
            i += 1
            continue
        lo, hi = at(unit), at(unit)
        near = []
        for j in (i + 1, i - 1):  # the next first: a final norm feeds the head after it
            if 0 <= j < len(rows):
                other = at(rows[j])
                a, b = min(lo, other), max(hi, other)
                if not any(a < x < b for x in block_at) and \
                        len(_kind(mine + params[rows[j].key])) == 1:
                    near.append(j)
        # A large neighbour of the same style first, then any large one, then a small one.
        near.sort(key=lambda j: (_small(params[rows[j].key]),
                                 rows[j].style != unit.style))
        if near:
            j = near[0]
            other_unit = rows[j]
            first, second = (unit, other_unit) if j > i else (other_unit, unit)
            style = (other_unit.style if not _small(params[other_unit.key])
                     or other_unit.style == unit.style else "keep_full_weight")
            merged = OwnUnit(f"{first.key} + {second.key}", first.paths + second.paths,
                             first.raw + second.raw, style)
            joined.append(JoinedUnit(unit.key, other_unit.key, sum(p.numel() for p in mine)))
            params[merged.key] = params[first.key] + params[second.key]
            rows[min(i, j)] = merged
            del rows[max(i, j)]
            i = min(i, j)  # the merged unit may be small still
            continue
        if root and len(_kind(mine + root)) == 1:
            joined.append(JoinedUnit(unit.key, ROOT, sum(p.numel() for p in mine)))
            root.extend(mine)
            del rows[i]
            continue
        i += 1
    return rows, joined


def small_remainder(model: Any, held: list[Any]) -> list[tuple[str, int]]:
    """The modules holding the root's own parameters (those of none of the ``held``
    modules: blocks and units) with how many elements each holds there, when every one of
    those parameters is small; else (or with none) ``[]``. The root's unit then costs its
    collectives for a few bytes alone."""
    taken = {id(p) for module in held if module is not None for p in module.parameters()}
    rest: dict[str, int] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in taken or id(param) in seen:
            continue
        seen.add(id(param))
        if param.dim() > 1:
            return []
        path = clean_name(name).rpartition(".")[0]
        rest[path] = rest.get(path, 0) + param.numel()
    return sorted(rest.items())
