"""The layouts suggest tries: each installed plugin's axes (``composer_par_suggest``), every
combination of their mesh dims' sizes that fills the world and divides the global batch,
and every choice each plugin makes at those sizes. No torch, no plugin named."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate import EstimateError, ModelShape, Workload
from composer_par.mesh import MeshSpec
from composer_par.plugin import SuggestAxis, SuggestChoice, SuggestContext
from composer_par.plugin.caller import HookCaller
from composer_par.topology import Topology

if TYPE_CHECKING:
    from composer_par.plugin.registry import Registry


@attrs.frozen
class Pick:
    """An axis of a candidate: its mesh dim's size and the plugin's choice there."""

    axis: SuggestAxis
    size: int
    choice: SuggestChoice

    @property
    def plugin(self) -> str:
        return self.axis.plugin

    @property
    def without(self) -> bool:
        """Whether the layout goes without this plugin here (its dim of size 1, not used)."""
        return not self.choice.used and self.size == 1


@attrs.frozen
class Candidate:
    """One layout: each axis's size and choice, in plan order, and the micro-batches each
    data shard runs per step."""

    picks: tuple[Pick, ...]
    passes: int

    def size(self, dim: str) -> int:
        return next((p.size for p in self.picks if p.axis.dim == dim), 1)

    def pick(self, plugin: str) -> Pick | None:
        return next((p for p in self.picks if p.plugin == plugin), None)

    @property
    def preference(self) -> int:
        """Among equally fast layouts, the lower is kept (less recomputation)."""
        return sum(p.choice.preference for p in self.picks)

    @property
    def runs_passes(self) -> bool:
        """Whether a plugin runs the micro-batches itself (the training step accumulates
        none)."""
        return any(p.choice.runs_passes for p in self.picks if p.choice.used)

    def label(self) -> str:
        return " + ".join(p.choice.label for p in self.picks
                          if p.choice.used and p.choice.label) or "one rank"

    def mesh(self) -> MeshSpec:
        """The mesh dims of the axes, outermost first: those of size > 1, and those of
        size 1 whose plugin runs (a sharding plugin over the dims folded into it)."""
        dims = [(p.axis.dim, p.size) for p in self.picks
                if p.axis.dim is not None and (p.size > 1 or p.choice.used)]
        return MeshSpec.from_pairs(dims or [("dp_shard", 1)])

    def plugins(self) -> list[tuple[str, dict[str, Any]]]:
        """(registry name, options) of every plugin the layout uses, in plan order."""
        return [(p.plugin, dict(p.choice.options or {})) for p in self.picks if p.choice.used]

    def key(self, skip: str | None = None) -> tuple[Any, ...]:
        """What identifies the layout (``skip``: but for that plugin's pick)."""
        return tuple((p.plugin, p.size, p.choice.label) for p in self.picks
                     if p.plugin != skip)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.label(), "mesh": self.mesh().to_dict(),
                "plugins": [{"name": n, **o} for n, o in self.plugins()],
                "passes": self.passes}


def plugin_axes(registry: Registry | None, options: Mapping[str, Mapping[str, Any]],
                model: ModelShape, topology: Topology, workload: Workload,
                notes: list[str]) -> list[SuggestAxis]:
    """Every installed plugin's axes, each plugin made with ``options[name]`` (else its
    defaults; a plugin that cannot be made so is left out, with a note); an opt-in axis
    only for a plugin ``options`` names."""
    from composer_par.plugin.registry import Registry

    reg = registry or Registry()
    made = []
    unknown = set(options) - set(reg.names())
    if unknown:
        raise EstimateError(f"--option names no installed plugin: {', '.join(sorted(unknown))}"
                            f" (installed: {', '.join(reg.names())})")
    for name in reg.names():
        cls: Any = reg.get(name)
        if not hasattr(cls, "composer_par_suggest"):
            continue  # a plugin suggest has nothing to try of
        try:
            made.append(cls(**dict(options.get(name, {}))))
        except Exception as exc:  # a plugin's own options check: named, not fatal
            if name in options:
                raise EstimateError(f"--option for {name}: {exc}") from None
            notes.append(f"{name}: not tried (it needs options: {exc})")
    caller = HookCaller(made)
    axes: list[SuggestAxis] = []
    for plugin, answer in caller.answers("composer_par_suggest", model=model,
                                          topology=topology, workload=workload):
        for axis in answer or ():
            if not isinstance(axis, SuggestAxis):
                raise EstimateError(f"plugin {plugin.name!r}: composer_par_suggest must return "
                                    f"SuggestAxis values; got {type(axis).__name__}")
            if axis.opt_in and axis.plugin not in options:
                notes.append(f"{axis.plugin}: not tried (it changes what training computes; "
                             f"--option {axis.plugin}.OPTION=VALUE to try it)")
                continue
            axes.append(axis)
    dims = [a.dim for a in axes if a.dim is not None]
    twice = {d for d in dims if dims.count(d) > 1}
    if twice:
        raise EstimateError(f"two plugins offer suggest the mesh dim(s) {', '.join(twice)}")
    return sorted(axes, key=lambda a: a.order)


