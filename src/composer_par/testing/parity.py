"""Train a plan on real ranks side by side with a single-process reference.

The core promise of composer_par: a plan's training equals plain single-process
training with the same initial weights and the same global batch. :func:`check_parity`
runs both and returns the differences; :meth:`ParityResult.assert_close` asserts them.

A *task* is a module-level object (addressed as ``"module:attr"`` so rank processes can
import it) with three methods:

* ``build() -> nn.Module`` -- called under ``torch.device("meta")``;
* ``batch(step) -> Tensor`` -- the global batch of a step, identical on every rank;
* ``loss(model, batch) -> Tensor`` -- the mean loss over ``batch``.

The plan is given as plan-file TOML, or as ``"module:function"`` returning a
:class:`~composer_par.ParallelPlan` (for options a plan file cannot state). It must
materialize with ``MetaInit``, which is layout invariant, so the reference starts from
the same weights as the ranks.

Every rank's parameters are compared with the reference, not rank 0's alone: a rank's
``full_tensor()`` of a parameter gathers the mesh dims it is sharded over, but a mesh dim
it is Replicate over (TP's norm weights and biases, every parameter over HSDP's
dp_replicate) contributes that rank's own copy only. A copy that drifted on one rank
shows in that rank's view and in no other, while the losses can stay at parity.
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from composer_par.blocks import clean_name
from composer_par.testing.distributed import run_ranks

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.plan import ParallelPlan

# fp32 tolerance of DESIGN.md section 9: collectives sum in another order than one process.
RTOL = 1.3e-6
ATOL = 1e-5


@attrs.frozen
class ParityCase:
    task: str
    plan: str
    world_size: int
    steps: int = 10
    optimizer: str = attrs.field(default="sgd", validator=attrs.validators.in_(("sgd", "adamw")))
    lr: float = 0.05
    # How the reference takes the global batch: "full" in one forward/backward, or
    # "accumulate": one micro-batch per data shard, gradients summed in shard order then
    # averaged (gradient accumulation). Both are plain single-process training on the same
    # global batch; "accumulate" does each shard's arithmetic exactly as its rank does, so
    # only the order of the final cross-shard sum differs. AdamW needs it: elements with
    # near-zero gradients turn fp32 summation-order noise into visible updates.
    reference: str = attrs.field(
        default="full", validator=attrs.validators.in_(("full", "accumulate"))
    )
    # Set to "bfloat16" for plans whose FSDP2 computes in bf16 with fp32 reduction: the
    # reference then runs each micro-batch on a bf16 copy and averages in fp32.
    param_dtype: str | None = None


@attrs.frozen
class ParityResult:
    """The losses and full parameters of a plan's training and of the reference.

    ``rank_params[r]`` is rank ``r``'s view of every full parameter (see the module's
    docstring: a replicated parameter is that rank's own copy); ``params`` is rank 0's,
    kept for callers that read one view. Built from one view only, ``rank_params`` is
    ``[params]``. :meth:`assert_close` and :meth:`max_param_diff` look at every view.
    """

    losses: list[float]
    reference_losses: list[float]
    params: dict[str, Any]
    reference_params: dict[str, Any]
    rank_params: list[dict[str, Any]] = attrs.field(
        default=attrs.Factory(lambda self: [self.params], takes_self=True))

    def max_param_diff(self, rank: int | None = None) -> tuple[str, float]:
        """The parameter farthest from the reference and by how much: over every rank's
        view, or over ``rank``'s alone."""
        views = self.rank_params if rank is None else [self.rank_params[rank]]
        worst = ("", 0.0)
        for params in views:
            for name, ref in self.reference_params.items():
                diff = float((params[name] - ref).abs().max())
                if diff > worst[1]:
                    worst = (name, diff)
        return worst

    def assert_close(self, rtol: float = RTOL, atol: float = ATOL) -> None:
        """The losses, and every rank's view of every parameter, within ``rtol``/``atol``
        of the reference; a parameter's failure names the rank (``rank 1: parameter ...
        differs from the reference``)."""
        import torch

        assert len(self.losses) == len(self.reference_losses), (self.losses, self.reference_losses)
        torch.testing.assert_close(
            torch.tensor(self.losses, dtype=torch.float64),
            torch.tensor(self.reference_losses, dtype=torch.float64),
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"losses differ from the reference: {m}",
        )
        assert_every_rank(self.rank_params, lambda params: assert_params_close(
            params, self.reference_params, rtol=rtol, atol=atol))


def assert_params_close(params: dict[str, Any], reference: dict[str, Any], *,
                        rtol: float = RTOL, atol: float = ATOL) -> None:
    """One view of the full parameters has the reference's names and values, within
    ``rtol``/``atol``."""
    import torch

    plan_only = sorted(set(params) - set(reference))
    reference_only = sorted(set(reference) - set(params))
    assert not plan_only and not reference_only, (
        f"parameter names differ: only in the plan {plan_only}, "
        f"only in the reference {reference_only}"
    )
    for name, ref in reference.items():
        torch.testing.assert_close(
            params[name],
            ref,
            rtol=rtol,
            atol=atol,
            msg=_prefixed(f"parameter {name} differs from the reference"),
        )


