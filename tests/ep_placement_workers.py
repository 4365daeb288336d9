"""Tasks for tests/test_ep_placement.py (importable by rank processes)."""

from __future__ import annotations

from tests.ep_workers import MoELlamaTask

# Two experts over ep(2): one per ep rank, fewer than the two dp_shard ranks FSDP2
# shards it over.
one_expert_per_rank = MoELlamaTask(num_experts=2, top_k=1)
