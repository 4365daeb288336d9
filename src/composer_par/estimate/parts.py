"""What plugins state about their own costs, and asking a plan's plugins for it.

A plugin answers ``composer_par_estimate`` with an :class:`EstimatePart`: its memory per
rank by category (:class:`MemoryTerm`), its collectives per mesh dim
(:class:`~composer_par.estimate.collectives.Collective`, with what each overlaps), the
compute it adds (:class:`ComputeTerm`), a pipeline it cuts the model into
(:class:`EstimatePipeline`), and what the report should show of it
(:class:`EstimateSection`, notes, accounting). The estimator adds the answers up; it
knows no plugin by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.estimate.collectives import Collective
from composer_par.estimate.errors import EstimateError
from composer_par.estimate.model_shape import ModelShape

if TYPE_CHECKING:
    from composer_par.estimate.layout import Layout
    from composer_par.estimate.workload import Workload
    from composer_par.plan import ParallelPlan

#: The categories of per-rank memory; a term of any other category is an error.
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "other")


def _category(instance: Any, attribute: Any, value: Any) -> None:
    if value not in MEMORY_CATEGORIES:
        raise EstimateError(f"MemoryTerm category must be one of {list(MEMORY_CATEGORIES)}; "
                            f"got {value!r}")


@attrs.frozen
class MemoryTerm:
    """Bytes a plugin adds to one category of a rank's memory at peak (negative: bytes it
    takes off the device, as offloading does).

    ``transient``: held only while one pipeline stage runs (the unsharded parameters of
    the group being gathered, activation buffers): of a rank holding several stages, the
    largest stage's counts, not their sum."""

    category: str = attrs.field(validator=_category)
    bytes: int
    why: str
    transient: bool = False


@attrs.frozen
class ComputeTerm:
    """Compute a plugin adds to each rank's step beyond the model's forward and backward:
    ``flops`` per rank run as the model's matrix multiplications (at the matmul
    precision), and the shares of the model's forward it runs again (recomputation):
    ``forward_share`` of its matmuls, ``attention_share`` of its attention."""

    why: str
    flops: float = 0.0
    forward_share: float = 0.0
    attention_share: float = 0.0


@attrs.frozen
class EstimateSection:
    """A section of the estimate's report that a plugin writes about its own terms.

    ``key``: its name in the JSON (``"sections": {key: data}``); ``lines``: the text,
    the first line its heading; ``data``: what the JSON shows (a dict, or a value with
    ``to_dict()``), also what :meth:`~composer_par.estimate.Estimate.section` returns."""

    key: str
    lines: tuple[str, ...]
    data: Any = None

    def to_dict(self) -> Any:
        data = self.data
        return data.to_dict() if hasattr(data, "to_dict") else data


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
    ``paired``: the share of its forward and backward passes the runtime runs beside
    another microbatch's, in a forward-backward pair (:mod:`composer_par.plugin.overlap`):
    the collectives a plugin marks for it run behind the other half's compute.
    """

    label: str
    model: ModelShape
    runs: int = 1
    block_gathers: int | None = None
    root_gathers: int | None = None
    accumulates: bool = False
    paired: float = 0.0


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
    the idle share of each rank's step (the step-time model divides the busy time by
    ``1 - bubble``). ``microbatches``: the passes of each stage per step (the training
    step's accumulation included). ``notes``: what the estimate should say of the cut.
    """

    dim: str
    title: str
    ranks: tuple[EstimateRank, ...]
    bubble: float
    microbatches: int
    notes: tuple[str, ...] = ()


@attrs.frozen
class EstimatePart:
    """What a plugin's ``composer_par_estimate`` hook returns: its own terms.

    ``collectives``: its collectives per step and rank (logical payload bytes, see
    :mod:`composer_par.testing.comm_count`), each naming its mesh dim and what it
    overlaps; None or () when it communicates nothing. ``terms``: memory per rank by
    category (:class:`MemoryTerm`). ``memory``: extra per-rank bytes by name (category
    ``other``; the short form of ``terms``). ``compute``: operations it adds per step
    (:class:`ComputeTerm`). ``activation_checkpoint``: the activation policy the plugin
    applies ("none", "selective" or "full"), if it decides it. ``pipeline``: the model cut
    into stages along a mesh dim (at most one plugin of a plan states one).
    ``sections``: what the report shows of it (:class:`EstimateSection`).
    ``accounting``: how it counts, one line each, added to the report's accounting.
    ``notes``: what the estimate should say about this plugin's terms.
    """

    collectives: tuple[Collective, ...] | None = None
    memory: Mapping[str, int] = attrs.field(factory=dict)
    terms: tuple[MemoryTerm, ...] = ()
    compute: tuple[ComputeTerm, ...] = ()
    activation_checkpoint: str | None = None
    pipeline: EstimatePipeline | None = None
    sections: tuple[EstimateSection, ...] = ()
    accounting: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def memory_terms(self) -> tuple[MemoryTerm, ...]:
        """``terms`` and ``memory`` (as category ``other``) together."""
        return self.terms + tuple(MemoryTerm("other", int(size), name)
                                  for name, size in self.memory.items())


