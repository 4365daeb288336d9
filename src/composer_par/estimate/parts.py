"""What plugins state about their own costs through the ``composer_par_estimate`` hook
(:class:`EstimatePart`), and asking a plan's plugins for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from composer_par.estimate.collectives import Collective
from composer_par.estimate.errors import EstimateError

if TYPE_CHECKING:
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.model_shape import ModelShape
    from composer_par.estimate.workload import Workload
    from composer_par.plan import ParallelPlan


@attrs.frozen
class EstimatePart:
    """What a plugin's ``composer_par_estimate`` hook returns.

    ``collectives``: when not None, replaces the built-in estimate of the mesh dims this
    plugin claims (an empty tuple: no communication there). ``memory``: extra per-rank
    bytes by name (e.g. a plugin's own buffers). ``activation_checkpoint``: the
    activation policy the plugin applies ("none", "selective" or "full"), if it decides it.
    """

    collectives: tuple[Collective, ...] | None = None
    memory: Mapping[str, int] = attrs.field(factory=dict)
    activation_checkpoint: str | None = None


def plugin_parts(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload
) -> list[tuple[str, EstimatePart]]:
    """``(plugin name, part)`` for each plugin answering the estimate hook, in plan order;
    an answer that is not an :class:`EstimatePart` is an error."""

    out = []
    for name, part in plan.hooks.estimate_parts(layout, model, workload):
        if not isinstance(part, EstimatePart):
            raise EstimateError(f"plugin {name!r}: composer_par_estimate must return an "
                                f"EstimatePart or None; got {type(part).__name__}")
        out.append((name, part))
    return out
