"""Apply a resolved plan: ``parallelize_module`` with each entry's torch ``ParallelStyle``,
then the parameters no style touched replicated as DTensors over the tp mesh
(``replicate_rest``). Torch is imported inside the functions only."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .styles import LOCAL_FORWARD_STYLES, PARAMETER_STYLES, SHARD_LAYOUT, StyleSpec

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
    if spec.style in LOCAL_STYLES:
        return local_style(spec.style, spec.split_factor or 2, spec.rope_dim)
    raise AssertionError(spec.style)


#: Our own styles (ParallelStyle subclasses over DTensor, below), by the style they serve.
LOCAL_STYLES = {*LOCAL_FORWARD_STYLES, "packed_colwise", "packed_rowwise", "local_colwise",
                "local_rowwise", "local_packed_rowwise", "replicate_grad_allreduce",
                "identity_expert", "all_reduce", "sequence_region",
                "sequence_region_local", "shared_input",
                "mla_kv_a_proj"}


def parameter_placement(style: str, ndim: int, split_factor: int | None = None) -> Any:
    """The placement a parameter entry (or a local style's own weight) gets: the tensor
    dim its style splits (the last for rowwise, the one before for colwise), strided for
    packed weights so that each rank holds its slice of every packed part."""
    from torch.distributed.tensor import Replicate, Shard

    from composer_par.plugin import torch_private

    back = PARAMETER_STYLES.get(style)
    if back is None:
        return Replicate()
    if ndim == 1:
        # A bias: colwise-family ones follow the output features, rowwise ones are added
        # after the sum and stay whole.
        if back == -1:
            return Replicate()
        dim = 0
    else:
        dim = ndim + back
    if style.endswith("packed_colwise") or style.endswith("packed_rowwise"):
        return torch_private.strided_shard()(dim, split_factor=split_factor or 2)
    return Shard(dim)


def distributed_elsewhere(module: Any) -> bool:
    """Whether every parameter the module owns is a DTensor already: another model-parallel
    transform earlier in the stage (expert parallelism's experts) placed them and wrapped
    the module's forward around them. TP leaves such a module whole: no style, and not
    replicated (its inputs wrapped as DTensors would reach that forward)."""
    from torch.distributed.tensor import DTensor

    own = [p for p in module._parameters.values() if p is not None]
    return bool(own) and all(isinstance(p, DTensor) for p in own)


def leave_distributed(resolution: Resolution) -> list[str]:
    """Drop from ``resolution`` the module entries, rest modules and parameter entries
    (of owners) that :func:`distributed_elsewhere`; the modules' paths."""
    left = [path for path, module, _ in resolution.entries if distributed_elsewhere(module)]
    left += [path for path, module in resolution.rest if distributed_elsewhere(module)]
    resolution.entries = [e for e in resolution.entries if e[0] not in left]
    resolution.rest = [r for r in resolution.rest if r[0] not in left]
    resolution.params = [p for p in resolution.params if not distributed_elsewhere(p[1])]
    return left


def apply_resolution(resolution: Resolution, mesh: DeviceMesh,
                     restyle: Callable[[Any, Any], Any] | None = None) -> None:
    """``parallelize_module`` with each entry's style; ``restyle(module, style)`` may give
    another plugin's style for a module it converted (``composer_par_parallel_style``)."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    # Parameter entries first: the module styles above them (experts, local) then find
    # their weights split, and distribute only what is left.
    for _, owner, attr, spec in resolution.params:
        param = owner._parameters[attr]
        if param is None or isinstance(param, DTensor):
            continue
        placement = parameter_placement(spec.style, param.ndim, spec.split_factor)
        owner.register_parameter(attr, nn.Parameter(
            distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad))
    for _, module, spec in resolution.entries:
        style = torch_style(spec)
        parallelize_module(module, mesh, restyle(module, style) if restyle else style)


def retie(resolution: Resolution) -> int:
    """Make each tied group one parameter again: every style distributed its own copy of
    the shared tensor (validation checked that they split it the same way). Returns the
    number of registrations replaced."""
    count = 0
    for (first, first_attr), *others in resolution.ties:
        shared = first._parameters[first_attr]
        for module, attr in others:
            if module._parameters[attr] is not shared:
                module._parameters[attr] = shared
                count += 1
    return count


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
        parents = any(True for n, m in module.named_modules() if n and any(
            True for _ in m.parameters(recurse=False)))
        # A module with parameter-owning children cannot have its inputs wrapped (its
        # children would receive DTensors): its forward runs on the local values of its own
        # replicated parameters instead (validation made sure nothing below it is split).
        style = local_style("local_replicated") if parents else replicate_style()
        parallelize_module(module, mesh, style)
    return len(resolution.rest)


_REPLICATE_STYLE: Any = None
_LOCAL_IO = "_composer_par_tp_local_io"
_LOCAL_PARAMS = "_composer_par_tp_local_params"


def replicate_style() -> Any:
    """A ParallelStyle (built on first use: torch is imported lazily) that replicates a
    module's own parameters over the mesh and hands back local outputs for local inputs;
    buffers (e.g. RoPE tables) stay plain tensors. Given local inputs only, the module
    runs on its parameters' (and any DTensor buffers') local values: those inputs are the
    same on every tp rank (a replicated activation; a module on a tp-sharded one is
    'replicate_grad_allreduce'), so each rank computes the same values and the same full
    gradient, which is what the replicated parameters' gradient is. That is what DTensor
    would compute from inputs wrapped as replicated, without its dispatch on every op of
    every norm, every step, and ops DTensor cannot propagate (grouped_mm outside bf16: its
    meta kernel refuses float32) run as in one process. DTensor inputs (a
    sequence-parallel residual stream) go through DTensor."""
    global _REPLICATE_STYLE
    if _REPLICATE_STYLE is None:
        _REPLICATE_STYLE = _make_replicate_style()
    return _REPLICATE_STYLE()


def _make_replicate_style() -> type:
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    from composer_par.plugin.torch_private import tree_leaves, tree_map

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
            if not any(isinstance(t, DTensor) for t in tree_leaves(inputs)):
                # Local inputs, replicated parameters: the forward runs on local tensors
                # (the same values on every rank, the same Replicate gradients), so ops
                # that DTensor cannot propagate (grouped_mm outside bf16: its meta kernel
                # refuses float32) run as in one process.
                saved: dict[str, Any] = {}
                for table in (module._parameters, module._buffers):
                    for name, value in table.items():
                        if isinstance(value, DTensor):
                            saved[name] = value
                            table[name] = value.to_local()  # type: ignore[assignment]
                module.__dict__.setdefault(_LOCAL_PARAMS, []).append(saved)
                return inputs
            module.__dict__.setdefault(_LOCAL_PARAMS, []).append(None)
            wrapped = False

            def wrap(t: Any) -> Any:
                nonlocal wrapped
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                    wrapped = True
                    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                return t
            out = tree_map(wrap, inputs)
            # Outputs go back to local tensors only for a call that came with local ones:
            # on a residual stream kept as DTensors (sequence parallel) they stay DTensors.
            module.__dict__[_LOCAL_IO] = wrapped
            return out

        @staticmethod
        def _outputs(module: nn.Module, outputs: Any, mesh: Any) -> Any:
            stack = module.__dict__.get(_LOCAL_PARAMS) or [None]
            saved = stack.pop()
            if saved is not None:
                for name, value in saved.items():
                    table = module._parameters if name in module._parameters else module._buffers
                    table[name] = value
                return outputs
            if not module.__dict__.get(_LOCAL_IO, True):
                return outputs
            return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, outputs)

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, self._partition, self._inputs,
                                     self._outputs)

        def __repr__(self) -> str:
            return "ReplicateParallel()"

    return ReplicateParallel


_LOCAL_STYLE: Any = None
_SAVED = "_composer_par_tp_saved_params"


def local_style(kind: str, split_factor: int = 2, rope_dim: int | None = None) -> Any:
    """The ParallelStyle of one of our own styles (see :data:`LOCAL_STYLES`), built on
    first use (torch is imported lazily). ``rope_dim``: the rotary part's width, for
    ``mla_kv_a_proj``."""
    global _LOCAL_STYLE
    if _LOCAL_STYLE is None:
        _LOCAL_STYLE = _make_local_style()
    return _LOCAL_STYLE(kind, split_factor, rope_dim)


def _make_local_style() -> type:
    import inspect

    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    from composer_par.plugin import sum_gradient
    from composer_par.plugin.torch_private import tree_map

    def grad_sum(t: Any, mesh: Any) -> Any:
        """Identity forward; backward sums the gradient over tp (a replicated input that
        feeds column-split weights gets only this rank's part of its gradient)."""
        if isinstance(t, DTensor):
            if t.placements != (Replicate(),):
                t = t.redistribute(placements=[Replicate()])
            return t.to_local(grad_placements=[Partial()])
        return sum_gradient(t, mesh)

    def output_sum(t: Any, mesh: Any) -> Any:
        """Forward sums this rank's partial output over tp; backward is the identity."""
        if isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(
            placements=[Replicate()]).to_local()

    def floating(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point()

    def rotary_part_summed(output: Any, rope_dim: int | None, mesh: Any) -> Any:
        """A latent-attention projection's output with its last ``rope_dim`` features'
        gradient summed over tp: that part (the rotary key) goes to every local head
        directly, so each rank's heads give only their part of its gradient; the rest
        goes through a column-split projection, whose input gradient is summed already."""
        assert rope_dim, "mla_kv_a_proj needs rope_dim (validation fills or refuses it)"
        latent, rotary = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([latent, grad_sum(rotary, mesh)], dim=-1)

    # Styles whose forward runs on local tensors (the parameters' local parts).
    local_params = {"experts", "local", "packed_colwise", "packed_rowwise", "local_colwise",
                    "local_rowwise", "local_packed_rowwise", "replicate_grad_allreduce",
                    "local_replicated", "mla_kv_a_proj"}
    # Styles whose floating inputs get their gradient summed over tp.
    summed_inputs = {"experts", "packed_colwise", "local_colwise"}
    # Styles whose floating outputs are summed over tp.
    summed_outputs = {"experts", "all_reduce", "packed_rowwise"}
    # Styles on a module holding split layers that prepare its first input for them.
    _REGIONS = ("sequence_region", "sequence_region_local", "shared_input")
    # Regions that gather the sequence-sharded stream and shard their output back.
    _SEQUENCE_REGIONS = ("sequence_region", "sequence_region_local")

    class LocalParallel(ParallelStyle):
        def __init__(self, kind: str, split_factor: int = 2, rope_dim: int | None = None
                     ) -> None:
            super().__init__()
            self.kind = kind
            self.split_factor = split_factor
            self.rope_dim = rope_dim

        def _placement(self, name: str, param: Any) -> Any:
            if self.kind in ("packed_colwise", "packed_rowwise", "local_colwise",
                             "local_rowwise", "local_packed_rowwise"):
                return parameter_placement(self.kind, param.ndim, self.split_factor)
            return Replicate()  # experts/local/...: what no parameter entry split

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            if self.kind not in ("all_reduce", "identity_expert", *_REGIONS):
                for name, param in list(module.named_parameters(recurse=False)):
                    if isinstance(param, DTensor):
                        continue
                    module.register_parameter(name, nn.Parameter(
                        distribute_tensor(param, device_mesh, [self._placement(name, param)],
                                          src_data_rank=self.src_data_rank),
                        requires_grad=param.requires_grad))
            first = _first_argument(module) if self.kind in _REGIONS else None

            def pre(mod: nn.Module, args: Any, kwargs: Any) -> Any:
                return self._pre(mod, args, kwargs, device_mesh, first)

            def post(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
                return self._post(mod, output, device_mesh)

            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True)
            return module

        def _pre(self, module: nn.Module, args: Any, kwargs: Any, mesh: Any,
                 first: str | None) -> Any:
            kind = self.kind
            if kind in local_params:
                saved: dict[str, Any] = {}
                for name, param in module._parameters.items():
                    if isinstance(param, DTensor):
                        saved[name] = param
                        local = param.to_local()
                        if kind == "replicate_grad_allreduce":
                            # A norm on its rank's heads computes only its part of the
                            # weight gradient: it is summed over tp.
                            local = sum_gradient(local, mesh)
                        module._parameters[name] = local
                module.__dict__.setdefault(_SAVED, []).append(saved)
            if kind in summed_inputs:
                args, kwargs = tree_map(
                    lambda t: grad_sum(t, mesh) if floating(t) else (
                        t.to_local() if isinstance(t, DTensor) else t), (args, kwargs))
            elif kind in local_params and kind != "local_replicated":
                args, kwargs = tree_map(
                    lambda t: t.to_local() if isinstance(t, DTensor) else t, (args, kwargs))
            elif kind == "identity_expert" and args:
                args = (args[0] / mesh.size(), *args[1:])
            elif kind in _REGIONS:
                def gather(t: Any) -> Any:
                    if isinstance(t, DTensor) and t.placements != (Replicate(),):
                        t = t.redistribute(placements=[Replicate()])
                    if kind == "sequence_region_local" and isinstance(t, DTensor):
                        return t.to_local()
                    return t

                def share(t: Any) -> Any:
                    # One DTensor for every child: their partial input gradients add
                    # up, and its conversion back sums the total over tp once.
                    if floating(t) and not isinstance(t, DTensor):
                        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                    return t
                prepare = gather if kind in _SEQUENCE_REGIONS else share
                if args:
                    args = (prepare(args[0]), *args[1:])
                elif first in kwargs:
                    kwargs = {**kwargs, first: prepare(kwargs[first])}
            return args, kwargs

        def _post(self, module: nn.Module, output: Any, mesh: Any) -> Any:
            if self.kind in local_params:
                stack = module.__dict__.get(_SAVED) or [{}]
                module._parameters.update(stack.pop())
            if self.kind in summed_outputs:
                return tree_map(lambda t: output_sum(t, mesh) if floating(t) else t, output)
            if self.kind == "mla_kv_a_proj":
                return rotary_part_summed(output, self.rope_dim, mesh)
            if self.kind in _SEQUENCE_REGIONS:
                def shard(t: Any) -> Any:
                    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                        # A replicated result back onto the sequence-sharded stream: each
                        # rank keeps its part, no communication.
                        return DTensor.from_local(t, mesh, [Replicate()], run_check=False
                                                  ).redistribute(placements=[Shard(1)])
                    return t
                if isinstance(output, tuple) and output:
                    return (shard(output[0]), *output[1:])
                return shard(output)
            if self.kind == "shared_input":
                def local(t: Any) -> Any:
                    # Its children hand out local outputs; a DTensor computed from the
                    # shared input itself goes back as its replicated local value.
                    if isinstance(t, DTensor):
                        return t.redistribute(placements=[Replicate()]).to_local()
                    return t
                if isinstance(output, tuple) and output:
                    return (local(output[0]), *output[1:])
                return local(output)
            return output

        def __repr__(self) -> str:
            return f"LocalParallel({self.kind!r})"

    def _first_argument(module: nn.Module) -> str | None:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return params[0].name if params else None

    return LocalParallel
