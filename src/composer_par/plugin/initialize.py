"""Layout-invariant initialization, shared by every plugin that materializes a model
(MetaInit, and the loaders for the tensors their files lack).

The same seed gives bitwise the same full tensors on any mesh layout: each module,
children before parents (:func:`post_order`), is initialized by the call
:func:`initializer` picks for it, under a generator seeded from (seed, module path)
(:func:`module_seed`), with full-size scratch tensors of which each rank keeps its part
(:func:`init_module`).

Plugins import this module inside their hooks, never at their top (it imports torch at
its own top: its helpers run for every module of the model and must not import anything
per call).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import inspect
import math
import operator
import types
from collections.abc import Callable, Iterable, Iterator
from itertools import compress, repeat
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from composer_par import ties
from composer_par.blocks import clean_name
from composer_par.logging import get_logger

log = get_logger(__name__)

InitFn = Callable[[nn.Module], None]


def module_seed(seed: int, path: str) -> int:
    """A per-module seed that depends on the module's name only, not on the layout."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Modules children-first, the order ``nn.Module.apply`` initializes in; a module
    registered twice comes once, at its first path."""
    # An explicit stack: nested generators pay for every level of depth at each module
    # yielded, and this walk runs over every module twice per apply.
    seen = {id(module)}
    stack = [(prefix, module, iter(module._modules.items()))]
    while stack:
        path, mod, children = stack[-1]
        for name, child in children:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append((f"{path}.{name}" if path else name, child,
                              iter(child._modules.items())))
                break
        else:
            stack.pop()
            yield path, mod


def owns_tensors(module: nn.Module) -> bool:
    """Whether ``module`` registers parameters or buffers of its own."""
    # The registries directly, in plain loops: parameters(recurse=False) and any() each
    # build a generator per call, and this runs for every module, twice (validation,
    # then materialization).
    for param in module._parameters.values():
        if param is not None:
            return True
    for buffer in module._buffers.values():  # noqa: SIM110 (any() builds a generator)
        if buffer is not None:
            return True
    return False


def resolve_init_fn(init_fn: str | InitFn | None) -> InitFn | None:
    """A user's ``init_fn``: a callable, or ``"module:function"`` imported now (raising
    ImportError or AttributeError when it cannot be)."""
    if init_fn is None or callable(init_fn):
        return init_fn
    module_name, _, attr = init_fn.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _call_method(method: Callable[[], Any]) -> InitFn:
    """An InitFn for a module's own init method (it takes the module; the method has it)."""

    def init(_module: nn.Module) -> None:
        method()

    return init


def initializer(root: nn.Module, init_fn: str | InitFn | None = None
                ) -> Callable[[nn.Module], InitFn | None]:
    """For each module of ``root``, the call that initializes it, or None if there is none:
    ``init_fn`` when given, else a Hugging Face model's ``_init_weights``, else the
    module's ``reset_parameters()`` (or ``_reset_parameters()``)."""
    user = resolve_init_fn(init_fn)
    hf_init = getattr(root, "_init_weights", None)
    if user is not None:
        return lambda module: user
    if callable(hf_init):
        return lambda module: hf_init  # type: ignore[no-any-return]
    # By class: a plain function the class defines is called with the module, which is
    # what the bound method does, without making a bound method and a closure per module
    # (this runs for every module, at validation and at materialization).
    by_class: dict[type, InitFn | None] = {}

    def pick(module: nn.Module) -> InitFn | None:
        own = module.__dict__
        if "reset_parameters" not in own and "_reset_parameters" not in own:
            cls = type(module)
            if cls not in by_class:
                by_class[cls] = _class_init(cls)
            found = by_class[cls]
            if found is not _BOUND:
                return found
        for method in ("reset_parameters", "_reset_parameters"):
            fn = getattr(module, method, None)
            if callable(fn):
                return _call_method(fn)
        return None

    return pick


