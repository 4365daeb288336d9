"""What a plugin offers ``composer-par suggest``: the sizes its mesh dim may take and the
options it may run with (the ``composer_par_suggest`` hook). No torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin.base import Role

if TYPE_CHECKING:
    from composer_par.estimate import ModelShape, Workload
    from composer_par.topology import Topology


@attrs.frozen
class SuggestContext:
    """A candidate layout as far as suggest has chosen it: every axis's mesh dim size
    (``sizes``, 1 for a dim left out), and the micro-batches of ``micro_batch`` sequences
    each data shard runs per step (``passes``) to reach the global batch."""

    sizes: Mapping[str, int]
    passes: int
    topology: Topology
    model: ModelShape
    workload: Workload
    # the axes' mesh dims by what they do: their roles, and which data parallelism folds in
    roles: Mapping[str, Role] = attrs.field(factory=dict)
    folded: tuple[str, ...] = ()
    # the dims whose plugin marks every collective inside the blocks (SuggestAxis.marked)
    marked: tuple[str, ...] = ()

    def size(self, dim: str) -> int:
        return self.sizes.get(dim, 1)

    def tensor_parallel(self) -> int:
        """The ranks each split tensor (and the heads) is cut over: the model-parallel
        dims not folded into data parallelism."""
        return math.prod(n for d, n in self.sizes.items()
                         if self.roles.get(d) is Role.MODEL_PARALLEL and d not in self.folded)

    def folded_size(self) -> int:
        """The ranks of the dims data parallelism folds in."""
        return math.prod(self.sizes.get(d, 1) for d in self.folded)


@attrs.frozen
class SuggestChoice:
    """One way a plugin runs in a candidate layout.

    ``label``: how the layout names it ("TP 4", "CP 2 alltoall", "AC full"; empty when
    it adds nothing to say); ``options``: the plugin's options in plan-file form (None:
    the plugin is not used); ``preference``: among layouts equally fast, the lower is
    kept (less recomputation); ``runs_passes``: the plugin runs the data shard's
    micro-batches itself (a pipeline's microbatches, its options saying how many), so the
    training step accumulates none; ``tags``: what this way of running is, for other
    plugins' choices to refuse (a pipeline's :data:`SPLIT_BACKWARD`); ``refuses``: the tags
    it cannot run beside (validation would refuse the plan), so suggest never combines
    them."""

    label: str = ""
    options: Mapping[str, Any] | None = None
    preference: int = 0
    runs_passes: bool = False
    tags: frozenset[str] = frozenset()
    refuses: frozenset[str] = frozenset()

    @property
    def used(self) -> bool:
        return self.options is not None


@attrs.frozen
class SuggestAxis:
    """A plugin's axis of the layouts suggest tries.

    ``dim``: the mesh dim it claims (None: no dim, an option of the layout such as
    activation checkpointing's mode), with its ``role``; ``order``: where its dim goes in
    the mesh and the plugin in the plan, outermost first; ``sizes``: the sizes of its dim
    worth trying (1: without it); ``choices(context)``: the ways the plugin runs at the
    sizes chosen (an empty answer: these sizes do not suit it); ``first_fit``: the
    choices run from the fastest to the leanest in memory, so suggest keeps the first
    that fits and tries no leaner one; ``samples``: ranks along the dim read different
    samples (it divides the global batch); ``folded``: data parallelism folds the dim
    in (its ``composer_par_folded_dims`` answer); ``opt_in``: the plugin changes what
    training computes (lossy gradient compression), so suggest tries it only when asked
    to (an ``--option`` for it); ``marked``: every collective the plugin calls inside the
    blocks is marked (:mod:`composer_par.plugin.overlap`), so a pipeline may run two
    microbatches at once beside it."""

    plugin: str
    dim: str | None
    order: int
    sizes: tuple[int, ...]
    choices: Callable[[SuggestContext], Sequence[SuggestChoice]] = attrs.field(
        eq=False, repr=False)
    role: Role | None = None
    first_fit: bool = False
    samples: bool = False
    folded: bool = False
    opt_in: bool = False
    marked: bool = False


#: The tag of a choice whose backward runs in two passes (input, then weight gradients),
#: which recomputes each checkpointed block twice: a choice allowing one refuses it.
SPLIT_BACKWARD = "split_backward"

__all__ = ["SPLIT_BACKWARD", "SuggestAxis", "SuggestChoice", "SuggestContext"]
