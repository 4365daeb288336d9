"""Apply a resolved plan: ``parallelize_module`` with each entry's torch ``ParallelStyle``,
then the parameters no style touched replicated as DTensors over the tp mesh
(``replicate_rest``). Torch is imported inside the functions only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .styles import SHARD_LAYOUT, StyleSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .resolution import Resolution


def _placement(layout: str | None) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if layout is None:
        return None
    if layout == "replicate":
        return Replicate()
    match = SHARD_LAYOUT.fullmatch(layout)
    assert match, layout
    return Shard(int(match.group(1)))


def torch_style(spec: StyleSpec) -> Any:
    """The ``ParallelStyle`` for a resolved (defaults filled) spec."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    def one(layouts: tuple[str | None, ...] | None) -> Any:
        return _placement(layouts[0]) if layouts else None

    def many(layouts: tuple[str | None, ...] | None) -> Any:
        return tuple(_placement(x) for x in layouts) if layouts is not None else None

    def kw(layouts: tuple[tuple[str, str | None], ...] | None) -> Any:
        return {k: _placement(v) for k, v in layouts} if layouts is not None else None

    if spec.style in ("colwise", "colwise_gather", "embedding_colwise"):
        return ColwiseParallel(input_layouts=one(spec.input_layouts),
                               output_layouts=one(spec.output_layouts),
                               use_local_output=bool(spec.use_local_output))
    if spec.style in ("rowwise", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=one(spec.input_layouts),
                               output_layouts=one(spec.output_layouts),
                               use_local_output=bool(spec.use_local_output))
    if spec.style == "sequence_parallel":
        return SequenceParallel(sequence_dim=spec.sequence_dim or 1,
                                use_local_output=bool(spec.use_local_output))
    if spec.style == "prepare_input":
        return PrepareModuleInput(
            input_layouts=many(spec.input_layouts),
            desired_input_layouts=many(spec.desired_input_layouts),
            input_kwarg_layouts=kw(spec.input_kwarg_layouts),
            desired_input_kwarg_layouts=kw(spec.desired_input_kwarg_layouts),
            use_local_output=bool(spec.use_local_output),
        )
    if spec.style == "prepare_output":
        return PrepareModuleOutput(
            output_layouts=many(spec.output_layouts),
            desired_output_layouts=many(spec.desired_output_layouts),
            use_local_output=bool(spec.use_local_output),
        )
    if spec.style == "replicate":
        return replicate_style()
    raise AssertionError(spec.style)


def apply_resolution(resolution: Resolution, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for _, module, spec in resolution.entries:
        parallelize_module(module, mesh, torch_style(spec))


def replicate_rest(resolution: Resolution, mesh: DeviceMesh) -> int:
    """Replicate the parameters no style touched (norms without sequence parallel) as
    DTensors over ``mesh``: every parameter is then a DTensor on one mesh, which foreach and
    fused optimizers and ``clip_grad_norm_`` need. Values and gradients are unchanged: these
    modules already computed the same values on every tp rank."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    # Tied parameters (one Parameter in two modules) become one DTensor in both.
    replaced: dict[int, nn.Parameter] = {}
    for _, module in resolution.rest:
        for pname, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(
                    distribute_tensor(param, mesh, [Replicate()]),
                    requires_grad=param.requires_grad)
            module.register_parameter(pname, replaced[id(param)])
    for _, module in resolution.rest:
        parallelize_module(module, mesh, replicate_style())
    return len(resolution.rest)


_REPLICATE_STYLE: Any = None


def replicate_style() -> Any:
    """A ParallelStyle (built on first use: torch is imported lazily) that replicates a
    module's own parameters over the mesh, takes local inputs as replicated DTensors and
    hands back local outputs; buffers (e.g. RoPE tables) stay plain tensors."""
    global _REPLICATE_STYLE
    if _REPLICATE_STYLE is None:
        _REPLICATE_STYLE = _make_replicate_style()
    return _REPLICATE_STYLE()


def _make_replicate_style() -> type:
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.utils._pytree import tree_map

    class ReplicateParallel(ParallelStyle):
        def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
            for pname, param in list(module.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    continue
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank),
                    requires_grad=param.requires_grad))

        @staticmethod
        def _inputs(module: nn.Module, inputs: Any, mesh: Any) -> Any:
            def wrap(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                return t
            return tree_map(wrap, inputs)

        @staticmethod
        def _outputs(module: nn.Module, outputs: Any, mesh: Any) -> Any:
            return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, outputs)

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, self._partition, self._inputs,
                                     self._outputs)

        def __repr__(self) -> str:
            return "ReplicateParallel()"

    return ReplicateParallel