def without_initializer(root: nn.Module, modules: Iterable[nn.Module],
                        init_fn: str | InitFn | None = None) -> list[nn.Module]:
    """The modules among ``modules`` (of ``root``) that own parameters or buffers and
    that :func:`initializer` finds no initializer for. Raises as :func:`resolve_init_fn`
    does for an ``init_fn`` that cannot be imported."""
    pick = initializer(root, init_fn)
    modules = list(modules)
    # Validation asks this of every module on every apply. Where no module sets its own
    # initializer (an instance attribute, which pick looks at first), pick answers by
    # class: the modules of a class with an initializer are passed over without a call
    # each (the tests run in C: no Python runs per module). The others, and every
    # module when one sets its own, ask pick.
    instance_dicts = list(map(vars, modules))
    overridden = any(map(operator.contains, instance_dicts, repeat("reset_parameters"))) or any(
        map(operator.contains, instance_dicts, repeat("_reset_parameters")))
    if not overridden:
        # A class attribute that is callable is what pick calls (bound per module when
        # it is not a plain function); a class with none is left to pick.
        covered = {cls for cls in set(map(type, modules))
                   if callable(getattr(cls, "reset_parameters", None))
                   or callable(getattr(cls, "_reset_parameters", None))}
        modules = list(compress(modules, map(operator.not_, map(
            covered.__contains__, map(type, modules)))))
    return [module for module in modules if owns_tensors(module) and pick(module) is None]


def _bound(_module: nn.Module) -> None:  # a marker: look the method up on the module
    raise AssertionError("never called")


_BOUND: InitFn = _bound


def _class_init(cls: type) -> InitFn | None:
    """The function a module of ``cls`` is initialized by (``reset_parameters``, else
    ``_reset_parameters``), None if neither exists, or :data:`_BOUND` when the method is
    not a plain function (a staticmethod, a descriptor): then it is bound per module."""
    for method in ("reset_parameters", "_reset_parameters"):
        static = inspect.getattr_static(cls, method, None)
        if static is None:
            continue
        if isinstance(static, types.FunctionType):
            return static
        return _BOUND
    return None


# What initialization on a device draws from: the devices ``fork_rng`` must save (the
# CPU's generator is always saved), and the generator to seed.
Rng = tuple[list[torch.device], torch.Generator]


def rng_of(device: torch.device) -> Rng:
    """The random state that init ops on ``device`` draw from, and no other (asked once
    per materialization: ``torch.device.type`` builds a new string on every read).

    ``torch.manual_seed`` would also seed every accelerator, lazily: each call records a
    stack (about a millisecond, per module), and the accelerators' states would change
    behind fork_rng, which saves only the devices it is given.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [device], torch.cuda.default_generators[index]
    return [], torch.random.default_generator


Slot = tuple[nn.Module, str]  # a parameter registration: (module, attribute)


class InitTarget(NamedTuple):
    """What :func:`init_module` needs to know about the device it initializes on, worked
    out once per materialization (:func:`init_target`): it runs for every module."""

    device: torch.device
    rng: Rng
    # The dtype ``torch.empty(shape)`` gives on ``device`` with no other argument; None
    # where it would not land on ``device``. Scratch tensors of that dtype are made
    # without torch.empty's keyword arguments, whose parsing costs about a sixth of the
    # call (measured: 19.2 k instructions against 16.5 k).
    plain_dtype: torch.dtype | None
    # torch's own initializers that write every parameter their class registers, by
    # class: (the function, the parameter names). Parameters they initialize need no
    # sentinel. Empty where torch.nn.init's functions have been replaced.
    complete: dict[type, tuple[Callable[..., None], frozenset[str]]]


# torch classes whose reset_parameters writes every parameter the class registers (read
# in torch's source: Linear and LayerNorm write weight and bias, Embedding and RMSNorm
# their weight), and the torch.nn.init functions those methods call. A subclass is not
# trusted (it may register more), nor is a method or init function someone replaced
# (transformers' no_init_weights swaps torch.nn.init's functions for no-ops).
_COMPLETE_INITIALIZERS = {nn.Linear: ("weight", "bias"), nn.Embedding: ("weight",),
                          nn.LayerNorm: ("weight", "bias"), nn.RMSNorm: ("weight",)}
_TORCH_INIT_CALLS = ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_",
                     "_calculate_fan_in_and_fan_out")


def _complete_initializers() -> dict[type, tuple[Callable[..., None], frozenset[str]]]:
    """The entries of :data:`_COMPLETE_INITIALIZERS` that are torch's own code now."""
    if any(getattr(getattr(nn.init, name, None), "__module__", None) != "torch.nn.init"
           for name in _TORCH_INIT_CALLS):
        return {}
    found: dict[type, tuple[Callable[..., None], frozenset[str]]] = {}
    for cls, names in _COMPLETE_INITIALIZERS.items():
        method = cls.__dict__.get("reset_parameters")
        if (isinstance(method, types.FunctionType)
                and method.__module__.startswith("torch.nn.modules.")
                and method.__qualname__ == f"{cls.__name__}.reset_parameters"):
            found[cls] = (method, frozenset(names))
    return found


