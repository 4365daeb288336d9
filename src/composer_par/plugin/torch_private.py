"""Every private torch symbol composer_par touches, reached through this one module.

torch's public API does not cover everything composing parallelism needs: FSDP2's flat
reduce output, DTensor's strided placement and local tensor, DeviceMesh's flattening,
the context-parallel dispatcher, pipelining's lowered schedules, fake process groups
and tensors for the dry run. Each such symbol is named once here, in :data:`SYMBOLS`
(what it is, what composer_par does with it, and what each torch release changed), and
reached by a function of this module; no other module of composer_par imports a private
torch module or reads a private torch attribute (``tests/test_torch_private.py`` checks
both, and that every symbol in the catalog exists on the installed torch). The internals
of torchft the ft plugin relies on (the ``ft`` extra) are named here the same way.

Two kinds of guarantee. Every symbol is checked to exist: a torch that lacks one fails
where it is used with :class:`PrivateSymbolError`, naming the symbol and what needs it,
never with a bare ``AttributeError`` deep in a run. FSDP2's internal state is more:
composer_par relies on how FSDP2 lays out and divides its reduced gradients, which a
symbol's presence does not show, so those accessors also require a torch release in
:data:`CHECKED_TORCH`, on each of which the tests that exercise them (comm hooks, divide
factors, FSDP2 and HSDP parity, expert parallelism beside FSDP2, fault-tolerant groups,
float8) and this catalog's own checks ran green. A newer torch is refused there with
:class:`UncheckedTorchError` unless ``COMPOSER_PAR_UNCHECKED_TORCH=1`` says to go on
(a warning then names what was not checked).

Not routed here: ``nn.Module``'s own registries (``_parameters``, ``_buffers``,
``_modules``, ``_non_persistent_buffers_set``). Every module surgery in torch itself
(``swap_module``, parametrizations, FSDP) writes them directly; they are listed in the
catalog and checked like the rest.

This module imports no torch at import time: validation runs without it.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from datetime import timedelta

    import torch
    import torch.nn as nn

# (major, minor) releases of torch on which the tests that exercise FSDP2's internals ran
# green (docs/versions.md says which, and the README's table what else ran there).
CHECKED_TORCH: tuple[tuple[int, int], ...] = ((2, 13), (2, 14), (2, 15))

# Set to 1 to run FSDP2's internal accesses on a torch release not in CHECKED_TORCH.
UNCHECKED_ENV = "COMPOSER_PAR_UNCHECKED_TORCH"


@attrs.frozen
class PrivateSymbol:
    """One private torch symbol: where it lives, why composer_par needs it, and what
    each release since 2.13 changed about it (a release not named changed nothing)."""

    # "module.path:attribute" for what an import reaches; "Class.attribute" for an
    # attribute of objects torch makes (checked on live objects by the tests).
    symbol: str
    area: str
    why: str
    changes: tuple[str, ...] = ()

    @property
    def importable(self) -> bool:
        return ":" in self.symbol


_FSDP = "FSDP2 state"
_DTENSOR = "DTensor"
_MESH = "DeviceMesh and process groups"
_CP = "context-parallel dispatch"
_PIPE = "pipelining"
_COMPILE = "compile and wrappers"
_FAKE = "fake tensors and process groups"
_COUNT = "dispatch and memory tracking (testing)"
_MODULE = "module and tensor internals"
_FT = "fault-tolerant replicas (torch and torchft)"

SYMBOLS: tuple[PrivateSymbol, ...] = (
    # -- FSDP2 state: the comm hooks and gradient divide factors (release-gated) --------
    PrivateSymbol("FSDPModule._get_fsdp_state", _FSDP,
                  "the FSDP state of a fully_shard / replicate module"),
    PrivateSymbol("FSDPState._fsdp_param_groups", _FSDP,
                  "the parameter groups whose reductions comm hooks and divide factors set"),
    PrivateSymbol("FSDPParamGroup.fsdp_params", _FSDP,
                  "the parameters in a group's flat reduce output, in its order"),
    PrivateSymbol("FSDPParamGroup.gradient_divide_factor", _FSDP,
                  "what a group divides by: a comm hook divides the rest on its dim"),
    PrivateSymbol("FSDPParamGroup.mesh_info", _FSDP,
                  "the shard group's size; a replicate group's all-reduce group",
                  ("2.14: FSDPParamGroup.__init__ sets it from the placement result "
                   "(was the shard result); the same object",)),
    PrivateSymbol("torch.distributed.fsdp._fully_shard._fsdp_common:FSDPMeshInfo", _FSDP,
                  "whether a group reduce-scatters (FSDPMeshInfo.shard_mesh_size > 1)"),
    PrivateSymbol("DDPMeshInfo.replicate_process_group", _FSDP,
                  "pointed at a one-rank group so that a comm hook does the all-reduce",
                  ("2.15: foreach_reduce passes the all-reduce group for replication "
                   "too (was HSDP only); still read from this attribute",)),
    PrivateSymbol("FSDPParam.padded_sharded_param_size", _FSDP,
                  "a parameter's span in the flat reduce output"),
    PrivateSymbol("FSDPParam.sharded_size", _FSDP, "a parameter's view of the reduce output"),
    PrivateSymbol("FSDPParam.contiguous_sharded_stride", _FSDP,
                  "a parameter's view of the reduce output"),
    PrivateSymbol("FSDPParam._param_fqn", _FSDP, "the name a comm hook's bucket view gets"),
    PrivateSymbol("torch.distributed._composable.replicate_with_fsdp:replicate", _FSDP,
                  "HSDP alone: replication by FSDP2's machinery (DDP-like)"),
    PrivateSymbol("torch.distributed._composable.replicate_with_fsdp:ReplicateModule", _FSDP,
                  "telling replicated modules (which never reshard) from sharded ones"),
    PrivateSymbol("torch.distributed._composable.contract:_get_registry", _FSDP,
                  "whether torch's composable checkpoint is already on a module"),
    # -- DTensor -------------------------------------------------------------------------
    PrivateSymbol("torch.distributed.tensor.placement_types:_StridedShard", _DTENSOR,
                  "FSDP2 over TP's split, and TP's packed projections (e.g. [gate; up])",
                  ("2.14: gains _compute_padding_info and _to_partial_tensor; "
                   "constructor, dim and split_factor unchanged",)),
    PrivateSymbol("DTensor._local_tensor", _DTENSOR,
                  "the local tensor without to_local()'s autograd edge (checkpoint views)"),
    PrivateSymbol("DTensor._spec", _DTENSOR,
                  "a checkpoint view of a DTensor sharing its spec (boxed strided splits)"),
    PrivateSymbol("DTensor.__create_write_items__", _DTENSOR,
                  "DCP's protocol for a tensor that describes its own chunks"),
    PrivateSymbol("torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
                  _DTENSOR, "where this rank's part of a DTensor sits (safetensors export)"),
    PrivateSymbol("torch.distributed.tensor.debug:_clear_sharding_prop_cache", _DTENSOR,
                  "forget sharding decisions holding process groups (teardown, dry run)"),
    PrivateSymbol("torch.distributed.tensor._redistribute:_gen_transform_infos", _DTENSOR,
                  "its cache holds meshes, and meshes hold process groups (teardown)"),
    PrivateSymbol("torch.distributed.tensor._redistribute:clear_redistribute_planner_cache",
                  _DTENSOR, "its cache holds meshes (teardown)"),
    PrivateSymbol("torch.distributed.tensor._collective_utils:MeshTopoInfo", _DTENSOR,
                  "its build_from_mesh cache holds meshes (teardown)"),
    # -- DeviceMesh and process groups ---------------------------------------------------
    PrivateSymbol("DeviceMesh._flatten", _MESH,
                  "one shard dim out of several (dp_shard with cp / ep folded in)"),
    PrivateSymbol("DeviceMesh._concatenate", _MESH,
                  "the replicate dims joined to a flattened shard dim (HSDP with folds)"),
    PrivateSymbol("torch.distributed.distributed_c10d:_get_default_group", _MESH,
                  "whether a mesh dim reuses the default group (its timeout)"),
    PrivateSymbol("torch.distributed.distributed_c10d:_get_default_store", _MESH,
                  "the rendezvous store a hang's roll call writes to"),
    PrivateSymbol("torch.distributed.distributed_c10d:_resolve_process_group", _MESH,
                  "the group a functional collective names (collective counting)"),
    PrivateSymbol("torch.distributed._functional_collectives:all_to_all_single", _MESH,
                  "expert and context parallelism's all-to-alls out of place, an op "
                  "selective checkpointing can save (c10d's writes into its argument)"),
    PrivateSymbol("torch.distributed._functional_collectives:all_gather_tensor", _MESH,
                  "context parallelism's K/V gather, likewise"),
    PrivateSymbol("torch.distributed._functional_collectives:all_reduce", _MESH,
                  "expert tensor parallelism's sum of partial outputs, likewise"),
    PrivateSymbol("torch.distributed._functional_collectives:wait_tensor", _MESH,
                  "the result of a functional collective, waited for"),
    PrivateSymbol("ProcessGroup._get_backend", _MESH, "a group's backend, for its timeout"),
    PrivateSymbol("torch.distributed:ProcessGroupGloo._Options", _MESH,
                  "gloo groups made with the plan's timeout"),
    PrivateSymbol("Backend.Options._timeout", _MESH, "a group's timeout, read and written"),
    # -- context parallelism -------------------------------------------------------------
    PrivateSymbol("torch.distributed.tensor.experimental._attention:_cp_options", _CP,
                  "ring attention with the head-tail load balance CP's split makes"),
    PrivateSymbol("torch.distributed.tensor.experimental._attention:set_rotate_method", _CP,
                  "K/V rotation by all-to-all over gloo"),
    PrivateSymbol(
        "torch.distributed.tensor.experimental._attention:_enable_context_parallel_dispatcher",
        _CP, "SDPA on DTensors sharded on the sequence runs torch's ring"),
    PrivateSymbol("torch:ops.aten._scaled_dot_product_flash_attention_for_cpu", _CP,
                  "blockwise causal attention on CPU with its log-sum-exp"),
    PrivateSymbol("torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", _CP,
                  "its backward"),
    # -- pipelining ----------------------------------------------------------------------
    PrivateSymbol("PipelineScheduleMulti.pipeline_order", _PIPE,
                  "each rank's actions, for the timeline and the bubble"),
    PrivateSymbol("PipelineScheduleMulti.pipeline_order_with_comms", _PIPE,
                  "each rank's lowered actions (unshard, reshard, sends), for the estimate"),
    PrivateSymbol("_Action.computation_type", _PIPE, "what an action does"),
    PrivateSymbol("_Action.stage_index", _PIPE, "the stage an action runs"),
    PrivateSymbol("_Action.microbatch_index", _PIPE, "the micro-batch an action runs"),
    PrivateSymbol("_Action.sub_actions", _PIPE,
                  "the two halves of an overlapped forward and backward"),
    PrivateSymbol("torch.distributed.pipelining.schedules:OVERLAP_F_B", _PIPE,
                  "the action kind whose two halves the pp overlap option runs at once"),
    PrivateSymbol("_PipelineScheduleRuntime.register_custom_function", _PIPE,
                  "runs an overlapped forward and backward as the overlap option does"),
    PrivateSymbol("torch.distributed.pipelining.schedules:_wait_batch_p2p", _PIPE,
                  "an overlapped half waits for its received input, as torch's own does"),
    PrivateSymbol("PipelineScheduleMulti._stages", _PIPE,
                  "the rank's stages by index, for an overlapped half"),
    PrivateSymbol("_PipelineScheduleRuntime._assert_unsharded", _PIPE,
                  "an overlapped half waits for its stage's unshard, as torch's own does"),
    PrivateSymbol("_PipelineScheduleRuntime.fwd_recv_ops", _PIPE,
                  "the forward inputs received, which an overlapped forward waits for"),
    PrivateSymbol("_PipelineScheduleRuntime.bwd_recv_ops", _PIPE,
                  "the gradients received, which an overlapped backward waits for"),
    PrivateSymbol("_PipelineScheduleRuntime.backward_counter", _PIPE,
                  "the backwards run per stage: the last one reduces the gradients"),
    PrivateSymbol("PipelineScheduleMulti._n_microbatches", _PIPE,
                  "the microbatch count: which backward is a stage's last"),
    PrivateSymbol("PipelineScheduleMulti._maybe_compute_loss", _PIPE,
                  "the last stage's loss after an overlapped forward"),
    PrivateSymbol("PipelineScheduleMulti._maybe_get_loss", _PIPE,
                  "the loss an overlapped backward starts from"),
    # -- compile and wrappers ------------------------------------------------------------
    PrivateSymbol("torch._dynamo.eval_frame:OptimizedModule", _COMPILE,
                  "a torch.compile wrapper (parameter names gain '_orig_mod.')"),
    PrivateSymbol("Module._compiled_call_impl", _COMPILE, "a module compiled in place"),
    PrivateSymbol("OptimizedModule._orig_mod", _COMPILE, "the wrapped module's name part"),
    PrivateSymbol("torch:ops.profiler._record_function_enter_new", _COMPILE,
                  "a profiler range's start: left out of selective checkpointing's op count"),
    PrivateSymbol("torch:ops.profiler._record_function_exit", _COMPILE,
                  "a profiler range's end: left out of selective checkpointing's op count"),
    PrivateSymbol("CheckpointWrapper._checkpoint_wrapped_module", _COMPILE,
                  "the wrapped module's name part"),
    PrivateSymbol("torch._inductor:config", _COMPILE,
                  "the C++ compiler inductor will call on CPU (CP412)"),
    PrivateSymbol("torch._C:_current_graph_task_id", _COMPILE,
                  "whether code runs inside backward (recomputation under checkpointing)"),
    # -- fake tensors and process groups -------------------------------------------------
    PrivateSymbol("torch._subclasses.fake_tensor:FakeTensorMode", _FAKE,
                  "the dry run, and which parameters an initializer writes"),
    PrivateSymbol("torch._subclasses.fake_tensor:FakeTensor", _FAKE,
                  "a tensor of the dry run, which has no values to check"),
    PrivateSymbol("torch.testing._internal.distributed.fake_pg:FakeStore", _FAKE,
                  "torch's fake process group: a whole world in one process"),
    # -- testing: dispatch and memory tracking -------------------------------------------
    PrivateSymbol("torch.utils._python_dispatch:TorchDispatchMode", _COUNT,
                  "counting every collective a step issues"),
    PrivateSymbol("torch._ops:HigherOrderOperator", _COUNT,
                  "operators the collective counter passes through"),
    PrivateSymbol("OpOverload._schema", _COUNT, "a collective's name and arguments"),
    PrivateSymbol("torch.distributed._tools.mem_tracker:MemTracker", _COUNT,
                  "activation memory of a forward"),
    PrivateSymbol("torch.distributed._tools.mem_tracker:_MemRefType", _COUNT,
                  "the activation category of MemTracker's snapshots"),
    # -- module and tensor internals -----------------------------------------------------
    PrivateSymbol("torch.utils._pytree:tree_map", _MODULE,
                  "mapping over a module's nested inputs and outputs (TP styles)"),
    PrivateSymbol("torch.utils._pytree:tree_leaves", _MODULE,
                  "the tensors among a module's nested inputs (TP styles; the reduction "
                  "check's op arguments)"),
    PrivateSymbol("torch.storage:_dtype_to_storage_type_map", _MODULE,
                  "reading torch.save files without unpickling (dtype by storage name)"),
    PrivateSymbol("Tensor._version", _MODULE, "whether an initializer wrote a parameter; "
                  "whether a float8 weight changed since its scale was precomputed"),
    PrivateSymbol("Tensor._is_view", _MODULE, "a pipeline stage's outputs sent as copies"),
    PrivateSymbol("Tensor._backward_hooks", _MODULE,
                  "whether a parameter's gradient is reduced by a hook (the reduction check)"),
    PrivateSymbol("Tensor._post_accumulate_grad_hooks", _MODULE,
                  "whether a parameter's gradient is reduced by a hook (the reduction check)"),
    PrivateSymbol("Module._parameters", _MODULE, "module surgery (accessed directly)"),
    PrivateSymbol("Module._buffers", _MODULE, "module surgery (accessed directly)"),
    PrivateSymbol("Module._modules", _MODULE, "module surgery (accessed directly)"),
    PrivateSymbol("Module._non_persistent_buffers_set", _MODULE,
                  "buffers a state dict leaves out (accessed directly)"),
    # -- fault-tolerant replicas: torch's streaming format, torchft's transport layout ---
    PrivateSymbol("torch.distributed._serialization:_streaming_load", _FT,
                  "reading the state a healing replica group fetches with weights_only=True "
                  "(the stream format torchft's HTTP transport writes)"),
    PrivateSymbol("torchft.checkpointing.http_transport:HTTPTransport.recv_checkpoint", _FT,
                  "its URL layout, which the weights-only fetch follows: a staged state "
                  "whole (num_chunks=0) at <metadata><step>/full; torchft's own fetch "
                  "unpickles with weights_only=False",
                  ("torchft 0.2.0: the layout checked",)),
)

class PrivateSymbolError(RuntimeError):
    """The installed torch lacks a private symbol composer_par needs."""


class UncheckedTorchError(RuntimeError):
    """The installed torch is not one whose FSDP2 internals composer_par was checked on."""


def torch_release(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch(version: str | None = None) -> None:
    """Raise :class:`UncheckedTorchError` unless torch's release is in CHECKED_TORCH, or
    warn once when ``COMPOSER_PAR_UNCHECKED_TORCH=1`` says to go on."""
    if version is None:
        import torch

        version = torch.__version__
    if torch_release(version) in CHECKED_TORCH:
        return
    checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_TORCH)
    what = (f"torch {version}: composer_par's comm hooks, gradient divide factors and "
            "experts beside FSDP2 read FSDP2 internals (composer_par.plugin.torch_private) "
            f"checked on torch {checked}")
    if os.environ.get(UNCHECKED_ENV) == "1":
        warnings.warn(f"{what}; going on unchecked because {UNCHECKED_ENV}=1", stacklevel=3)
        return
    raise UncheckedTorchError(
        f"{what}; use a checked torch, or set {UNCHECKED_ENV}=1 to run them unchecked "
        "(then compare a few steps with one process: composer-par selfcheck)")


@functools.cache
def _checked() -> bool:
    check_torch()
    return True


def _reach(symbol: str) -> Any:
    """The object at ``"module:attr.attr"`` of :data:`SYMBOLS`, or PrivateSymbolError."""
    module_name, _, path = symbol.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        entry = next((s for s in SYMBOLS if s.symbol == symbol), None)
        why = f" (composer_par needs it for: {entry.why})" if entry else ""
        import torch

        package = module_name.partition(".")[0]
        version = torch.__version__ if package == "torch" else _version_of(package)
        raise PrivateSymbolError(
            f"{package} {version} has no {module_name}.{path}{why}: it moved or went "
            "in this release; see composer_par.plugin.torch_private") from exc
    return found


def _version_of(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name``, or PrivateSymbolError naming the catalog entry."""
    try:
        return getattr(obj, name)
    except AttributeError as exc:
        import torch

        raise PrivateSymbolError(
            f"torch {torch.__version__}: {type(obj).__name__} has no {name} "
            "(see composer_par.plugin.torch_private)") from exc


