"""What the last forward routed: tokens per expert and per ep rank, for the log.

Each experts module's dispatch keeps the counts of its last forward (no gradient, no
extra collective in the step); :func:`routing_stats` sums them over the ep group, a
collective every ep rank calls, and :func:`log_routing` logs them as one event per
experts module on a structlog logger (``composer_par.logging.get_logger``: JSON when the
log is).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn

from .dispatch import ExpertDispatch


@attrs.frozen
class RoutingStats:
    """One experts module's last forward over its ep group: the routed (token, slot)
    pairs each expert received, and the pairs each ep rank computed (min/mean/max)."""

    module: str
    tokens_per_expert: tuple[int, ...]
    rank_min: int
    rank_mean: float
    rank_max: int
    # Pairs a capacity factor dropped, over the ep group (0 when dropless).
    dropped: int = 0

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def routing_stats(model: nn.Module) -> list[RoutingStats]:
    """Every dispatched experts module's routing of the last forward, summed over its ep
    group (a collective: every rank of the group calls it)."""
    from composer_par.plugin import clean_name

    out = []
    for path, module in model.named_modules():
        dispatch = module.__dict__.get("forward")
        if not isinstance(dispatch, ExpertDispatch) or dispatch.sent_per_expert is None:
            continue
        per_expert = dispatch.sent_per_expert.clone()
        dist.all_reduce(per_expert, group=dispatch.group)
        mine = dispatch.received_per_expert.sum()  # type: ignore[union-attr]
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=dispatch.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=dispatch.group)
        dropped = torch.tensor(dispatch.dropped)
        dist.all_reduce(dropped, group=dispatch.group)
        out.append(RoutingStats(
            clean_name(path), tuple(int(n) for n in per_expert.tolist()), int(low),
            float(per_expert.sum()) / dispatch.ep, int(high), int(dropped)))
    return out


def log_routing(model: nn.Module, log: Any, step: int | None = None) -> list[RoutingStats]:
    """:func:`routing_stats`, logged on ``log`` (a structlog logger) as one ``ep routing``
    event per experts module."""
    stats = routing_stats(model)
    for entry in stats:
        log.info("ep routing", step=step, **entry.as_dict())
    return stats


__all__ = ["RoutingStats", "log_routing", "routing_stats"]
