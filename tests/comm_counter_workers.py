"""Rank-side functions for tests/test_comm_counter.py: the same training step counted by
:class:`composer_par.testing.comm_count.CommCounter` and by torch's ``CommDebugMode``."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any


def _step(plan_text: str, counter_mode: Any) -> Any:
    import torch
    from composer_par.plugins.tp import loss_parallel

    from composer_par.plan import ParallelPlan
    from composer_par.testing.tasks import llama

    plan = ParallelPlan.from_toml(plan_text)
    with torch.device("meta"):
        model = llama.build()
    model = plan.apply(model)
    index, count = plan.data_shard()
    uses_loss_parallel = any(getattr(p, "loss_parallel", False) for p in plan.plugins)
    context = loss_parallel() if uses_loss_parallel else contextlib.nullcontext()
    with counter_mode, context:
        loss = llama.loss(model, llama.batch(0).chunk(count)[index])
        loss.backward()
    return counter_mode


def both_counts(plan_text: str) -> dict[str, Any]:
    """One step under each counter: CommCounter's calls by kind, CommDebugMode's by kind,
    and CommCounter's calls in order (kind, group)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from composer_par.testing.comm_count import CommCounter, collective_kind

    counter = _step(plan_text, CommCounter())
    debug = CommDebugMode()
    # CommDebugMode's module tracker (torch 2.13) registers a forward hook on every call
    # of a module, so a module called twice in one forward (the Llama's rotary embedding,
    # once for queries and once for keys) pops its parent list twice and fails with an
    # IndexError. Module attribution is not compared here; only the counting is, and
    # that is CommDebugMode's own __torch_dispatch__, untouched.
    debug.advanced_module_tracker._fw_set_module_hook = lambda *args: None  # type: ignore[method-assign]
    debug = _step(plan_text, debug)
    theirs: Counter[str] = Counter()
    for packet, calls in debug.get_comm_counts().items():
        kind = collective_kind(str(packet).rsplit(".", 1)[-1])
        theirs[kind or str(packet)] += calls
    ours = Counter(call.kind for call in counter.calls)
    return {"ours": dict(ours), "theirs": dict(theirs),
            "ops": [call.op for call in counter.calls]}


def loss_calls(plan_text: str) -> list[dict[str, Any]]:
    """CommCounter's calls of one step, in order."""
    from composer_par.testing.comm_count import CommCounter

    return [call.to_dict() for call in _step(plan_text, CommCounter()).calls]
