"""What plugins state about their own costs through the ``composer_par_estimate`` hook
(:class:`EstimatePart`, with :class:`EstimatePipeline` for a model cut into stages), and
asking a plan's plugins for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from composer_par.estimate.collectives import Collective
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.model_shape import ModelShape

if TYPE_CHECKING:
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.workload import Workload
    from composer_par.plan import ParallelPlan


@attrs.frozen
class EstimateStage:
    """One piece of the model that a rank runs on its own (a pipeline stage).

    ``model``: its parameter groups (``layers``: its blocks; ``vocab`` only on the piece
    that computes the logits). ``runs``: its forward and backward passes per step (the
    microbatches): what the per-pass terms (activations, tensor-parallel collectives)
    count. ``block_gathers`` / ``root_gathers``: all-gathers of each sharded block group
    / of its root group per step when the runtime decides them (None: the built-in count,
    one per forward and one per backward of a resharded group). ``accumulates``: the
    runtime accumulates gradients over the passes and reduces them once per step, keeping
    them (and, after backward, the parameters) unsharded over the shard dim until then.
    """

    label: str
    model: ModelShape
    runs: int = 1
    block_gathers: int | None = None
    root_gathers: int | None = None
    accumulates: bool = False


@attrs.frozen
class EstimateRank:
    """What one coordinate along the cut mesh dim holds and sends.

    ``held``: moments of the step as microbatch counts per stage (in ``stages`` order)
    whose activations the rank holds at once; the estimate takes the heaviest.
    ``in_flight``: the most stage-microbatches held at once. ``sends``: its
    point-to-point sends per step (kind ``"send"``, ``nodes`` 2 when the peer is on
    another node). ``buffers``: extra bytes by name (receive buffers).
    """

    coordinate: int
    stages: tuple[EstimateStage, ...]
    held: tuple[tuple[int, ...], ...]
    in_flight: int
    sends: tuple[Collective, ...] = ()
    buffers: Mapping[str, int] = attrs.field(factory=dict)


@attrs.frozen
class EstimatePipeline:
    """The model cut into stages along mesh dim ``dim``: what each coordinate runs.

    The estimate then gives each coordinate's memory and communication, and reports the
    worst: the fullest rank's memory and the slowest rank's communication. ``bubble``:
    the idle share of each rank's step.
    """

    dim: str
    title: str
    ranks: tuple[EstimateRank, ...]
    bubble: float
    microbatches: int


@attrs.frozen
class EstimatePart:
    """What a plugin's ``composer_par_estimate`` hook returns.

    ``collectives``: when not None, replaces the built-in estimate of the mesh dims this
    plugin claims and of those in ``replaces`` (an empty tuple: no communication there;
    ``replaces`` names dims another plugin owns whose collectives this one changes, as a
    comm hook does). ``memory``: extra per-rank
    bytes by name (e.g. a plugin's own buffers). ``activation_checkpoint``: the
    activation policy the plugin applies ("none", "selective" or "full"), if it decides it.
    ``pipeline``: the model cut into stages along a mesh dim (at most one plugin of a
    plan states one). ``notes``: what the estimate should say about this plugin's terms.
    """

    collectives: tuple[Collective, ...] | None = None
    memory: Mapping[str, int] = attrs.field(factory=dict)
    activation_checkpoint: str | None = None
    pipeline: EstimatePipeline | None = None
    notes: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()


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
