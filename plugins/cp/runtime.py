"""What a training loop needs from an applied CP plan: this rank's part of a batch, the
global positions of its tokens, and a loss that is the mean over every token of the
global batch.

``apply`` leaves a :class:`ContextShard` on the model (``context_of(model)``) and in
``plan.notes["cp"]``. The cp ranks of one data shard read the same samples; each cuts
its own part with :meth:`ContextShard.shard`::

    cp = context_of(model)
    tokens, labels, positions = cp.shard(tokens), cp.shard(labels), cp.positions(seq_len)
    loss = cp.cross_entropy(model(tokens, positions), labels)

``cross_entropy`` takes what the model returned (logits, or a Hugging Face output), so it
is the loss ``plan.training_step(model, cp.cross_entropy)`` takes for any model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from composer_par.plugin import logits_of

from .layout import rank_positions, shard_sequence

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

ATTRIBUTE = "_composer_par_context"


@attrs.frozen
class ContextShard:
    """This rank's place among the cp ranks: ``rank`` of ``size``, the cp process group
    (and its 1-D device mesh, which torch's ring attention takes)."""

    group: Any = attrs.field(repr=False)
    size: int
    rank: int
    mode: str
    mesh: Any = attrs.field(default=None, repr=False)

    def shard(self, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """This rank's part of ``tensor`` (inputs, labels, positions, a mask of the whole
        sequence) along tensor dim ``seq_dim``."""
        return shard_sequence(tensor, self.size, self.rank, seq_dim)

    def positions(self, seq_len: int, device: torch.device | str | None = None
                  ) -> torch.Tensor:
        """The global positions (``seq_len`` the whole sequence's) of this rank's tokens:
        what the model's rotary embedding and ``position_ids`` take."""
        return rank_positions(seq_len, self.size, self.rank, device)

    def token_mean(self, loss_sum: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
        """The loss whose gradient, averaged over the cp ranks (data parallelism folds cp
        in), is that of ``sum of every token's loss / number of tokens`` over the data
        shard's whole sequences: ``loss_sum`` and ``count`` are this rank's. The tokens
        a rank holds may count differently (ignored labels), so the count is summed over
        the cp ranks. Averaged over the cp ranks, the value is the data shard's mean."""
        import torch
        import torch.distributed as dist

        total = torch.as_tensor(count, dtype=torch.float32, device=loss_sum.device).clone()
        dist.all_reduce(total, group=self.group)
        return loss_sum * self.size / total

    def cross_entropy(self, outputs: Any, labels: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
        """Cross-entropy of this rank's logits (batch, local_seq, vocab) against its
        ``labels`` as :meth:`token_mean` makes it: averaged over the cp ranks, the mean
        over every labelled token of the data shard. ``outputs`` is what the model
        returned, as ``plan.training_step`` gives its loss: the logits tensor, or a
        Hugging Face model's output (its ``.logits``), or a tuple of them first."""
        import torch.nn.functional as F

        logits = logits_of(outputs)
        flat = labels.reshape(-1)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat,
                                   ignore_index=ignore_index, reduction="sum")
        return self.token_mean(loss_sum, (flat != ignore_index).sum())


def context_of(model: nn.Module) -> ContextShard | None:
    """The :class:`ContextShard` an applied CP plan left on ``model``, or None (no CP)."""
    found = getattr(model, ATTRIBUTE, None)
    return found if isinstance(found, ContextShard) else None


def next_token_labels(tokens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``tokens`` shifted one place left, the last place ``ignore_index``: the labels of
    next-token prediction, made on the whole sequence before it is cut (a rank's last
    token's label is the first token of a chunk another rank holds)."""
    import torch

    pad = torch.full_like(tokens[:, :1], ignore_index)
    return torch.cat([tokens[:, 1:], pad], dim=1)


__all__ = ["ATTRIBUTE", "ContextShard", "context_of", "next_token_labels"]