def init_target(device: torch.device) -> InitTarget:
    """:class:`InitTarget` for ``device``, as things stand now (default dtype and device,
    torch.nn.init's functions)."""
    plain = torch.get_default_dtype() if torch.get_default_device() == device else None
    return InitTarget(device, rng_of(device), plain, _complete_initializers())


def init_module(module: nn.Module, init: InitFn, device: torch.device, seed: int,
                done: set[int] | None = None, unwritten: list[str] | None = None,
                target: InitTarget | None = None) -> int:
    """Initialize ``module``'s own parameters as if they were whole, seeded with ``seed``,
    and keep this rank's part of each; the caller's random state is left as it was.

    Sharded (DTensor) parameters get full-size scratch tensors for the call; plain ones
    are written in place. ``done`` holds the ids of parameters initialized already (a
    tied parameter is initialized by its first owner only, as transformers does); the ids
    of those initialized here are added. ``unwritten``, when given, gets the name of each
    floating-point parameter the call left unwritten: a sentinel (a NaN) is planted in
    each one's first element, which an initializer that writes the tensor overwrites.
    One that skips the module (transformers' _init_weights for a class it does not know)
    leaves it, and the parameter is reported instead of training from whatever memory
    to_empty left. torch's own initializer of a torch class (``nn.Linear``'s
    ``reset_parameters``) writes every parameter the class registers and is not watched.
    ``target``: :func:`init_target` ``device``, when the caller has it. Returns the bytes
    of scratch tensors held at once.
    """
    target = init_target(device) if target is None else target
    devices, generator = target.rng
    plain = target.plain_dtype
    # One pass over the registry sets everything up (this runs for every module of the
    # model): the originals to put back, the scratch tensors, the sentinels.
    registry = module._parameters
    if unwritten is not None:
        complete = target.complete.get(type(module))
        if complete is not None and init is complete[0] and registry.keys() <= complete[1]:
            unwritten = None
    originals: list[tuple[str, nn.Parameter]] = []
    watched: list[tuple[str, torch.Tensor, Sentinel]] = []
    scratch_bytes = 0
    given: torch.Tensor  # what is registered during the call: the scratch or the original
    try:
        for name, param in registry.items():
            if param is None:
                continue
            originals.append((name, param))
            # A tied parameter its first owner initialized gets scratch even when plain, so
            # that this call's writes to it are dropped; it is not watched.
            again = done is not None and id(param) in done
            if again or isinstance(param, DTensor):
                dtype = param.dtype
                full = (torch.empty(param.shape) if dtype is plain else
                        torch.empty(param.shape, dtype=dtype, device=device))
                registry[name] = given = (nn.Parameter(full) if param.requires_grad else
                                          nn.Parameter(full, requires_grad=False))
                scratch_bytes += full.nbytes
                if again:
                    continue
            else:
                full = given = param
            if unwritten is not None and full.dtype.is_floating_point and full.numel():
                mark = plant_sentinel(full)
                if mark is not None:
                    watched.append((name, given, mark))
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            generator.manual_seed(seed)
            init(module)
            after = module._parameters
            # An initializer that registers a new Parameter instead of writing the one
            # it was given has initialized it too (its values are kept below).
            for name, given, mark in watched:  # filled only when unwritten is given
                if after[name] is given and sentinel_intact(mark):
                    unwritten.append(name)  # type: ignore[union-attr]
            for name, original in originals:
                result = after[name]
                if result is None or (done is not None and id(original) in done):
                    continue  # a tied parameter its first owner initialized
                if result is not original:
                    # Under no_grad the scratch parameter is copied from as it is: a
                    # detach per parameter would cost a tensor each.
                    keep_local_part(original, result)
                if done is not None:
                    done.add(id(original))
    finally:
        after = module._parameters
        for name, original in originals:
            after[name] = original
    return scratch_bytes


