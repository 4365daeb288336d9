"""Rank-side functions for tests/test_composition.py (importable by rank processes)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from composer_par.plugin import Plugin, hookimpl
from composer_par.testing.parity import ParityCase, ParityResult


def train_cases(cases: list[ParityCase]) -> list[tuple[list[float], dict[str, Any]]]:
    """``train_case`` for several cases in one run of the ranks: starting 8 processes
    and their process group costs more than a small case's 10 steps."""
    from composer_par.testing.parity import train_case

    return [train_case(case) for case in cases]


def check_cases(cases: list[ParityCase], *, timeout: float) -> list[ParityResult]:
    """``check_parity`` for several cases of one world size, in one run of the ranks:
    every rank's parameters compared, as ``check_parity`` does."""
    from composer_par.testing.distributed import run_ranks
    from composer_par.testing.parity import parity_result

    sizes = {case.world_size for case in cases}
    assert len(sizes) == 1, f"one world size per run, got {sorted(sizes)}"
    ranks = run_ranks(train_cases, sizes.pop(), args=(cases,), timeout=timeout)
    return [parity_result(case, [per_rank[i] for per_rank in ranks])
            for i, case in enumerate(cases)]


# -- torch's own behaviour: compile through AOTAutograd of a block under TP ------------------


def compiled_tp_block(backend: str, block_input: str, checkpoint: bool) -> dict[str, Any]:
    """A two-module model under TP: a rowwise Linear (its output is ``to_local()`` of a
    DTensor: a view of the DTensor's local tensor) feeding an attention block (colwise
    q/k/v, SDPA, rowwise o), the block compiled with ``backend`` (and checkpointed, as
    ActivationCheckpoint does: the forward under ``torch.utils.checkpoint``). One backward.

    ``block_input``: ``"view"`` feeds the block what TP hands over; ``"copy"`` feeds it a
    fresh tensor (``x + 0``). Returns ``{"error": first line}`` or the largest gradient
    difference from the same model run eagerly.
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class Block(nn.Module):
        """Attention as the Llama's: q/k/v colwise, SDPA on the local heads, o rowwise."""

        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(8, 16, bias=False) for _ in range(3))
            self.o = nn.Linear(16, 8, bias=False)

        def inner(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, _ = x.shape
            q, k, v = (lin(x).view(batch, seq, -1, 4).transpose(1, 2)
                       for lin in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.o(out.transpose(1, 2).reshape(batch, seq, -1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if checkpoint:
                return torch_checkpoint(self.inner, x, use_reentrant=False)  # type: ignore[no-any-return]
            return self.inner(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(8, 8, bias=False)
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            return self.block(h + 0 if block_input == "copy" else h)  # type: ignore[no-any-return]

    def build(compiled: bool) -> nn.Module:
        torch.manual_seed(0)
        model = Model()
        parallelize_module(model, mesh, {
            "first": RowwiseParallel(input_layouts=Replicate()),
            **{f"block.{n}": ColwiseParallel() for n in "qkv"}, "block.o": RowwiseParallel(),
        })
        if compiled:
            model.block.compile(backend=backend)
        return model

    def grads(model: nn.Module) -> dict[str, Any]:
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
        model(x).pow(2).sum().backward()
        return {n: _full(p.grad) for n, p in model.named_parameters()}

    eager = grads(build(compiled=False))
    try:
        compiled = grads(build(compiled=True))
    except Exception as exc:  # torch's failure is the result
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return {"max_grad_diff": max(float((compiled[n] - g).abs().max()) for n, g in eager.items())}


def compiled_tp_cases() -> dict[str, dict[str, Any]]:
    cases = {
        "aot_eager, view input": ("aot_eager", "view", False),
        "aot_eager, copied input": ("aot_eager", "copy", False),
        "aot_eager, copied input, checkpointed": ("aot_eager", "copy", True),
        "eager, view input": ("eager", "view", False),
        "eager, view input, checkpointed": ("eager", "view", True),
    }
    return {name: compiled_tp_block(*args) for name, args in cases.items()}


def fsdp2_tp_aot_eager_grads() -> dict[str, Any]:
    """The Llama under FSDP2 x TP (2 x 2): one step's gradients with each block compiled
    through aot_eager vs not compiled. The plan refuses this (CP221), so a stand-in
    plugin compiles in the compile stage, as Compile would."""
    import torch

    from composer_par import FSDP2, TP, MeshSpec, MetaInit, ParallelPlan
    from composer_par.testing.tasks import llama

    def grads(compiled: bool) -> dict[str, Any]:
        plan = ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(TP()).use(FSDP2())
        if compiled:
            plan.use(UncheckedCompile())
        with torch.device("meta"):
            model = llama.build()
        model = plan.use(MetaInit(seed=7)).apply(model)
        index, count = plan.data_shard()
        llama.loss(model, llama.batch(0).chunk(count)[index]).backward()
        return {n: _full(p.grad) for n, p in model.named_parameters()}

    eager, compiled = grads(False), grads(True)
    worst = max(eager, key=lambda n: float((compiled[n] - eager[n]).abs().max()))
    return {"worst": worst, "diff": float((compiled[worst] - eager[worst]).abs().max()),
            "eager_max": float(eager[worst].abs().max()),
            "compiled_max": float(compiled[worst].abs().max()),
            "others_max_diff": max(float((compiled[n] - g).abs().max())
                                   for n, g in eager.items() if n != worst)}


def _full(grad: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


@attrs.frozen
class UncheckedCompile(Plugin):
    """``block.compile(backend="aot_eager")`` on each block in the compile stage, with
    none of Compile's rules: what a plan without CP221 would do."""

    name: ClassVar[str] = "unchecked_compile"
    needs_blocks: ClassVar[bool] = True

    @hookimpl
    def composer_par_compile(self, ctx: Any) -> str:
        for _, block in ctx.blocks:
            block.compile(backend="aot_eager")
        return f"aot_eager on {len(ctx.blocks)} block(s)"