def _sizes(axes: Sequence[SuggestAxis], world: int,
           max_sizes: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Every assignment of sizes to the axes' dims whose product is ``world``."""
    dim_axes = [a for a in axes if a.dim is not None]

    def assign(i: int, left: int, chosen: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(dim_axes):
            if left == 1:
                yield dict(chosen)
            return
        axis = dim_axes[i]
        assert axis.dim is not None
        for size in sorted(set(axis.sizes) | {1}):
            if left % size or size > max_sizes.get(axis.dim, size):
                continue
            chosen[axis.dim] = size
            yield from assign(i + 1, left // size, chosen)
        chosen.pop(axis.dim, None)

    yield from assign(0, world, {})


def families(axes: Sequence[SuggestAxis], topology: Topology, model: ModelShape,
             workload: Workload, global_batch: int,
             max_sizes: Mapping[str, int]) -> Iterator[list[Candidate]]:
    """The candidate layouts, in families: the layouts of one family differ only in the
    choices of the ``first_fit`` axes, from the fastest to the leanest (suggest keeps the
    first that fits)."""
    roles = {a.dim: a.role for a in axes if a.dim is not None and a.role is not None}
    folded = tuple(a.dim for a in axes if a.dim is not None and a.folded)
    marked = tuple(a.dim for a in axes if a.dim is not None and a.marked)
    for sizes in _sizes(axes, topology.world_size, max_sizes):
        shards = math.prod(sizes[a.dim] for a in axes if a.dim is not None and a.samples)
        if global_batch % (shards * workload.micro_batch):
            continue
        passes = global_batch // (shards * workload.micro_batch)
        ctx = SuggestContext(sizes, passes, topology, model, workload, roles, folded, marked)
        options: list[list[Pick]] = []
        for axis in axes:
            size = sizes.get(axis.dim, 1) if axis.dim is not None else 1
            picks = [Pick(axis, size, c) for c in axis.choices(ctx)]
            if not picks:
                break
            options.append(picks)
        else:
            firm = [i for i, a in enumerate(axes) if not a.first_fit]
            for chosen in _product([options[i] for i in firm]):
                by_index = dict(zip(firm, chosen, strict=True))
                family = []
                lean = [i for i, a in enumerate(axes) if a.first_fit]
                for tried in _product([options[i] for i in lean]):
                    by_index.update(zip(lean, tried, strict=True))
                    layout = tuple(by_index[i] for i in range(len(axes)))
                    if _compatible(layout):
                        family.append(Candidate(layout, passes))
                if family:
                    yield family


def _compatible(picks: Sequence[Pick]) -> bool:
    """Whether no pick's choice refuses a tag another's has (SuggestChoice.refuses)."""
    tags = frozenset().union(*(p.choice.tags for p in picks))
    return not any(p.choice.refuses & tags for p in picks)


def _product(lists: Sequence[Sequence[Pick]]) -> Iterator[tuple[Pick, ...]]:
    """The cartesian product, the first list's order outermost."""
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for rest in _product(lists[1:]):
            yield (head, *rest)


__all__ = ["Candidate", "Pick", "families", "plugin_axes"]