View = TypeVar("View")


def assert_every_rank(views: Sequence[View], check: Callable[[View], object]) -> None:
    """``check`` each rank's view (``views[r]`` is rank ``r``'s, as ``run_ranks`` returns
    them); an AssertionError is raised again with the rank first: ``rank 1: ...``.

    For anything a rank reads back from DTensors: a tensor Replicate over a mesh dim is
    that rank's own copy, which no other rank's view holds.
    """
    assert views, "no rank's view to check"
    for rank, view in enumerate(views):
        try:
            check(view)
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}: {exc}") from None


def _same_losses(losses: list[float], first: list[float]) -> None:
    assert losses == first, f"losses differ from rank 0's: {losses} != {first}"


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: f"{prefix}: {message}"


def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_plan(spec: str) -> ParallelPlan:
    from composer_par.plan import ParallelPlan

    if "[mesh]" in spec:
        return ParallelPlan.from_toml(spec)
    return _resolve(spec)()  # type: ignore[no-any-return]


def _optimizer(case: ParityCase, params: Any) -> torch.optim.Optimizer:
    import torch

    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=case.lr)
    return torch.optim.SGD(params, lr=case.lr)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor under the model's own names (a collective
    when parameters are DTensors: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[clean_name(name)] = value.detach().float().clone()
    return out


def start_rank(case: ParityCase) -> tuple[Any, ParallelPlan, nn.Module, int, int, Any]:
    """A rank's set-up: the task, the plan, the model built on meta with the plan applied,
    this rank's data shard (index, count), and the optimizer."""
    task = _resolve(case.task)
    plan = build_plan(case.plan)
    model, index, count = apply_to_built(task, plan)
    return task, plan, model, index, count, _optimizer(case, model.parameters())


def apply_to_built(task: Any, plan: ParallelPlan) -> tuple[nn.Module, int, int]:
    """``task``'s model built on meta with ``plan`` applied, and this rank's data shard
    (index, count): the start of every rank-side test of a plan."""
    import torch

    with torch.device("meta"):
        model = task.build()
    model = plan.apply(model)
    index, count = plan.data_shard()
    return model, index, count


def train_case(case: ParityCase) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One rank's side of :func:`check_parity`: build on meta, apply the plan, train
    ``case.steps`` steps on this rank's data shard; the mean loss of each step and this
    rank's view of every full parameter (gathered on every rank: a collective, so every
    rank calls it)."""
    losses, model = train_model(case)
    return losses, full_parameters(model)


def train_model(case: ParityCase) -> tuple[list[float], nn.Module]:
    """:func:`train_case` up to the trained model: the mean loss of each step (over all
    ranks) and the model, for rank-side tests that look at it before its parameters are
    gathered."""
    import torch.distributed as dist

    task, _plan, model, index, count, optimizer = start_rank(case)
    losses = []
    for step in range(case.steps):
        local = task.batch(step).chunk(count)[index]
        loss = task.loss(model, local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, model


def train_reference(case: ParityCase, device: str = "cpu"
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process reference: same init (MetaInit is layout invariant), same
    global batch; with ``param_dtype`` it emulates FSDP2's mixed precision. ``device``:
    where it runs (a CUDA device initializes from CUDA's generator, as ranks on CUDA do)."""
    import torch

    # One thread, as each rank has (run_ranks' threads_per_rank): on a small shared machine
    # a multi-threaded reference spins against the ranks and the other tests, and under
    # load it runs many times slower than with one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reference(case, device)
    finally:
        torch.set_num_threads(threads)


def _train_reference(case: ParityCase, device: str
                     ) -> tuple[list[float], dict[str, torch.Tensor]]:
    import torch

    from composer_par import MeshSpec, ParallelPlan
    from composer_par.plugin import Stage
    from composer_par.plugins.meta_init import MetaInit

    task = _resolve(case.task)
    plan = build_plan(case.plan)
    meta_init = plan.plugin("meta_init")
    if not isinstance(meta_init, MetaInit):
        raise ValueError("parity needs a plan that materializes with MetaInit")
    with torch.device("meta"):
        model = task.build()
    # The plan's module swaps (float8) make the model the ranks train: the reference is
    # that model on one process.
    single = ParallelPlan(MeshSpec())
    for plugin in plan.plugins:
        if Stage.CONVERT in type(plugin).stages():
            single.use(plugin)
    model = single.use(attrs.evolve(meta_init, device=device)).apply(model)
    _, shards = plan.data_shard(0, case.world_size)
    optimizer = _optimizer(case, model.parameters())
    losses = []
    for step in range(case.steps):
        batch = task.batch(step)
        if case.reference == "full" and case.param_dtype is None:
            loss = task.loss(model, batch)
            loss.backward()
            losses.append(float(loss.detach()))
        else:
            losses.append(_accumulate(task, model, batch, shards, case.param_dtype))
        optimizer.step()
        optimizer.zero_grad()
    return losses, full_parameters(model)