def init_children_of(module: nn.Module, init: InitFn, device: torch.device, seed: int,
                     done: set[int] | None = None) -> int:
    """Call ``init`` on a module that owns no tensors, for what it does to its children:
    a per-module rule acting on them (GPT-2's ``_init_weights`` rescales the c_proj
    weights of each attention and MLP). A dry run over fake tensors finds the parameters
    it writes; only those get full-size scratch tensors, which start from the parameters'
    current values (it may write part of one), and each rank keeps its part of the
    result. Returns the bytes of scratch tensors held at once (0: it wrote nothing)."""
    written = _written_by(module, init)
    if not written:
        return 0
    devices, generator = rng_of(device)
    with torch.random.fork_rng(devices=devices):
        generator.manual_seed(seed)
        return _init_gathered(module, init, written, done)


def _written_by(module: nn.Module, init: InitFn) -> list[Slot]:
    """The parameter registrations below ``module`` that ``init(module)`` writes, found by
    running it on fake tensors (no memory, no random draws on real data): an in-place
    write bumps a tensor's version counter, through views too. Buffers are faked as well
    and left alone (they are plain tensors, written in place by the real call)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    slots = [(m, n) for m in module.modules() for n, t in m._parameters.items()
             if t is not None]
    buffers = [(m, n) for m in module.modules() for n, t in m._buffers.items()
               if t is not None]
    if not slots:
        return []
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    originals_p = {(id(m), n): m._parameters[n] for m, n in slots}
    originals_b = {(id(m), n): m._buffers[n] for m, n in buffers}
    fakes: dict[int, torch.Tensor] = {}
    versions: dict[tuple[int, str], int] = {}
    written: list[Slot] = []
    try:
        with mode:
            for m, n in slots:
                real = m._parameters[n]
                assert real is not None
                if id(real) not in fakes:  # tied: one fake for one parameter
                    fakes[id(real)] = nn.Parameter(
                        torch.empty(real.shape, dtype=real.dtype), requires_grad=False)
                m._parameters[n] = fakes[id(real)]  # type: ignore[assignment]
            for m, n in buffers:
                real_b = m._buffers[n]
                assert real_b is not None
                m._buffers[n] = torch.empty(real_b.shape, dtype=real_b.dtype)
            for m, n in slots:
                fake = m._parameters[n]
                assert fake is not None
                versions[(id(m), n)] = fake._version
            try:
                with torch.no_grad():
                    init(module)
            except Exception as exc:  # a rule that needs real data: it cannot be traced
                log.warning("initializer not traced for its children", module=type(
                    module).__name__, error=str(exc)[:200])
                return []
            seen: set[int] = set()
            for m, n in slots:
                fake = m._parameters[n]
                real = originals_p[(id(m), n)]
                if (fake is None or fake._version != versions[(id(m), n)]) and (
                        id(real) not in seen):
                    seen.add(id(real))
                    written.append((m, n))
    finally:
        for m, n in slots:
            m._parameters[n] = originals_p[(id(m), n)]
        for m, n in buffers:
            m._buffers[n] = originals_b[(id(m), n)]
    return written


def _init_gathered(module: nn.Module, init: InitFn, slots: list[Slot],
                   done: set[int] | None) -> int:
    """``init(module)`` writing the parameters at ``slots`` (distinct registrations below
    ``module``) as whole tensors that start from their current values: a sharded one gets
    its full tensor gathered as scratch, a plain one is written in place; each rank keeps
    its part of the result. Returns the bytes of scratch tensors."""
    originals = [(m, n, m._parameters[n]) for m, n in slots]
    scratch_bytes = 0
    try:
        for m, n, param in originals:
            if isinstance(param, DTensor):
                full = param.full_tensor()
                m._parameters[n] = nn.Parameter(full, requires_grad=param.requires_grad)
                scratch_bytes += full.nbytes
        with torch.no_grad():
            init(module)
            for m, n, original in originals:
                result = m._parameters[n]
                if original is None or result is None:
                    continue
                if result is not original:
                    keep_local_part(original, result)
                if done is not None:
                    done.add(id(original))
    finally:
        for m, n, original in originals:
            m._parameters[n] = original
    return scratch_bytes


# NaN bit patterns with a payload no arithmetic produces, by element size (0x7FC1 is a NaN
# in both bfloat16 and float16, 0x7F in both float8 kinds): an element still holding one
# after its initializer ran was not written.
_SENTINEL_BITS = {8: 0x7FF8_0000_00C0_FFEE, 4: 0x7FC0_FFEE, 2: 0x7FC1, 1: 0x7F}
_UINT = {8: ctypes.c_uint64, 4: ctypes.c_uint32, 2: ctypes.c_uint16, 1: ctypes.c_uint8}
_SENTINELS: dict[torch.dtype, tuple[Any, int] | None] = {}

# A planted sentinel: (a ctypes cell over the element's bytes, the bits it was given),
# or (a one-element view of the tensor, None) where it holds a plain NaN instead.
Sentinel = tuple[Any, "int | None"]


def _sentinel_kind(dtype: torch.dtype) -> tuple[Any, int] | None:
    """The unsigned ctypes type of ``dtype``'s size and its sentinel bits, where those bits
    are a NaN of ``dtype`` (checked once per dtype); None where they are not (a float8
    kind whose 0x7F is a number), for which a NaN is written through a view instead."""
    try:
        return _SENTINELS[dtype]
    except KeyError:
        pass
    size = dtype.itemsize
    kind: tuple[Any, int] | None = None
    if size in _SENTINEL_BITS:
        probe = torch.zeros(1, dtype=dtype)
        _UINT[size].from_address(probe.data_ptr()).value = _SENTINEL_BITS[size]
        try:
            if bool(torch.isnan(probe.to(torch.float32))):
                kind = (_UINT[size], _SENTINEL_BITS[size])
        except (RuntimeError, TypeError):  # no conversion on this build: the plain NaN
            pass
    _SENTINELS[dtype] = kind
    return kind


def plant_sentinel(tensor: torch.Tensor) -> Sentinel | None:
    """Write a NaN into ``tensor``'s first element (floating point, non-empty), to tell
    with :func:`sentinel_intact` whether anything wrote it since; None for a dtype that
    has no NaN and cannot be filled (float4: such a parameter goes unwatched).

    On CPU the element's bytes are written and read in place (a few hundred nanoseconds;
    this runs for every parameter of the model); elsewhere through a one-element view
    (a device read per parameter)."""
    kind = None
    if tensor.is_cpu:
        dtype = tensor.dtype
        kind = _SENTINELS[dtype] if dtype in _SENTINELS else _sentinel_kind(dtype)
    if kind is not None:
        cell = kind[0].from_address(tensor.data_ptr())
        cell.value = kind[1]
        return cell, kind[1]
    flat = tensor.detach().view(-1)[:1]
    try:
        flat.fill_(float("nan"))
    except RuntimeError:  # NotImplementedError too
        return None
    return flat, None


def sentinel_intact(sentinel: Sentinel) -> bool:
    """Whether the element :func:`plant_sentinel` wrote still holds its NaN."""
    where, bits = sentinel
    if bits is not None:
        return bool(where.value == bits)
    return math.isnan(where.item())


def materialize(model: nn.Module, device: torch.device, base_seed: int,
                init_fn: str | InitFn | None = None) -> tuple[int, int]:
    """MetaInit's work: ``to_empty`` on ``device`` (ties kept), then every module
    initialized children first, as ``post_init`` / ``nn.Module.apply`` do, each under its
    own seed. With a Hugging Face model's ``_init_weights`` (and no ``init_fn``), a module
    that owns no tensors is initialized too, as ``post_init`` does: its rule may act on its
    children (GPT-2 rescales the projections of each attention and MLP). ``init_fn`` is
    called on the modules that own tensors only. Returns (modules initialized, peak scratch
    bytes)."""
    order = list(post_order(model))
    tied = ties.to_empty_keeping_ties(model, device)
    pick = initializer(model, init_fn)
    parent_rules = init_fn is None and callable(getattr(model, "_init_weights", None))
    count = peak = 0
    # What was initialized already matters only for a parameter registered twice: kept
    # only where the model has one.
    done: set[int] | None = set() if tied else None
    left: list[str] = []
    left_types: dict[str, str] = {}
    target = init_target(device)
    for path, module in order:
        owns = owns_tensors(module)
        if not owns and not parent_rules:
            continue  # no initializer acts through its children
        init = pick(module)
        if init is None:
            continue
        name = clean_name(path)
        seed = module_seed(base_seed, name)
        if owns:
            unwritten: list[str] = []
            used = init_module(module, init, device, seed, done, unwritten, target)
            peak = used if used > peak else peak
            count += 1
            if unwritten:
                left += [f"{name}.{n}" if name else n for n in unwritten]
                left_types.setdefault(type(module).__name__, _init_name(init, module))
        elif parent_rules and any(True for _ in module.children()):
            used = init_children_of(module, init, device, seed, done)
            if used:
                peak = max(peak, used)
                count += 1
    if left:
        raise UninitializedError(left, left_types)
    return count, peak


class UninitializedError(RuntimeError):
    """Parameters their module's initializer did not write (they would train from
    whatever memory ``to_empty`` left)."""

    def __init__(self, names: list[str], by_type: dict[str, str]) -> None:
        self.names = names
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        how = "; ".join(f"{cls} by {init}" for cls, init in by_type.items())
        super().__init__(
            f"{len(names)} parameter(s) were left uninitialized: {shown} (initialized by "
            f"{how}, which did not write them: they would train from whatever memory "
            "to_empty left). Fix: make their initializer write them (the module's "
            "reset_parameters(), or MetaInit(init_fn=...), which is called on every module "
            "that owns tensors in place of the model's _init_weights), or load them from a "
            "checkpoint (LoadSafetensors / LoadCheckpoint)")


def _init_name(init: InitFn, module: nn.Module) -> str:
    owner = getattr(init, "__self__", None)
    name = getattr(init, "__qualname__", getattr(init, "__name__", repr(init)))
    if owner is not None:
        return f"{type(owner).__name__}.{getattr(init, '__name__', name)}"
    if name.endswith("_call_method.<locals>.init"):
        return f"{type(module).__name__}.reset_parameters"
    if isinstance(init, types.FunctionType) and init.__name__ in (
            "reset_parameters", "_reset_parameters"):
        return f"{type(module).__name__}.{init.__name__}"
    return str(name)


def keep_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    if isinstance(target, DTensor):
        local_target = target.to_local()
        local = _local_slice(full, target)
        if local is None or local.shape != local_target.shape:
            # src_data_rank=None: every rank slices its own part locally, no
            # communication; every rank computed the same full tensor from the same seed.
            local = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
        local_target.copy_(local)
    else:
        target.copy_(full)


def _local_slice(full: torch.Tensor, target: DTensor) -> torch.Tensor | None:
    """This rank's part of ``full`` under ``target``'s placements, as a view, for the
    plain placements (``Shard`` and ``Replicate``, applied mesh dim by mesh dim as DTensor
    does, each split in ``torch.chunk``'s sizes); None for any other placement, which the
    caller hands to ``distribute_tensor``. It is DTensor's own split without building a
    DTensor per parameter: that dispatch was most of the cost of initializing a
    sharded model (measured in benchmarks/bench_apply.py)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coordinate = target.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    part = full
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or isinstance(placement, _StridedShard):
            return None
        dim = placement.dim if placement.dim >= 0 else placement.dim + part.dim()
        count = target.device_mesh.size(mesh_dim)
        size = part.size(dim)
        step = -(-size // count)  # torch.chunk's chunk size; the last chunks may be short
        start = min(step * coordinate[mesh_dim], size)
        part = part.narrow(dim, start, min(step, size - start))
    return part


def strided_alone(placements: Any) -> bool:
    """A strided split that is not FSDP2's own (``_StridedShard(d)`` on the shard dim over
    ``Shard(d)`` on an inner dim): TP's packed projections, each rank holding a slice of
    each packed part. A rank's part is then several boxes of the tensor, while DTensor
    describes it to DCP as one: checkpoints describe it box by box
    (:mod:`composer_par.checkpoint.strided`), and the safetensors export gathers it whole."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for i, placement in enumerate(placements):
        if isinstance(placement, _StridedShard) and not any(
                isinstance(p, Shard) and not isinstance(p, _StridedShard)
                and p.dim == placement.dim for p in placements[i + 1:]):
            return True
    return False

