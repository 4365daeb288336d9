"""Tasks and rank-side functions for tests/test_cp.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any

from composer_par.testing.tasks import LlamaTask


class ContextLlama(LlamaTask):
    """The Llama task, each cp rank taking its part of every sequence: tokens, labels and
    positions cut by the plan's :class:`ContextShard`; without CP (the reference) the
    whole sequence. The loss is the mean over every labelled token either way."""

    def loss(self, model: Any, batch: Any) -> Any:
        import torch.nn.functional as F
        from composer_par.plugins.cp import context_of, next_token_labels

        labels = next_token_labels(batch)
        cp = context_of(model)
        if cp is None:
            logits = model(batch)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        positions = cp.positions(batch.shape[1])
        return cp.cross_entropy(model(cp.shard(batch), positions), cp.shard(labels))


llama = ContextLlama()
# Four KV heads: alltoall over 4 ranks, and TP, need head counts they divide.
llama_kv4 = ContextLlama(n_kv_heads=4)
