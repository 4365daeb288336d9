"""The experts' forward under expert parallelism: tokens go to the ranks that hold their
routed experts and come back, by ``all_to_all_single`` with uneven splits.

The model's router has run already (untouched): the experts module is called with the
hidden states of this rank's tokens, ``top_k_index`` and ``top_k_weights``, exactly as in
one process. Each (token, slot) pair is sent to the ep rank holding its expert, computed
there by the module's own forward on this rank's slice of the expert weights, sent back,
and combined with the router weights. Dropless: every pair is computed, so the result is
the one-process result up to the order of floating-point sums.

Every collective of the forward is a functional one (out of place): selective
checkpointing saves their outputs, so a checkpointed block's recomputation in backward
sends nothing again (c10d's ``all_to_all_single`` writes into its argument, which a
selective checkpoint cannot keep).

The dispatch's collectives and the combine's are each marked as a run of collectives
(:mod:`composer_par.plugin.overlap`), so that a pipeline running one microbatch's
forward beside another's backward (pp's ``overlap``) runs them while the other computes.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composer_par.plugin import comm_begins, comm_ends, torch_private


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse
    all-to-all (torch's own autograd wrapper of it is deprecated)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return torch_private.functional_all_to_all(tensor.contiguous(), out_splits,
                                                   in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), \
            None, None, None


class _SumOver(torch.autograd.Function):
    """Forward: the sum over ``group`` of each rank's partial tensor; backward: the
    identity (each partial gets the whole sum's gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return torch_private.functional_all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


class _SumGradOver(torch.autograd.Function):
    """Forward: the identity; backward: the gradient summed over ``group``. For a tensor
    equal on every rank of ``group`` of which each rank's computation used a part."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_to_all(tensor: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``in_splits[r]`` of ``tensor`` to rank r; ``out_splits[r]`` rows from it."""
    return _AllToAll.apply(tensor, out_splits, in_splits, group)  # type: ignore[no-any-return]


class LocalExperts:
    """The experts module seen with this rank's expert tensors (plain, autograd-connected
    to the DTensor parameters) in place of its DTensors, for a call of the module's own
    forward that must not go through ``nn.Module.__call__`` again (the module's hooks,
    FSDP2's among them, ran for the outer call). Methods are bound to the view, so a
    helper the forward calls (transformers' ``_apply_gate``) reads the same tensors."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        object.__setattr__(self, "_module", module)
        self.__dict__.update(tensors)

    def __getattr__(self, name: str) -> Any:
        module = object.__getattribute__(self, "_module")
        attr = getattr(type(module), name, None)
        if isinstance(attr, types.FunctionType):
            return types.MethodType(attr, self)
        return getattr(module, name)


class ExpertDispatch:
    """The replacement forward of one experts module (``module.forward``).

    ``forward``: the module's own (class) forward; ``names``: its parameters split per
    expert; ``num_experts``: the global count; ``group``: the ep process group;
    ``capacity_factor``: None (dropless), or the factor of a capacity: each rank sends
    each expert at most ``ceil(capacity_factor * pairs / num_experts)`` of its routed
    pairs (the first in token order), the rest dropped (they add nothing to the output;
    the token keeps its residual), as GShard and Switch Transformer do; ``tp_mesh``:
    None, or the mesh dim of expert tensor parallelism, over which each expert's weights
    are split and the pairs' partial outputs summed (``whole``: the parameters kept whole
    on its ranks, counted on its first rank only: the output projection's bias).
    """

    def __init__(self, module: nn.Module, forward: Any, names: tuple[str, ...],
                 num_experts: int, group: dist.ProcessGroup,
                 capacity_factor: float | None = None, tp_mesh: Any = None,
                 whole: tuple[str, ...] = ()) -> None:
        self.module = module
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        self.tp_first = tp_mesh is None or tp_mesh.get_local_rank() == 0
        self.whole = whole
        self.capacity_factor = capacity_factor
        # Pairs the capacity dropped in the last forward, on this rank.
        self.dropped = 0
        self.forward = forward
        self.names = names
        self.num_experts = num_experts
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local_experts = num_experts // self.ep
        # The last forward's routed (token, slot) pairs per global expert and per local
        # expert received from all ranks (observability; no gradient).
        self.sent_per_expert: torch.Tensor | None = None
        self.received_per_expert: torch.Tensor | None = None

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        experts = top_k_index.reshape(-1)
        # The dispatch's collectives run from here to ``arrived`` (the backward's all-reduce
        # over expert tp and its all-to-all between them too, in reverse).
        hidden_states = comm_begins(hidden_states)
        if self.tp_group is not None:
            # Each tp rank's experts see the same tokens through its part of their
            # weights: the tokens' gradient is the sum of the parts'.
            hidden_states = _SumGradOver.apply(hidden_states, self.tp_group)
        # The pairs sorted by expert, so each destination rank's pairs are contiguous and
        # within them each local expert's; stable, so the order is deterministic.
        order = torch.argsort(experts, stable=True)
        if self.capacity_factor is not None:
            order = self._within_capacity(experts, order)
        token_of = torch.div(order, top_k, rounding_mode="floor")
        sent = torch.bincount(experts[order], minlength=self.num_experts)
        received = torch_private.functional_all_to_all(sent, None, None, self.group)
        self.sent_per_expert, self.received_per_expert = sent, received
        send_splits = sent.view(self.ep, self.local_experts).sum(1).tolist()
        recv_splits = received.view(self.ep, self.local_experts).sum(1).tolist()
        inputs = hidden_states[token_of]
        arrived = comm_ends(all_to_all(inputs, recv_splits, send_splits, self.group))
        # received[r * local + j]: the pairs rank r sent to local expert j, in that order.
        local_ids = torch.arange(self.local_experts, device=experts.device).repeat(self.ep)
        local_index = torch.repeat_interleave(local_ids, received)[:, None]
        ones = arrived.new_ones(arrived.shape[0], 1)
        local = self._local_tensors()
        computed = self.forward(LocalExperts(self.module, local), arrived, local_index, ones)
        if arrived.shape[0] == 0:
            # A rank that received nothing still takes part in backward's all-to-alls (the
            # others wait for it) and gives its experts a zero gradient, as one process
            # gives experts no token chose: tie the empty result to both.
            tensors = [t for t in local.values() if isinstance(t, torch.Tensor)]
            computed = arrived + sum((0 * t.sum() for t in tensors), arrived.new_zeros(()))
        returned = all_to_all(comm_begins(computed), send_splits, recv_splits, self.group)
        if self.tp_group is not None:
            # Each tp rank computed a partial sum of every pair's output (its part of the
            # intermediate features): summed before the router weights, so that their
            # gradient is whole on every tp rank.
            returned = _SumOver.apply(returned, self.tp_group)
        returned = comm_ends(returned)
        router_weights = top_k_weights.reshape(-1)[order].to(returned.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, returned * router_weights[:, None])

    def _within_capacity(self, experts: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """``order`` (pairs sorted by expert) less each expert's pairs beyond capacity."""
        capacity = math.ceil(self.capacity_factor * experts.numel() / self.num_experts)  # type: ignore[operator]
        counts = torch.bincount(experts, minlength=self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        sorted_experts = experts[order]
        position = torch.arange(order.numel(), device=order.device) - starts[sorted_experts]
        kept = order[position < capacity]
        self.dropped = order.numel() - kept.numel()
        return kept

    def _local_tensors(self) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        if isinstance(getattr(self.module, "num_experts", None), int):
            # transformers' grouped-mm forward counts tokens per expert over num_experts.
            tensors["num_experts"] = self.local_experts
        for name in self.names:
            value = getattr(self.module, name)
            tensors[name] = value.to_local() if isinstance(value, DTensor) else value
            if name in self.whole:
                # Added once to the sum of the partial outputs: on the first tp rank only
                # (zero elsewhere, still in the graph), its gradient summed over tp.
                local = _SumGradOver.apply(tensors[name], self.tp_group)
                tensors[name] = local if self.tp_first else local * 0
        return tensors