# -- FSDP2 state (release-gated) ---------------------------------------------------------


def fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP parameter groups of a ``fully_shard`` or ``replicate`` module."""
    _checked()
    state = _attribute(module, "_get_fsdp_state")()
    return list(_attribute(state, "_fsdp_param_groups"))


def divide_factor(param_group: Any) -> float | None:
    """The factor a group divides its reduced gradients by (None: torch's default)."""
    _checked()
    return _attribute(param_group, "gradient_divide_factor")


def reduce_scatters(param_group: Any) -> bool:
    """Whether a group reduce-scatters (a shard group of more than one rank)."""
    _checked()
    info = _attribute(param_group, "mesh_info")
    mesh_info = _reach("torch.distributed.fsdp._fully_shard._fsdp_common:FSDPMeshInfo")
    return isinstance(info, mesh_info) and info.shard_mesh_size > 1


def replace_replicate_group(param_group: Any, group: Any) -> None:
    """Point a replicated group's own all-reduce at ``group`` (read by that all-reduce
    alone)."""
    _checked()
    info = getattr(param_group, "mesh_info", None)
    if info is None or not hasattr(info, "replicate_process_group"):
        import torch

        raise PrivateSymbolError(
            f"torch {torch.__version__}: replicate modules have no "
            "mesh_info.replicate_process_group, which the replicate-only comm-hook path "
            "re-points (see composer_par.plugin.torch_private)")
    info.replicate_process_group = group


def reduce_output_layout(param_group: Any) -> list[tuple[str | None, int, Any, Any]]:
    """How FSDP2 lays out a group's flat reduce output, parameter by parameter:
    ``(name, padded numel, sharded size, contiguous sharded stride)``."""
    _checked()
    import torch

    return [(p._param_fqn, torch.Size(p.padded_sharded_param_size).numel(), p.sharded_size,
             p.contiguous_sharded_stride) for p in _attribute(param_group, "fsdp_params")]


def replicate() -> Any:
    """torch's ``replicate`` built on FSDP2 (the function)."""
    return _reach("torch.distributed._composable.replicate_with_fsdp:replicate")


def is_replicated(module: Any) -> bool:
    """Whether ``module`` was made by :func:`replicate` (it never reshards)."""
    cls = _reach("torch.distributed._composable.replicate_with_fsdp:ReplicateModule")
    return isinstance(module, cls)


def has_composable(module: nn.Module, name: str) -> bool:
    """Whether torch's composable API ``name`` (e.g. "checkpoint") is on ``module``."""
    registry = _reach("torch.distributed._composable.contract:_get_registry")
    return name in (registry(module) or {})


# -- DTensor -------------------------------------------------------------------------


def strided_shard() -> Any:
    """DTensor's ``_StridedShard`` placement class."""
    return _reach("torch.distributed.tensor.placement_types:_StridedShard")


def local_tensor(tensor: Any) -> torch.Tensor:
    """A DTensor's local tensor itself (no autograd edge, unlike ``to_local()``)."""
    return _attribute(tensor, "_local_tensor")


def dtensor_spec(tensor: Any) -> Any:
    """A DTensor's spec (mesh, placements, global shape), to build another on it."""
    return _attribute(tensor, "_spec")


def local_shape_and_offset(shape: Sequence[int], mesh: Any, placements: Sequence[Any]
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and global offset of a tensor of ``shape`` so placed."""
    compute = _reach(
        "torch.distributed.tensor._utils:compute_local_shape_and_global_offset")
    local, offset = compute(shape, mesh, placements)
    return tuple(local), tuple(offset)


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding and redistribution decisions: their keys and
    values hold device meshes, and a mesh holds its process groups."""
    _reach("torch.distributed.tensor.debug:_clear_sharding_prop_cache")()
    _reach("torch.distributed.tensor._redistribute:clear_redistribute_planner_cache")()
    _reach("torch.distributed.tensor._redistribute:_gen_transform_infos").cache_clear()
    _reach("torch.distributed.tensor._collective_utils:MeshTopoInfo"
           ).build_from_mesh.cache_clear()


# -- DeviceMesh and process groups ---------------------------------------------------


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh``'s dims flattened into one mesh dim called ``name``."""
    return _attribute(mesh, "_flatten")(name)


def concatenate_meshes(meshes: Sequence[Any]) -> Any:
    """One DeviceMesh whose dims are those of ``meshes`` (sub-meshes of one root)."""
    from torch.distributed.device_mesh import DeviceMesh

    return _attribute(DeviceMesh, "_concatenate")(list(meshes))


def default_group() -> Any:
    return _reach("torch.distributed.distributed_c10d:_get_default_group")()


def default_store() -> Any:
    return _reach("torch.distributed.distributed_c10d:_get_default_store")()


def resolve_group(name: str) -> Any:
    """The ProcessGroup a functional collective names by its group name."""
    return _reach("torch.distributed.distributed_c10d:_resolve_process_group")(name)


def functional_all_to_all(tensor: torch.Tensor, out_splits: list[int] | None,
                          in_splits: list[int] | None, group: Any) -> torch.Tensor:
    """``all_to_all_single`` as a functional collective, waited for: a new tensor (rows
    ``in_splits[r]`` of ``tensor`` to rank r, ``out_splits[r]`` from it; None: even), by
    an op (``_c10d_functional.all_to_all_single``) whose output selective checkpointing
    can save, where c10d's writes into its argument."""
    module = "torch.distributed._functional_collectives"
    out = _reach(f"{module}:all_to_all_single")(tensor, out_splits, in_splits, group)
    return _reach(f"{module}:wait_tensor")(out)  # type: ignore[no-any-return]


def functional_all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``tensor`` stacked on tensor dim 0 in rank order, as a functional
    collective, waited for: a new tensor, by an op selective checkpointing can save."""
    module = "torch.distributed._functional_collectives"
    out = _reach(f"{module}:all_gather_tensor")(tensor, 0, group)
    return _reach(f"{module}:wait_tensor")(out)  # type: ignore[no-any-return]


def functional_all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``tensor`` over ``group`` as a functional collective, waited for: a
    new tensor, by an op selective checkpointing can save."""
    module = "torch.distributed._functional_collectives"
    out = _reach(f"{module}:all_reduce")(tensor, "sum", group)
    return _reach(f"{module}:wait_tensor")(out)  # type: ignore[no-any-return]


def group_timeout(group: Any, device_type: str) -> timedelta | None:
    """The timeout of ``group``'s backend for ``device_type``, or None if unknown."""
    import torch

    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return None


def gloo_options(timeout: timedelta) -> Any:
    """Backend options for a new gloo group that waits ``timeout``."""
    options = _reach("torch.distributed:ProcessGroupGloo._Options")()
    options._timeout = timeout
    return options


def set_options_timeout(options: Any, timeout: timedelta) -> Any:
    """``options`` (a backend's, e.g. NCCL's) waiting ``timeout``; returned."""
    options._timeout = timeout
    return options


# -- context parallelism -------------------------------------------------------------


def enable_ring_dispatch(*, load_balance: bool, rotate: str | None) -> None:
    """Turn on torch's context-parallel SDPA dispatch for DTensors (process-wide), with
    the head-tail load balance ``load_balance`` and K/V rotation ``rotate`` ("allgather",
    "alltoall"; None: torch's default)."""
    attention = "torch.distributed.tensor.experimental._attention"
    _reach(f"{attention}:_cp_options").enable_load_balance = load_balance
    if rotate is not None:
        _reach(f"{attention}:set_rotate_method")(rotate)
    _reach(f"{attention}:_enable_context_parallel_dispatcher")()


def cpu_flash_attention() -> tuple[Any, Any]:
    """The fused CPU attention kernel and its backward, which return the log-sum-exp."""
    return (_reach("torch:ops.aten._scaled_dot_product_flash_attention_for_cpu"),
            _reach("torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward"))


# -- pipelining ----------------------------------------------------------------------


Action = tuple[tuple[str, int, "int | None"], ...]


def schedule_actions(schedule: Any, *, lowered: bool) -> list[list[Action]]:
    """Per pp rank, the actions of a multi-stage schedule built over stand-in stages, in
    the order torch runs them. Each action is its parts ``(kind, stage, micro-batch)``:
    one, or an overlapped forward and backward's two. Kinds: FORWARD, FULL_BACKWARD,
    BACKWARD_INPUT, BACKWARD_WEIGHT, and with ``lowered`` (the order with
    communication) also UNSHARD, RESHARD, SEND_F, ... (micro-batch None where an action
    has none)."""
    orders = _attribute(schedule, "pipeline_order_with_comms" if lowered else "pipeline_order")
    out = []
    for rank in range(len(orders)):
        actions = []
        for action in orders[rank]:
            if action is None:
                continue
            actions.append(tuple(
                (getattr(sub.computation_type, "name", str(sub.computation_type)),
                 sub.stage_index, sub.microbatch_index)
                for sub in getattr(action, "sub_actions", None) or (action,)))
        out.append(actions)
    return out


def on_overlapped_actions(schedule: Any, run: Any) -> None:
    """Has ``schedule`` (a lowered-schedule runtime, e.g. DualPipeV) call
    ``run(forward, backward)`` for each overlapped forward and backward, ``forward`` and
    ``backward`` being its two halves as callables that do what torch's runtime does
    for a FORWARD and a FULL_BACKWARD action (torch 2.13's ``_step_microbatches``),
    where torch's own default runs them one after the other."""
    kind = _reach("torch.distributed.pipelining.schedules:OVERLAP_F_B")

    def overlapped(action: Any, ctx: Any) -> None:
        first, second = action.sub_actions
        run(lambda: _run_forward(schedule, first, ctx),
            lambda: _run_full_backward(schedule, second, ctx))

    schedule.register_custom_function(kind, overlapped)


def _local_stages(schedule: Any) -> dict[int, Any]:
    return {stage.stage_index: stage for stage in _attribute(schedule, "_stages")}


def _wait_received(schedule: Any, received: dict[Any, Any], key: tuple[int, int]) -> None:
    if key not in received:
        raise RuntimeError(f"pipeline stage {key[0]} ran microbatch {key[1]} before "
                           "receiving its input")
    _reach("torch.distributed.pipelining.schedules:_wait_batch_p2p")(received.pop(key))


def _run_forward(schedule: Any, action: Any, ctx: Any) -> None:
    stages = _local_stages(schedule)
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    _attribute(schedule, "_assert_unsharded")(stage)
    # Two adjacent stages on one rank (a V placement) hand tensors over without a send.
    if not stage.is_first and index - 1 not in stages:
        _wait_received(schedule, schedule.fwd_recv_ops, (index, mb))
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
    _attribute(schedule, "_maybe_compute_loss")(stage, output, ctx.target_mbs, mb)
    if index + 1 in stages:
        stages[index + 1].set_local_fwd_input(output, mb)


def _run_full_backward(schedule: Any, action: Any, ctx: Any) -> None:
    stages = _local_stages(schedule)
    index, mb = action.stage_index, action.microbatch_index
    stage = stages[index]
    _attribute(schedule, "_assert_unsharded")(stage)
    if not stage.is_last and index + 1 not in stages:
        _wait_received(schedule, schedule.bwd_recv_ops, (index, mb))
    loss = _attribute(schedule, "_maybe_get_loss")(stage, mb)
    schedule.backward_counter[index] += 1
    last = schedule.backward_counter[index] == _attribute(schedule, "_n_microbatches")
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if index - 1 in stages:
        stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


# -- compile and wrappers ------------------------------------------------------------


@functools.cache  # once per process: the set is torch's, shared by every region
def uncount_profiler_ranges() -> None:
    """Selective checkpointing (torch 2.13's) counts every op of a region in forward
    and needs its recompute to call each no more often. FSDP2 enters profiler ranges by
    its state: a unit nested in a checkpointed block (expert parallelism's experts,
    sharded apart) enters "FSDP::root_pre_forward" when recomputed in backward, where no
    forward root is set, and not in forward; under a pipeline, whose backward leaves it
    gathered for the next forward, nothing makes up the difference and the first
    backward fails. Profiler ranges compute nothing: they join torch's ops the count
    leaves out (``torch.utils.checkpoint.SAC_IGNORED_OPS``, read at each op)."""
    from torch.utils import checkpoint

    for name in ("_record_function_enter_new", "_record_function_exit"):
        packet = _reach(f"torch:ops.profiler.{name}")
        checkpoint.SAC_IGNORED_OPS.update(getattr(packet, o) for o in packet.overloads())


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper or was compiled in place."""
    wrapper = _reach("torch._dynamo.eval_frame:OptimizedModule")
    return isinstance(module, wrapper) or compiled_in_place(module)


def wrapper_kind(module: nn.Module) -> str | None:
    """"compile" or "checkpoint" for a module that is torch's wrapper of another."""
    if type(module).__name__ == "OptimizedModule" or hasattr(module, "_orig_mod"):
        return "compile"
    if type(module).__name__ == "CheckpointWrapper" or hasattr(
            module, "_checkpoint_wrapped_module"):
        return "checkpoint"
    return None


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on it."""
    return getattr(module, "_compiled_call_impl", None) is not None


def inductor_cxx() -> tuple[str, ...] | None:
    """The C++ compilers inductor tries on CPU, or None for an inductor without that
    setting."""
    try:
        cxx = _reach("torch._inductor:config").cpp.cxx
    except Exception:  # importing inductor can fail in many ways: torch reports them itself
        return None
    return tuple(cxx) if isinstance(cxx, (list, tuple)) else (cxx,)


def in_backward() -> bool:
    """Whether autograd is running a backward now (a checkpointed block recomputing)."""
    return int(_reach("torch._C:_current_graph_task_id")()) != -1


# -- fake tensors and process groups -------------------------------------------------


def fake_tensor_mode() -> Any:
    return _reach("torch._subclasses.fake_tensor:FakeTensorMode")


def has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values to read: not on the meta device, not fake."""
    return tensor.device.type != "meta" and not isinstance(
        tensor, _reach("torch._subclasses.fake_tensor:FakeTensor"))


def fake_store() -> Any:
    """torch's fake store; importing its module registers the "fake" backend."""
    return _reach("torch.testing._internal.distributed.fake_pg:FakeStore")


# -- testing: dispatch and memory tracking -------------------------------------------


def torch_dispatch_mode() -> Any:
    return _reach("torch.utils._python_dispatch:TorchDispatchMode")


def higher_order_operator() -> Any:
    return _reach("torch._ops:HigherOrderOperator")


def op_schema(func: Any) -> tuple[str, tuple[str, ...]]:
    """An operator overload's qualified name and its argument names, in order."""
    schema = _attribute(func, "_schema")
    return schema.name, tuple(a.name for a in schema.arguments)


def mem_tracker() -> tuple[Any, Any]:
    """torch's ``MemTracker`` and the activation key of its snapshots."""
    module = "torch.distributed._tools.mem_tracker"
    return _reach(f"{module}:MemTracker"), _reach(f"{module}:_MemRefType").ACT


# -- module and tensor internals -----------------------------------------------------


def tree_map(fn: Any, tree: Any) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts."""
    return _reach("torch.utils._pytree:tree_map")(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts, in order."""
    return list(_reach("torch.utils._pytree:tree_leaves")(tree))


def storage_dtypes() -> dict[str, Any]:
    """Storage type name in a pickle -> dtype: torch.save's own table, read backwards."""
    table = _reach("torch.storage:_dtype_to_storage_type_map")()
    return {name: dtype for dtype, name in table.items()}


def tensor_version(tensor: torch.Tensor) -> int:
    """A tensor's version counter: every in-place write bumps it, through views too."""
    return int(tensor._version)


def has_gradient_hooks(tensor: torch.Tensor) -> bool:
    """Whether hooks run on ``tensor``'s gradient (``register_hook`` or
    ``register_post_accumulate_grad_hook``): torch keeps no public list of them."""
    return bool(getattr(tensor, "_post_accumulate_grad_hooks", None)
                or getattr(tensor, "_backward_hooks", None))


def is_view(tensor: torch.Tensor) -> bool:
    return bool(tensor._is_view())


# -- fault-tolerant replicas -------------------------------------------------------------


def streaming_load(stream: Any) -> Any:
    """What torch's streaming save wrote to ``stream`` (a torchft checkpoint transfer),
    read with the weights-only unpickler: tensors, numbers, strings and containers only."""
    return _reach("torch.distributed._serialization:_streaming_load")(stream, weights_only=True)


def torchft_checkpoint_url(metadata: str, step: int) -> str:
    """Where torchft's HTTP transport serves the whole state it staged for ``step``
    (``metadata``: the serving transport's, its address)."""
    _reach("torchft.checkpointing.http_transport:HTTPTransport.recv_checkpoint")
    return f"{metadata}{step}/full"

