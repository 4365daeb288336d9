"""One kind of collective on one mesh dim per step, as a plugin states it."""

from __future__ import annotations

from typing import Any

import attrs

from composer_par.estimate.errors import EstimateError

#: The kinds of collective the time model knows (:func:`~.timing.split_bytes`).
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "send")

#: What a collective can run behind: ``"none"``, it holds up the ranks that wait for it
#: (tensor parallelism's activations, an all-to-all whose output the next op needs);
#: ``"compute"``, it runs while the step computes something else (FSDP2's prefetched
#: all-gathers and its reduce-scatters, a replicate all-reduce in backward), so only the
#: part longer than the step's compute shows (:mod:`composer_par.estimate.step_time`).
OVERLAPS = ("none", "compute")


def _kind(instance: Any, attribute: Any, value: Any) -> None:
    if value not in KINDS:
        raise EstimateError(f"Collective kind must be one of {list(KINDS)}; got {value!r}")


def _overlap(instance: Any, attribute: Any, value: Any) -> None:
    if value not in OVERLAPS:
        raise EstimateError(f"Collective overlap must be one of {list(OVERLAPS)}; got "
                            f"{value!r}")


@attrs.frozen
class Collective:
    """Collectives of one kind on one mesh dim per step: ``calls`` of them, ``payload``
    logical bytes in all (see :mod:`composer_par.testing.comm_count`).

    ``group_size``/``nodes`` override the mesh dim's group (FSDP2's sub-groups for an
    int ``reshard_after_forward``, or its dim flattened with the dims data parallelism
    folds in). A ``send`` is point-to-point: its payload goes once from this rank to one
    peer, over the network when ``nodes`` is 2 (the peer is on another node), inside the
    node when 1. ``overlap``: what it runs behind (:data:`OVERLAPS`)."""

    dim: str
    kind: str = attrs.field(validator=_kind)
    payload: int
    calls: int
    why: str
    group_size: int | None = None
    nodes: int | None = None
    overlap: str = attrs.field(default="none", validator=_overlap)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


__all__ = ["KINDS", "OVERLAPS", "Collective"]
