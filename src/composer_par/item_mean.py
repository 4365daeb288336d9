"""The loss as the mean over every item of the global batch, however unevenly the items
fall (``plan.training_step(model, loss_fn, items=count)``).

A loss that is the mean over its own batch, averaged again over data-parallel ranks,
accumulation microbatches and pipeline microbatches, is a mean of means. Where labels
are ignored unevenly (padding, masked prompts, packed documents' ends), that weighs a
token of a short batch more than a token of a long one, and the training differs from
one process's step over the whole global batch. With ``items``, ``loss_fn`` returns
the *sum* over its batch, ``count(targets)`` says how many items that sum is over, and
the step scales each loss by ``microbatches * averaged / N``: ``N`` the items of the
global batch (one all-reduce of one integer per step), ``averaged`` the number of ranks
whose gradients data parallelism averages (:meth:`ParallelPlan.averaged_dims`, the
folded dims' ranks among them), ``microbatches`` what accumulation or the pipeline's
schedule divides by. The gradients are then those of ``sum of every item's loss / N``,
and ``step`` returns that loss.

    step = plan.training_step(model, cross_entropy_sum, items=labelled_tokens)

``cross_entropy_sum`` and ``labelled_tokens`` take labels already aligned with the
logits (next-token labels made on the whole sequence, then cut as the tokens are),
``ignore_index`` (-100) marking what is not learned.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from composer_par.outputs import logits_of

if TYPE_CHECKING:
    import torch

    from composer_par.plan import ParallelPlan

IGNORE_INDEX = -100


def cross_entropy_sum(outputs: Any, labels: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The summed cross-entropy of the logits in ``outputs`` (a tensor, or a Hugging Face
    output's ``.logits``) against ``labels`` of the same leading shape, in float32."""
    import torch.nn.functional as F

    logits = logits_of(outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


def labelled_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many of ``labels`` are learned: those not ``ignore_index``."""
    return (labels != ignore_index).sum()


def averaged_ranks(plan: ParallelPlan, world: int) -> int:
    """How many ranks data parallelism averages each gradient over (1 without any)."""
    mesh = plan.launch_mesh().resolve(world)
    return math.prod(mesh.size(name) for name in plan.averaged_dims())


def global_items(local: int, computes_loss: bool, averaged: int, pipeline_size: int,
                 device: torch.device) -> int:
    """The items of the global batch, from this rank's count ``local`` (counted only on
    ranks that compute the loss: all of them, or a pipeline's last stage; ``averaged``:
    :func:`averaged_ranks`). A collective
    over the default group when one is initialized (``device``: where its backend
    reduces).

    Ranks that hold the same tokens (tensor parallelism's) count them alike, so the sum
    over the ranks computing the loss is the global count times their copies:
    ``computing / averaged``. A sum the copies do not divide means such ranks counted
    differently (they were given different targets): ValueError on every rank."""
    import torch

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return local
    world = dist.get_world_size()
    total = torch.tensor(local if computes_loss else 0, dtype=torch.int64, device=device)
    dist.all_reduce(total)
    computing = world // pipeline_size
    copies, rest = divmod(computing, averaged)
    summed = int(total)
    if rest or summed % copies:
        raise ValueError(
            f"items: the {computing} ranks computing the loss counted {summed} items in "
            f"all, which their {copies} copies of each data shard "
            "do not divide: ranks that differ only in model-parallel dims (tp) must be "
            "given the same targets (plan.data_shard() says which samples a rank reads)")
    return summed // copies


def loss_scale(items: int, microbatches: int, averaged: int) -> float:
    """What each microbatch's summed loss is multiplied by: its gradient, divided by the
    ``microbatches`` and averaged over ``averaged`` ranks, is that of the sum over the
    ``items`` of the global batch. No items: 0, a step that learns nothing."""
    return 0.0 if items == 0 else microbatches * averaged / items


__all__ = ["IGNORE_INDEX", "averaged_ranks", "cross_entropy_sum", "global_items",
           "labelled_tokens", "loss_scale"]
