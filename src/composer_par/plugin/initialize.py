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

import hashlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

InitFn = Callable[[nn.Module], None]
TieGroup = list[tuple[nn.Module, str]]


def module_seed(seed: int, path: str) -> int:
    """A per-module seed that depends on the module's name only, not on the layout."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Modules children-first, the order ``nn.Module.apply`` initializes in."""
    seen: set[int] = set()

    def walk(mod: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for name, child in mod.named_children():
            yield from walk(child, f"{path}.{name}" if path else name)
        yield path, mod

    yield from walk(module, prefix)


def owns_tensors(module: nn.Module) -> bool:
    """Whether ``module`` registers parameters or buffers of its own."""
    # The registries directly: parameters(recurse=False) builds a generator per call,
    # and this runs for every module, twice (validation, then materialization).
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
    )


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

    def pick(module: nn.Module) -> InitFn | None:
        if user is not None:
            return user
        if callable(hf_init):
            return hf_init  # type: ignore[no-any-return]
        for method in ("reset_parameters", "_reset_parameters"):
            fn = getattr(module, method, None)
            if callable(fn):
                return _call_method(fn)
        return None

    return pick


def seed_device(device: torch.device, seed: int) -> None:
    """Seed the generator that init ops on ``device`` draw from, and no other.

    ``torch.manual_seed`` would also seed every accelerator, lazily: each call records a
    stack (about a millisecond, per module), and the accelerators' states would change
    behind fork_rng, which saves only the devices it is given.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


def init_module(module: nn.Module, init: InitFn, device: torch.device, seed: int) -> int:
    """Initialize ``module``'s own parameters as if they were whole, seeded with ``seed``,
    and keep this rank's part of each; the caller's random state is left as it was.

    Sharded (DTensor) parameters get full-size scratch tensors for the call; plain ones
    are written in place. Returns the bytes of scratch tensors held at once.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_device(device, seed)
        return _init_with_full_tensors(module, init, device)


def _init_with_full_tensors(module: nn.Module, init: InitFn, device: torch.device) -> int:
    originals = {n: p for n, p in module._parameters.items() if p is not None}
    scratch_bytes = 0
    for name, param in originals.items():
        if isinstance(param, DTensor):
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
            scratch_bytes += full.numel() * full.element_size()
    try:
        with torch.no_grad():
            init(module)
            for name, original in originals.items():
                result = module._parameters[name]
                if result is not original and result is not None:
                    keep_local_part(original, result.detach())
    finally:
        for name, original in originals.items():
            module._parameters[name] = original
    return scratch_bytes


def keep_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank slices its own part locally, no communication;
        # every rank computed the same full tensor from the same seed.
        local = distribute_tensor(
            full, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def tie_groups(model: nn.Module) -> list[TieGroup]:
    """Parameters registered under several names (tied weights, e.g. an embedding shared
    with the output head), as ``[(module, attribute), ...]`` groups of two or more."""
    by_param: dict[int, TieGroup] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                by_param.setdefault(id(param), []).append((module, name))
    return [group for group in by_param.values() if len(group) > 1]


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``to_empty``, then each tied group made one parameter again: ``to_empty`` gives every
    registration its own new tensor, which silently unties them."""
    groups = tie_groups(model)
    model.to_empty(device=device)
    for (first_module, first_name), *rest in groups:
        shared = first_module._parameters[first_name]
        for module, name in rest:
            module._parameters[name] = shared
