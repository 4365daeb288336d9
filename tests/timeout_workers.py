"""Rank-side function of tests/test_timeout_warning.py: a plain process-group start (the
user's own ``init_process_group``, with torch's default timeout or the plan's), a plan
applied, and what the library logged about the timeouts on this rank."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any


def rank_main(rank: int, world: int, init_file: str, out_file: str,
              timeout_s: float | None) -> None:
    import torch
    import torch.distributed as dist

    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.models.llama import Llama, LlamaConfig

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.DEBUG)
    logging.getLogger("composer_par").addHandler(handler)
    logging.getLogger("composer_par").setLevel(logging.DEBUG)
    options: dict[str, Any] = {}
    if timeout_s is not None:
        options["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, **options)
    try:
        plan = ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2()).use(MetaInit(seed=0))
        with torch.device("meta"):
            model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2,
                                      n_kv_heads=2, ffn_hidden=32, max_seq_len=8))
        plan.apply(model)
        # Applying a second model builds no second warning either.
        with torch.device("meta"):
            again = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2,
                                      n_kv_heads=2, ffn_hidden=32, max_seq_len=8))
        ParallelPlan(MeshSpec(dp_shard=world)).use(FSDP2()).use(MetaInit(seed=0)).apply(again)
    finally:
        dist.destroy_process_group()
    with open(out_file, "w") as f:
        json.dump([r for r in records if "timeout" in r], f)
