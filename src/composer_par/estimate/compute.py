"""The compute of a training step: FLOPs per token as torchtitan counts them, and the
tokens one step processes.

Per token, forward and backward (torchtitan's ``num_flops_per_token``):

* ``6 x N`` for the matrix multiplications, ``N`` the parameters a token passes through
  outside the input embedding (a lookup multiplies nothing): each weight multiplies once
  in forward and twice in backward, 2 FLOPs per multiply-add. Of a mixture-of-experts
  model, the active parameters: ``top_k`` of each MoE block's ``num_experts`` experts.
* ``12 x layers x heads x head_dim x seq`` for attention's two products (scores and
  values), every query against the whole sequence (the causal mask's unused half
  counted, as torchtitan does).

The step's FLOPs are those per token times the tokens of every data shard; each rank's
share is that over the world (data, tensor, context, expert and pipeline parallelism
all divide the work evenly). What a plugin adds (activation checkpointing's
recomputation: a share of the forward, a third of these FLOPs) comes as
:class:`~composer_par.estimate.parts.ComputeTerm`.
"""

from __future__ import annotations

import attrs

from composer_par.estimate.layout import Layout
from composer_par.estimate.model_shape import ModelShape


@attrs.frozen
class StepFlops:
    """One step's model FLOPs, whole and per rank, split into matmul and attention."""

    tokens: int  # every data shard's tokens of one step
    matmul_per_token: float
    attention_per_token: float
    world: int

    @property
    def per_token(self) -> float:
        return self.matmul_per_token + self.attention_per_token

    @property
    def total(self) -> float:
        return self.per_token * self.tokens

    @property
    def matmul_per_rank(self) -> float:
        return self.matmul_per_token * self.tokens / self.world

    @property
    def attention_per_rank(self) -> float:
        return self.attention_per_token * self.tokens / self.world

    @property
    def per_rank(self) -> float:
        return self.total / self.world


def flops_per_token(model: ModelShape, seq: int) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one token's forward and backward (module docstring)."""
    active = max(0, model.active_params - model.embedding_params)
    attention = 12.0 * model.layers * (model.heads or 0) * model.attention_head_dim * seq
    return 6.0 * active, attention


def step_tokens(layout: Layout, seq: int, micro_batch: int, passes: int) -> int:
    """Tokens one step processes over all ranks: ``passes`` micro-batches of
    ``micro_batch`` sequences per data shard."""
    return seq * micro_batch * passes * layout.data_shards()


def step_flops(layout: Layout, model: ModelShape, seq: int, micro_batch: int,
               passes: int) -> StepFlops:
    matmul, attention = flops_per_token(model, seq)
    return StepFlops(step_tokens(layout, seq, micro_batch, passes), matmul, attention,
                     max(1, layout.mesh.world_size))


__all__ = ["StepFlops", "flops_per_token", "step_flops",
           "step_tokens"]
