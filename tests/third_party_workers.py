"""Rank-side functions for tests/test_third_party_plugin.py (importable by rank processes)."""

from __future__ import annotations

import sys
from typing import Any

PLAN = """
[mesh]
dp_shard = 2

[[plugins]]
name = "freeze"
prefix = "tok_embeddings"

[[plugins]]
name = "fsdp2"

[[plugins]]
name = "meta_init"
seed = 0
"""


def train_with_the_plugin(site: str, steps: int) -> dict[str, Any]:
    """Find the third-party plugin through its entry point, as a user's run would, apply
    it with FSDP2 and MetaInit, train ``steps`` SGD steps; report what changed."""
    import torch

    sys.path.insert(0, site)
    from composer_par import ParallelPlan
    from composer_par.testing.parity import full_parameters
    from composer_par.testing.tasks import LlamaTask

    task = LlamaTask()
    plan = ParallelPlan.from_toml(PLAN)
    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    before = full_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        task.loss(model, task.batch(step)).backward()
        optimizer.step()
    after = full_parameters(model)
    return {
        "applied": [(s.stage, s.plugin, s.detail) for s in plan.applied],
        "plugin_module": type(plan.plugins[0]).__module__,
        "changed": {n: bool((after[n] - before[n]).abs().max() > 0) for n in after},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }
