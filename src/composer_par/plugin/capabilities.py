"""What a plan's plugins provide: capabilities asked of the plan, not of a plugin by name.

A plugin states what it provides in its class attribute ``provides`` (FSDP2 and HSDP
``"data_parallel"``, EP ``"expert_parallel"``); another plugin that behaves differently
beside such a provider asks here, so that neither knows the other (a model-parallel dim
averages its own gradients only when no data-parallel plugin folds it in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from composer_par.plugin.view import PlanView


def provided(plan: PlanView, capability: str) -> bool:
    """Whether any plugin of ``plan`` declares that it provides ``capability``."""
    return any(capability in decl.provides for decl in plan.declarations())


def has_data_parallel(plan: PlanView) -> bool:
    """Whether a plugin of ``plan`` provides data parallelism (reduces gradients over the
    data-parallel dims, the folded model-parallel dims with them)."""
    return provided(plan, "data_parallel")


__all__ = ["has_data_parallel", "provided"]