def runs_of(workload: Workload, stage: EstimateStage | None) -> int:
    """The forward and backward passes a term counts: a pipeline stage's runs, else the
    workload's micro-batches per step."""
    return stage.runs if stage is not None else workload.grad_accum


def plugin_parts(
    plan: ParallelPlan, layout: Layout, model: ModelShape, workload: Workload,
    stage: EstimateStage | None = None,
) -> list[tuple[str, EstimatePart]]:
    """``(plugin name, part)`` for each plugin answering the estimate hook, in plan order;
    an answer that is not an :class:`EstimatePart` is an error, and so is a collective on
    a mesh dim the layout does not have."""
    out = []
    for name, part in plan.hooks.estimate_parts(layout, model, workload, stage):
        if not isinstance(part, EstimatePart):
            raise EstimateError(f"plugin {name!r}: composer_par_estimate must return an "
                                f"EstimatePart or None; got {type(part).__name__}")
        for c in part.collectives or ():
            if not isinstance(c, Collective) or c.dim not in layout.mesh:
                raise EstimateError(
                    f"plugin {name!r}: composer_par_estimate states "
                    f"{c!r}, not a Collective on a mesh dim of {layout.mesh.equation()}")
        out.append((name, part))
    return out


def held_shape(plan: ParallelPlan | None, layout: Layout, model: ModelShape) -> ModelShape:
    """``model`` as the plan's model-parallel plugins leave one rank's view of it: each
    answer to ``composer_par_estimate_shape``, in plan order, taking the one before."""
    if plan is None:
        return model
    for name, answer in plan.hooks.estimate_shapes(layout, model):
        if not isinstance(answer, ModelShape):
            raise EstimateError(f"plugin {name!r}: composer_par_estimate_shape must return a "
                                f"ModelShape or None; got {type(answer).__name__}")
        model = answer
    return model


def hooked_collectives(plan: ParallelPlan | None, layout: Layout, model: ModelShape,
                       workload: Workload, parts: Sequence[tuple[str, EstimatePart]]
                       ) -> list[Collective]:
    """The collectives the plugins' ``parts`` state, those of a mesh dim a comm hook
    customizes replaced by what the hooking plugin says runs instead
    (``composer_par_estimate_comm_hook``); a plugin is not asked about its own."""
    stated = [(who, c) for who, part in parts for c in part.collectives or ()]
    if plan is None:
        return [c for _, c in stated]
    hooks = plan.hooks.comm_hooks()
    if not hooks:
        return [c for _, c in stated]
    out: list[Collective] = []
    for who, c in stated:
        hook = next((h for h in hooks if h.dim == c.dim
                     and getattr(h, _HOOKED.get(c.kind, ""), None)), None)
        if hook is None or not hook.plugin or hook.plugin == who:
            out.append(c)
            continue
        replaced = plan.hooks.estimate_comm_hook(hook.plugin, layout, model, workload, c)
        if replaced is None:
            out.append(c)
            continue
        for r in replaced:
            if not isinstance(r, Collective):
                raise EstimateError(f"plugin {hook.plugin!r}: composer_par_estimate_comm_hook "
                                    f"must return Collectives; got {type(r).__name__}")
        out.extend(replaced)
    return out


# The CommHook field that customizes each kind of collective.
_HOOKED = {"all_reduce": "all_reduce", "all_gather": "all_gather",
           "reduce_scatter": "reduce_scatter"}


__all__ = ["MEMORY_CATEGORIES", "ComputeTerm", "EstimatePart", "EstimatePipeline",
           "EstimateRank", "EstimateSection", "EstimateStage", "MemoryTerm", "held_shape",
           "hooked_collectives", "plugin_parts", "runs_of"]