def _accumulate(
    task: Any, model: nn.Module, batch: torch.Tensor, shards: int, dtype_name: str | None
) -> float:
    """Gradient accumulation over one micro-batch per data shard, averaged in fp32.

    With ``dtype_name`` each micro-batch runs on a copy whose parameters (not buffers:
    FSDP2 leaves those alone) are cast to that dtype, as FSDP2's mixed precision does.
    """
    import torch

    params = dict(model.named_parameters())
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    total = 0.0
    for shard in batch.chunk(shards):
        worker = model
        if dtype_name is not None:
            worker = copy.deepcopy(model)
            for param in worker.parameters():
                param.data = param.data.to(getattr(torch, dtype_name))
        loss = task.loss(worker, shard)
        loss.backward()
        for name, param in worker.named_parameters():
            if param.grad is not None:
                grads[name] += param.grad.float()
                param.grad = None
        total += float(loss.detach().float())
    for name, param in params.items():
        param.grad = grads[name] / shards
    return total / shards


def check_parity(
    case: ParityCase, *, timeout: float = 240.0, workdir: str | os.PathLike[str] | None = None
) -> ParityResult:
    """Run the plan on ``case.world_size`` gloo ranks and the reference; compare."""
    results = run_ranks(train_case, case.world_size, args=(case,), timeout=timeout,
                        workdir=workdir)
    return parity_result(case, results)


def parity_result(
    case: ParityCase, rank_results: Sequence[tuple[list[float], dict[str, torch.Tensor]]],
    reference: tuple[list[float], dict[str, torch.Tensor]] | None = None,
) -> ParityResult:
    """Every rank's ``(losses, full parameters)``, in rank order as a rank function like
    :func:`train_case` returns them, with the reference trained here (or ``reference``,
    :func:`train_reference`'s result made elsewhere). The losses are rank 0's, once every
    rank's are found equal to them (all-reduced means: one value on every rank)."""
    rank_params = [params for _, params in rank_results]
    assert len(rank_params) == case.world_size, (len(rank_params), case.world_size)
    assert_every_rank([losses for losses, _ in rank_results], lambda losses: _same_losses(
        losses, rank_results[0][0]))
    ref_losses, ref_params = reference if reference is not None else train_reference(case)
    return ParityResult(rank_results[0][0], ref_losses, rank_params[0], ref_params, rank_params)


@attrs.frozen
class CommMeasurement:
    """What each rank's collectives moved while training ``case.steps`` steps.

    ``summary[rank]`` is :meth:`CommCounter.summary` (calls and logical payload bytes per
    mesh dim label and kind); ``wire[rank]`` is :meth:`CommCounter.wire_bytes_by_dim`
    (bytes the rank sends per mesh dim label, bandwidth-optimal algorithms).
    """

    summary: list[dict[str, dict[str, dict[str, int]]]]
    wire: list[dict[str, float]]
    losses: list[float]

    def bytes(self, dim: str, rank: int = 0) -> int:
        """Logical payload bytes over ``dim`` (all kinds) on ``rank``."""
        return sum(k["bytes"] for k in self.summary[rank].get(dim, {}).values())

    def wire_bytes(self, dim: str, rank: int = 0) -> float:
        return self.wire[rank].get(dim, 0.0)


def comm_on_rank(case: ParityCase) -> tuple[dict[str, Any], dict[str, float], list[float]]:
    """One rank's side of :func:`measure_comm`: train under a CommCounter."""
    import torch.distributed as dist

    from composer_par.testing.comm_count import CommCounter

    task, plan, model, index, count, optimizer = start_rank(case)
    losses = []
    counter = CommCounter()
    for step in range(case.steps):
        local = task.batch(step).chunk(count)[index]
        with counter:
            loss = task.loss(model, local)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    mesh = plan.mesh.resolve(dist.get_world_size())
    rank = dist.get_rank()
    return counter.summary(mesh, rank), counter.wire_bytes_by_dim(mesh, rank), losses


def measure_comm(
    case: ParityCase, *, timeout: float = 240.0, workdir: str | os.PathLike[str] | None = None
) -> CommMeasurement:
    """Train ``case`` on its ranks and count the collectives of forward and backward."""
    results = run_ranks(comm_on_rank, case.world_size, args=(case,), timeout=timeout,
                        workdir=workdir)
    return CommMeasurement([r[0] for r in results], [r[1] for r in results], results[0][2])
