"""When the FSDP2 and HSDP units of a model reduce their gradients, backward by backward.

Gradient accumulation runs ``k`` backwards per optimizer step; FSDP2 reduce-scatters
(and HSDP all-reduces over its replicate dim) after every one of them unless each unit is
told otherwise. A sync policy says what the backwards before the last do:

* ``"last"``: nothing; the last backward reduces the gradients summed over all ``k``
  (every unit keeps its unsharded gradients between backwards);
* ``"reduce_scatter"``: reduce-scatter, but all-reduce over the replicate dim only in the
  last (sharded partial sums between backwards); without a replicate dim, ``"every"``;
* ``"every"``: both, as ``k`` separate steps.

:class:`composer_par.training.TrainingStep` (``accumulate=k, sync=...``) and the
trainer adapters of :mod:`composer_par.integrations` (through :class:`DeferredSync`)
set the units with :func:`set_gradient_sync`; docs/accumulation.md has the collectives
and memory of each policy. This module imports no torch until a model is asked about.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

SYNC_POLICIES = ("last", "reduce_scatter", "every")


def check_sync_policy(sync: object) -> str:
    """``sync`` if it names a policy of :data:`SYNC_POLICIES`; ``ValueError`` otherwise."""
    if not isinstance(sync, str) or sync not in SYNC_POLICIES:
        raise ValueError(f"sync must be one of {', '.join(map(repr, SYNC_POLICIES))}; "
                         f"got {sync!r}")
    return sync


def fsdp_units(model: nn.Module) -> list[Any]:
    """The FSDP2 (and FSDP2-based replicate) units of ``model``."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_gradient_sync(units: Sequence[Any], sync: str, *, last: bool) -> None:
    """Set each unit's gradient reduction for the next backward under policy ``sync``;
    ``last``: the last backward before the optimizer step. ``last=True`` (under any
    policy) is FSDP2's own default: reduce on every backward."""
    reduce = last or sync != "last"
    all_reduce = last or sync == "every"
    for unit in units:
        unit.set_requires_gradient_sync(reduce, recurse=False)
        if reduce:
            unit.set_requires_all_reduce(all_reduce, recurse=False)
        # Not the last backward of a deferred sync: FSDP2 keeps its partial sums for the
        # next one instead of finalizing.
        unit.set_is_last_backward(last or sync == "every")


class DeferredSync:
    """The policy ``sync`` for an accumulation loop a trainer runs itself: its backwards
    before the last run inside :meth:`defer`, the last one outside it.

    The Lightning strategies and the accelerate adapter hold one: Lightning's
    ``block_backward_sync`` / ``fabric.no_backward_sync`` and accelerate's ``no_sync``
    (what ``accumulate()`` and the Hugging Face Trainer enter for every microbatch but the
    last) are :meth:`defer`. Each model's units are found once: they do not change after
    the plan applied it.
    """

    def __init__(self, sync: str = "last") -> None:
        self.sync = check_sync_policy(sync)
        self._units: weakref.WeakKeyDictionary[nn.Module, list[Any]] = (
            weakref.WeakKeyDictionary())

    def units(self, model: nn.Module) -> list[Any]:
        """The FSDP2 units of ``model`` (:func:`fsdp_units`)."""
        found = self._units.get(model)
        if found is None:
            found = self._units[model] = fsdp_units(model)
        return found

    @contextmanager
    def defer(self, model: nn.Module) -> Iterator[None]:
        """Backwards inside reduce as a backward before the last under the policy; after
        (and if the block raises), every unit reduces on each backward again, so the
        next backward outside, the last of the accumulation, reduces everything."""
        units = self.units(model)
        set_gradient_sync(units, self.sync, last=False)
        try:
            yield
        finally:
            set_gradient_sync(units, "every", last=True)


__all__ = ["SYNC_POLICIES", "DeferredSync", "check_sync_policy", "fsdp_units",
           "set_gradient_sync"]
