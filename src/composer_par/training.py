"""One training loop for every plan: :class:`TrainingStep` (``plan.training_step``).

    step = plan.training_step(model, loss_fn)      # loss_fn(model's output, targets) -> loss
    optimizer = torch.optim.AdamW(model.parameters())
    for inputs, targets in batches:                # this rank's shard (plan.data_shard())
        loss = step.step(inputs, targets)           # forward, loss, backward
        step.clip_grad_norm_(1.0)
        step.optimizer_step(optimizer)              # optimizer.step(), then zero_grad()

``optimizer_step`` steps the optimizer unless a plugin discards the step (fault-tolerant
replica groups: the quorum of groups decides, see docs/fault-tolerance.md); it returns
whether the step applied, so a loop whose step was discarded runs the same batch again.
A plan without such a plugin always applies: ``optimizer.step(); optimizer.zero_grad()``
does the same there. Where a plugin can move the step count (a replica group that heals
takes its peers'), ``step.begin()`` runs the plugins' step-begin hooks before the batch
is chosen.

The loop is the same with or without a pipeline. Without one, ``step`` calls the model
on the batch and backpropagates the loss. With one (``plan.pipeline``), the plugin's
pipeline schedule cuts the per-rank batch into microbatches, runs each stage's forward
and backward in the schedule's order, and scales gradients by the microbatch count, so
that they equal those of one backward over the whole per-rank batch. Either way ``step``
returns the mean loss over the global batch (every data-parallel rank's batch), the same
on every rank.

One loss contract for every plan: ``loss_fn(outputs, targets)`` is given what the
model's own ``forward`` returns, never what a pipeline stage sends. Without a pipeline
that is ``model(*inputs, **kwargs)`` over the per-rank batch; with one, for each
microbatch, what the forward returned on the last stage: the same kind of object (a
Hugging Face model's ``ModelOutput`` class, e.g. ``CausalLMOutputWithPast`` with its
``logits``; a plain module's tensor or tuple), over the microbatch. So a loss written
for the model (``outputs.logits`` of a Hugging Face causal LM, the logits tensor of
:class:`composer_par.models.llama.Llama`) runs unchanged under every plan. Fields a model
fills per layer (``hidden_states``, ``attentions``) hold only the last stage's layers.

Auxiliary losses a model makes inside its forward through
:func:`composer_par.aux_loss.add_aux_loss` (the MoE Llama's load-balancing loss; a Hugging
Face MoE model's router loss after ``add_router_loss`` of
:mod:`composer_par.models.hf_router_loss`, whose statistics pipeline stages carry to the
last one) are the step's business, not ``loss_fn``'s: each reaches backward as a side
gradient where it was made (on whichever pipeline stage holds its block), and the step
adds their mean over its microbatches to the loss it returns. So ``loss_fn`` gives the
main loss only, under every plan.

``clip_grad_norm_`` computes the norm over every parameter of the whole model, whatever
mesh each lives on: plain tensors, DTensors sharded over some mesh dims and replicated
over others, and parameters that live on other pipeline stages. ``torch.nn.utils.
clip_grad_norm_`` cannot: it stacks the per-parameter norms, which fails when they are
DTensors on different meshes (an embedding TP does not split next to FSDP2 x TP blocks),
and it knows nothing of other stages.

Each rank adds the squares of its local gradient elements, each divided by the number
of ranks holding that element (its copies), and one all-reduce over every rank sums
them. The copies of an element: the ranks of the world outside the pipeline dim (those
hold the same stage), divided by the sizes of the mesh dims the parameter is sharded
over. This rests on one property of every composer_par plan: apart from the pipeline
stage, ranks hold the same parameters, each either whole or sharded (DTensor ``Shard``)
over some mesh dims.

The replica check is on by default: before every ``check_replicas_every``-th step
(the first included; default :data:`composer_par.replicas.EVERY`, an interval at which it
costs at most 0.1 % of a step), each replicated parameter is checked to be still equal
across the ranks holding it (:func:`composer_par.replicas.check_replicas`): the
parameters as the optimizer left them after the step before. It raises
:class:`composer_par.replicas.ReplicaDriftError` on every rank, naming the parameter, the
mesh dim and the ranks. ``check_replicas_every=None`` opts out.

Gradient accumulation: ``accumulate=k`` runs each step's per-rank batch as ``k`` equal
microbatches (cut along dim 0 of the inputs, of the targets and of every keyword tensor
whose dim 0 is the batch), one forward and backward each, every microbatch's loss scaled
by ``1/k``: the gradients equal those of one backward over the whole batch (``loss_fn``
gives the mean over its batch), and ``step`` returns the same global-batch mean loss.
Call the optimizer once per ``step``. ``sync`` says when FSDP2 / HSDP reduce gradients
(the plan's ``FSDPModule`` units; a plan without one has nothing to defer):

* ``"last"`` (the default): no reduce-scatter and no all-reduce until the last
  microbatch's backward, which reduces the gradients summed over all ``k``: one
  reduce-scatter per unit per step (and one replicate all-reduce per unit under HSDP),
  ``k`` times fewer than ``"every"``. Memory: between microbatches every unit keeps its
  full unsharded gradients (the size of the whole model's parameters on every rank, in
  the gradient dtype), instead of its ``1/shard`` part.
* ``"reduce_scatter"``: reduce-scatter after every microbatch, the HSDP all-reduce over
  the replicate dim only after the last. Memory: one sharded partial sum per unit
  (``1/shard`` of the model's gradients, as without accumulation); ``k`` reduce-scatters,
  one all-reduce per unit per step. Without a replicate dim it is ``"every"``.
* ``"every"``: both collectives after every microbatch, as ``k`` separate backwards.

Parameters are resharded after each microbatch's backward as without accumulation, so
each microbatch all-gathers them again. The policy holds only inside ``step``: after it
(and if it raises) every unit is back to syncing on each backward.

With a pipeline the schedule's microbatches are the accumulation: ``accumulate=k`` runs
one schedule pass over ``k`` times the pipeline's ``microbatches`` (``k * microbatches``
must divide the per-rank batch, and the schedule must accept the count). torch's
schedule already defers every FSDP2 / HSDP reduction to the end of its pass and divides
the gradients by the count it ran, so the step reduce-scatters once per unit however
many microbatches it runs, and the gradients are those of the whole batch. That is
``"last"``, the only ``sync`` a pipeline takes (``ValueError`` otherwise), with its
memory: every unit keeps its unsharded gradients (and parameters) through the pass. The
alternative, ``k`` schedule passes with the reduction deferred across them, would
reach into torch's stage (it reduces and rescales at the end of every pass) and pay a
pipeline fill and drain per pass. Activations: the 1F1B family holds a bounded number
of microbatches in flight, now ``k`` times smaller; GPipe runs every forward before any
backward, so it holds the whole batch's activations whatever ``k``. Gradients already
in ``.grad`` (a loop of several steps before one optimizer step) are set aside during
the pass and added back, so that the schedule's division leaves them alone: a step adds
into ``.grad`` as ``loss.backward()`` does, with or without a pipeline.
docs/accumulation.md has the collective counts and the memory of each policy.

Every mean above is a mean of means: of each data-parallel rank's, each accumulation
microbatch's and each pipeline microbatch's mean loss. It equals the global batch's mean
when every batch holds as many items (labelled tokens) as the others; where labels are
ignored unevenly it does not. ``items=count`` makes the step's loss the mean over every
item of the global batch: ``loss_fn`` then returns the sum over its batch, and
``count(targets)`` says how many items a rank's targets hold (:mod:`composer_par.item_mean`:
one all-reduce of the count per step, and each loss scaled before its backward).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from composer_par.gradient_sync import check_sync_policy, fsdp_units, set_gradient_sync
from composer_par.replicas import EVERY as REPLICA_CHECK_EVERY
from composer_par.replicas import check_every

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plan import ParallelPlan
    from composer_par.plugin.pipeline import Pipeline


def _dist() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


class TrainingStep:
    """Forward, loss and backward of one step of ``model`` as ``plan`` applied it."""

    def __init__(self, plan: ParallelPlan, model: nn.Module,
                 loss_fn: Callable[..., torch.Tensor], *,
                 check_replicas_every: int | None = REPLICA_CHECK_EVERY, accumulate: int = 1,
                 sync: str = "last", items: Callable[[Any], Any] | None = None) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (outputs, targets) -> loss; got "
                            f"{loss_fn!r}")
        check_every(check_replicas_every)
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive int; got {accumulate!r}")
        check_sync_policy(sync)
        if items is not None and not callable(items):
            raise TypeError(f"items must be callable (targets) -> count; got {items!r}")
        if items is not None and plan.launch_dims():
            names = [d.dim for d in plan.launch_dims()]
            raise ValueError(
                f"items with mesh dims {names} spanning launches (fault-tolerant replica "
                "groups): the count would have to be summed across launches, which no "
                "process group spans; give loss_fn a mean and leave items out")
        if sync != "last" and plan.pipeline is not None:
            raise ValueError(
                f"sync={sync!r} with a pipeline: torch's schedule defers every FSDP2 / HSDP "
                "reduction to the end of its last microbatch's backward (sync='last')")
        self.check_replicas_every = check_replicas_every
        self.accumulate = accumulate
        self.sync = sync
        self.steps = 0  # steps run so far
        # Whether a step's forwards made auxiliary losses (a router's balancing loss):
        # such a loss is taken per microbatch, which a comparison must match.
        self.aux_losses_seen = False
        self._begun = False  # begin() ran for the step not yet run
        self.plan = plan
        self.model = model
        self.loss_fn = loss_fn
        self.items = items
        # What each microbatch's loss is multiplied by this step (items: see the module).
        self._loss_scale = 1.0
        self.pipeline: Pipeline | None = plan.pipeline
        self._schedule: Any = None
        # The model's units do not change after apply: found once, not on every step.
        self._units = fsdp_units(model) if accumulate > 1 else []

    # -- the step ---------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any, **kwargs: Any) -> torch.Tensor:
        """Forward, loss and backward over this rank's batch; the global-batch mean loss.

        ``inputs`` is the model's input (a tensor, or a tuple of positional inputs),
        ``targets`` what ``loss_fn`` compares the outputs with; ``kwargs`` go to the model
        (with a pipeline they are cut into microbatches like the inputs, and every stage
        is given them). ``loss_fn(outputs, targets)`` is given what the model's forward
        returns, with or without a pipeline (with one: on the last stage, per
        microbatch; see the module). Gradients accumulate into ``.grad`` as after
        ``loss.backward()``. Returns a detached scalar tensor, the same on every rank.
        With ``check_replicas_every=N``, every N-th step (the first included) first
        checks the replicas (:meth:`check_replicas`). With ``accumulate=k`` the batch runs
        as ``k`` microbatches under the ``sync`` policy (see the module).
        """
        from composer_par.aux_loss import collect_aux_losses

        # A replica group that heals in begin() takes its peers' state, which the replica
        # check then sees.
        self.begin()
        self._begun = False  # the next step begins anew
        every = self.check_replicas_every
        if every is not None and self.steps % every == 0:
            self.check_replicas()
        self.steps += 1
        # Plugins forget what they derived from the parameters (float8's scales) when an
        # optimizer step may have changed them: before the step, and after its backward.
        hooks = self.plan.hooks
        hooks.parameters_changed(self.model)
        if self.items is not None:
            self._loss_scale = self._item_scale(targets)
        # The gradient an auxiliary loss gets is the one its microbatch's loss gets: a
        # pipeline's schedule divides by its count after the pass, accumulation before.
        scale = 1.0 if self.pipeline is not None else 1.0 / self.accumulate
        with collect_aux_losses(scale) as aux:
            if self.pipeline is not None:
                local, count = self._pipeline_step(inputs, targets, kwargs)
                microbatches = self.pipeline.microbatches * self.accumulate
            elif self.accumulate > 1:
                local, count = self._accumulated_step(inputs, targets, kwargs)
                microbatches = self.accumulate
            else:
                args = inputs if isinstance(inputs, tuple) else (inputs,)
                loss = self._loss(self.model(*args, **kwargs), targets)
                loss.backward()
                local, count = loss.detach().float().clone(), 1.0
                microbatches = 1
        hooks.parameters_changed(self.model)
        aux_total = aux.total()
        self.aux_losses_seen = self.aux_losses_seen or aux_total is not None
        # Each rank's forwards recorded the auxiliary losses of its own blocks (with a
        # pipeline: its stages'), summed over its microbatches: their mean joins the loss.
        extra = None if aux_total is None else aux_total.to(local.device) / microbatches
        return self._global_mean(local, count, extra)

    def _loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """``loss_fn``'s loss of one microbatch, times this step's scale (1 without
        ``items``)."""
        loss = self.loss_fn(outputs, targets)
        return loss if self.items is None else loss * self._loss_scale

    def _item_scale(self, targets: Any) -> float:
        """The scale that makes this step's summed losses the global batch's item mean;
        a collective on every rank."""
        import torch

        from composer_par.item_mean import averaged_ranks, global_items, loss_scale

        assert self.items is not None
        pipeline = self.pipeline
        computes = pipeline is None or pipeline.has_last
        local = int(self.items(targets)) if computes else 0
        size = pipeline.size if pipeline is not None else 1
        microbatches = self.accumulate * (pipeline.microbatches if pipeline is not None else 1)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        dist = _dist()
        averaged = averaged_ranks(self.plan, dist.get_world_size() if dist is not None else 1)
        count = global_items(local, computes, averaged, size, device)
        return loss_scale(count, microbatches, averaged)

    def begin(self) -> None:
        """Run the plugins' step-begin hooks now (``composer_par_step_begin``), before
        the step's batch is chosen; :meth:`step` then does not run them again (without
        this call it runs them first). A fault-tolerant plugin forms the step's quorum
        here, and a replica group that heals takes its peers' step count, which decides
        the batch."""
        if not self._begun:
            self.plan.hooks.step_begin(self.model)
            self._begun = True

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless a plugin discards this step
        (``composer_par_step_commit``: a fault-tolerant quorum that lost a replica group
        mid-step), then ``optimizer.zero_grad()`` either way. Returns whether the step
        applied; every rank of a launch gets the same answer."""
        applied = self.plan.hooks.step_commit(self.model, optimizer)
        if applied:
            optimizer.step()
        optimizer.zero_grad()
        return applied

    def _accumulated_step(self, inputs: Any, targets: Any, kwargs: dict[str, Any]
                          ) -> tuple[torch.Tensor, float]:
        import torch

        k = self.accumulate
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor)), None)
        if batch is None or batch % k:
            raise ValueError(f"accumulate={k} needs a per-rank batch (dim 0 of the inputs) "
                             f"that {k} divides; got {batch}")
        pieces = [_microbatches(a, batch, k) for a in args]
        target_pieces = _microbatches(targets, batch, k)
        kwarg_pieces = {key: _microbatches(value, batch, k) for key, value in kwargs.items()}
        units = self._units
        losses: list[torch.Tensor] = []
        try:
            for i in range(k):
                set_gradient_sync(units, self.sync, last=i == k - 1)
                outputs = self.model(*(p[i] for p in pieces),
                                     **{key: v[i] for key, v in kwarg_pieces.items()})
                loss = self._loss(outputs, target_pieces[i])
                (loss / k).backward()
                losses.append(loss.detach().float())
        finally:
            set_gradient_sync(units, "every", last=True)
        # Microbatches are equal in size: the mean of their means is the batch's.
        return torch.stack(losses).mean(), 1.0

    def _pipeline_step(self, inputs: Any, targets: Any, kwargs: dict[str, Any]
                       ) -> tuple[torch.Tensor, float]:
        import torch

        pipeline = self.pipeline
        assert pipeline is not None
        k = self.accumulate
        # Accumulation is more microbatches in the same schedule pass: torch's schedule
        # reduces once after the last backward and scales by the count it ran.
        count = pipeline.microbatches * k
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor)), None)
        if batch is not None:
            pipeline.check_batch(int(batch))
            if batch % count:
                raise ValueError(
                    f"accumulate={k} runs the schedule's {pipeline.microbatches} microbatches "
                    f"{k} times over: {count} microbatches need a per-rank batch (dim 0 of "
                    f"the inputs) that {count} divides; got {batch}")
        if self._schedule is None:
            self._schedule = pipeline.build_schedule(self._loss, count)
        # torch's schedule divides every gradient it finds after its pass by the count,
        # those of earlier steps too: set them aside and add them back, so that the step
        # adds into .grad as loss.backward() does.
        held = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        for param, _ in held:
            param.grad = None
        losses: list[torch.Tensor] = []
        self._schedule.step(
            *(args if pipeline.has_first else ()),
            target=targets if pipeline.has_last else None,
            losses=losses if pipeline.has_last else None,
            return_outputs=False,
            **kwargs,
        )
        for param, grad in held:
            param.grad = grad if param.grad is None else grad.add_(param.grad)
        if pipeline.has_last:
            # Microbatches are equal in size: the mean of their means is the batch's.
            local = torch.stack([loss.detach().float() for loss in losses]).mean()
            return local, 1.0
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return torch.zeros((), dtype=torch.float32, device=device), 0.0

    def _global_mean(self, local: torch.Tensor, count: float,
                     extra: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over the ranks that computed a loss (with a pipeline: those holding
        the last stage); each data-parallel shard weighs the same. ``extra``: this rank's
        auxiliary losses, which every stage adds (as many ranks hold each stage as hold
        the last one, so the same count divides them)."""
        import torch

        dist = _dist()
        if dist is None:
            return local if extra is None else local + extra
        numerator = local * count if extra is None else local * count + extra
        both = torch.stack([numerator, torch.tensor(count, device=local.device)])
        dist.all_reduce(both)
        return both[0] / both[1]

    def check_replicas(self) -> None:
        """Raise :class:`composer_par.replicas.ReplicaDriftError` on every rank if a
        replicated parameter differs across its ranks; a collective on every rank. A
        pipeline stage's plain parameters are left out (no other stage holds them)."""
        from composer_par.replicas import check_replicas

        check_replicas(self.model, plain_group=None if self.pipeline is not None else "world")

    # -- gradient clipping --------------------------------------------------------------

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The ``norm_type`` norm of every gradient of the whole model, on every rank."""
        return total_grad_norm(self.model.parameters(), norm_type, self._pipeline_size())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the whole model's gradient norm is at most
        ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` on one process); returns the
        norm before clipping, the same on every rank."""
        return clip_grad_norm_(self.model.parameters(), max_norm, norm_type,
                               pipeline_size=self._pipeline_size())

    def _pipeline_size(self) -> int:
        return self.pipeline.size if self.pipeline is not None else 1


def _microbatches(value: Any, batch: int, k: int) -> list[Any]:
    """``value`` cut into ``k`` pieces along dim 0 if it is a batch tensor (or a tuple or
    list of them), else ``k`` times itself."""
    import torch

    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return list(value.chunk(k))
    if isinstance(value, (tuple, list)):
        parts = [_microbatches(v, batch, k) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(k)]
    return [value] * k


def _local_and_copies(grad: torch.Tensor, world: int, pipeline_size: int
                      ) -> tuple[torch.Tensor, int]:
    """This rank's part of ``grad`` and how many ranks hold each of its elements."""
    from torch.distributed.tensor import DTensor, Replicate

    copies = world // pipeline_size
    if not isinstance(grad, DTensor):
        return grad, copies
    if any(p.is_partial() for p in grad.placements):
        # Partial sums are no elements yet: reduce them first.
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p
                                             for p in grad.placements])
    mesh = grad.device_mesh
    for dim, placement in enumerate(grad.placements):
        # Every placement but Replicate splits the elements over the mesh dim: Shard, and
        # the _StridedShard of FSDP2 over TP (which is no Shard subclass).
        if not placement.is_replicate():
            copies //= mesh.size(dim)
    return grad.to_local(), max(1, copies)


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0,
                    pipeline_size: int = 1) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of ``parameters`` across every rank (see
    the module), with ``pipeline_size`` ranks along the pipeline dim (1: none). A
    collective over the default process group when one is initialized."""
    import torch

    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 or inf; got {norm_type}")
    grads = [p.grad for p in parameters if p.grad is not None]
    dist = _dist()
    world = dist.get_world_size() if dist is not None else 1
    device = grads[0].device if grads else torch.device("cpu")
    if world % pipeline_size:
        raise ValueError(f"pipeline size {pipeline_size} does not divide world size {world}")
    if math.isinf(norm_type):
        total = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            local, _ = _local_and_copies(grad, world, pipeline_size)
            if local.numel():
                total = torch.maximum(total, local.detach().abs().max().float())
        if dist is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        local, copies = _local_and_copies(grad, world, pipeline_size)
        local = local.detach()
        if not local.numel():
            continue
        power = (local.float().abs().pow(norm_type).sum() if norm_type != 2.0
                 else local.float().pow(2).sum())
        total += power.double() / copies
    if dist is not None:
        dist.all_reduce(total)
    return total.pow(1.0 / norm_type).float()


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, *, pipeline_size: int = 1) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on any meshes and pipeline stages
    (see the module); returns the total norm before clipping."""
    import torch

    params: Sequence[torch.Tensor] = (
        [parameters] if isinstance(parameters, torch.Tensor) else list(parameters))
    total = total_grad_norm(params, norm_type, pipeline_size)
    # torch's own rule: scale by max_norm / (norm + 1e-6), never up.
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in params:
            grad = param.grad
            if grad is not None:
                # In place on the local part (a partial sum scales as its total does).
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                local.mul_(coef.to(local.device))
    return total


_TOLD = "_composer_par_tells_plugins"


def tell_plugins_after_steps(plan: ParallelPlan, models: Sequence[nn.Module],
                             optimizer: Any) -> bool:
    """After every step of ``optimizer`` (a torch optimizer, or a wrapper holding one as
    ``.optimizer``: accelerate's, Lightning's), tell ``plan``'s plugins that the
    parameters of ``models`` changed (``composer_par_parameters_changed``): what the
    trainer adapters do with each optimizer they set up, since they drive no
    :class:`TrainingStep`. Once per optimizer; returns whether it was registered now."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if getattr(inner, _TOLD, False) or not hasattr(inner, "register_step_post_hook"):
        return False
    held = list(models)

    def after_step(*_: Any) -> None:
        for model in held:
            plan.hooks.parameters_changed(model)

    inner.register_step_post_hook(after_step)
    setattr(inner, _TOLD, True)
    return True


__all__ = ["TrainingStep", "clip_grad_norm_", "tell_plugins_after_steps", "total_grad_norm"]
