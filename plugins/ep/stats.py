"""What the last forward routed: tokens per expert and per ep rank, for the log.

Each experts module's dispatch keeps the counts of its last forward (no gradient, no
extra collective in the step); :func:`routing_stats` sums them over the ep group, a
collective every ep rank calls, and :func:`log_routing` logs them as one event per
experts module on a structlog logger (``composer_par.logging.get_logger``: JSON when the
log is). :func:`routing_summary` folds a step's modules into one
:class:`RoutingSummary` (min/mean/max per expert and per ep rank, and the drops) for a
progress line or a ``--json`` result; EP notes it as ``plan.notes["ep_routing"]``, so a
trainer reads it without importing EP.
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


@attrs.frozen
class RoutingSummary:
    """One step's routing over every experts module: the routed pairs an expert received
    (min/mean/max over the experts of all modules), the pairs an ep rank computed in one
    module (min/mean/max over the ranks and the modules), the pairs dropped, and each
    module's :class:`RoutingStats`."""

    step: int | None
    expert_min: int
    expert_mean: float
    expert_max: int
    rank_min: int
    rank_mean: float
    rank_max: int
    dropped: int
    modules: tuple[RoutingStats, ...]

    @classmethod
    def of(cls, stats: list[RoutingStats], step: int | None = None) -> RoutingSummary:
        if not stats:
            raise ValueError("no experts module was dispatched: nothing to summarize")
        counts = [n for entry in stats for n in entry.tokens_per_expert]
        return cls(step, min(counts), sum(counts) / len(counts), max(counts),
                   min(e.rank_min for e in stats),
                   sum(e.rank_mean for e in stats) / len(stats),
                   max(e.rank_max for e in stats), sum(e.dropped for e in stats),
                   tuple(stats))

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self, recurse=False),
                "modules": [entry.as_dict() for entry in self.modules]}

    def format(self) -> str:
        """``tokens per expert min/mean/max 9/16.0/25, per ep rank 58/64.0/70, dropped 0``."""
        return (f"tokens per expert min/mean/max {self.expert_min}/{self.expert_mean:.1f}/"
                f"{self.expert_max}, per ep rank {self.rank_min}/{self.rank_mean:.1f}/"
                f"{self.rank_max}, dropped {self.dropped}")


def routing_summary(model: nn.Module, step: int | None = None) -> RoutingSummary | None:
    """:func:`routing_stats` of the last forward folded into one summary (a collective:
    every rank calls it); None when no experts module was dispatched."""
    stats = routing_stats(model)
    return RoutingSummary.of(stats, step) if stats else None


def log_routing(model: nn.Module, log: Any, step: int | None = None) -> list[RoutingStats]:
    """:func:`routing_stats`, logged on ``log`` (a structlog logger) as one ``ep routing``
    event per experts module."""
    stats = routing_stats(model)
    for entry in stats:
        log.info("ep routing", step=step, **entry.as_dict())
    return stats


__all__ = ["RoutingStats", "RoutingSummary", "log_routing", "routing_stats", "routing_summary"]
