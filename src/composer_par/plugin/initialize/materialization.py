"""MetaInit's work: ``to_empty``, then every module initialized children first, each
under its own seed, on full-size tensors of which each rank keeps its part."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composer_par.blocks import clean_name
from composer_par.logging import get_logger
from composer_par.plugin.initialize.constructed import Constructions
from composer_par.plugin.initialize.local_part import keep_local_part
from composer_par.plugin.initialize.lookup import (
    InitFn,
    initializer,
    initializer_name,
    owns_tensors,
)
from composer_par.plugin.initialize.seeding import module_seed, seeded
from composer_par.plugin.initialize.unwritten import (
    UninitializedError,
    plant_sentinel,
    sentinel_intact,
)
from composer_par.ties import to_empty_keeping_ties

log = get_logger(__name__)

Slot = tuple[nn.Module, str]  # a parameter registration: (module, attribute)


class InitResult(NamedTuple):
    """What one module's initialization did."""

    initialized: set[int]  # the ids of the parameters it initialized
    unwritten: list[str]  # the names of the module's parameters it left unwritten
    scratch_bytes: int  # the bytes of full-size scratch tensors it held at once


def post_order(module: nn.Module, prefix: str = "",
               seen: set[int] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """Modules children-first, the order ``nn.Module.apply`` initializes in; a module
    registered twice comes once, at its first path. ``seen``: the ids of the modules
    walked already (the walk's own, passed down as it recurses)."""
    seen = set() if seen is None else seen
    seen.add(id(module))
    for name, child in module.named_children():
        if id(child) not in seen:
            yield from post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def materialize(model: nn.Module, device: torch.device, base_seed: int,
                init_fn: str | InitFn | None = None) -> tuple[int, int]:
    """MetaInit's work: ``to_empty`` on ``device`` (ties kept), then every module
    initialized children first, as ``post_init`` / ``nn.Module.apply`` do, each under its
    own seed. With a Hugging Face model's ``_init_weights`` (and no ``init_fn``), a module
    that owns no tensors is initialized too, as ``post_init`` does: its rule may act on its
    children (GPT-2 rescales the projections of each attention and MLP). ``init_fn`` is
    called on the modules that own tensors only. Raises :class:`UninitializedError` when
    an initializer left a floating-point parameter unwritten. Returns (modules
    initialized, peak scratch bytes)."""
    order = list(post_order(model))
    to_empty_keeping_ties(model, device)
    pick = initializer(model, init_fn)
    parent_rules = init_fn is None and callable(getattr(model, "_init_weights", None))
    initialized: set[int] = set()
    count = peak = 0
    left: list[str] = []
    left_types: dict[str, str] = {}
    constructions = Constructions(base_seed)
    for path, module in order:
        owns = owns_tensors(module)
        if not owns and not parent_rules:
            continue  # no initializer acts through its children
        init = pick(module)
        if init is None:
            fresh = [n for n, p in module._parameters.items()
                     if p is not None and id(p) not in initialized]
            if owns and from_constructor(model, path, module, constructions, device,
                                         fresh, initialized):
                count += 1
            elif owns:  # validation (CP404) found it buildable; its copy did not match
                left += [f"{clean_name(path)}.{n}" for n in fresh]
                left_types.setdefault(type(module).__name__, "its constructor")
            continue
        name = clean_name(path)
        seed = module_seed(base_seed, name)
        if owns:
            result = init_module(module, init, device, seed, initialized)
        else:
            result = init_children_of(module, init, device, seed)
            if not result.initialized:
                continue  # its rule wrote nothing
        count += 1
        peak = max(peak, result.scratch_bytes)
        initialized |= result.initialized
        if result.unwritten and from_constructor(model, path, module, constructions,
                                                 device, result.unwritten, initialized):
            continue  # what its initializer left, its constructor sets
        if result.unwritten:
            left += [f"{name}.{n}" if name else n for n in result.unwritten]
            left_types.setdefault(type(module).__name__, initializer_name(init))
    if left:
        raise UninitializedError(left, left_types)
    return count, peak


def from_constructor(root: nn.Module, path: str, module: nn.Module,
                     constructions: Constructions, device: torch.device,
                     names: Collection[str], initialized: set[int]) -> bool:
    """Set the parameters ``names`` of ``module`` (at ``path`` of ``root``), and all its
    buffers, to those of the module its constructor builds on CPU
    (:mod:`.constructed`); each rank keeps its part, and the parameters are added to
    ``initialized``. False where it cannot be built again: nothing is set."""
    copy = constructions.built_like(root, path)
    if copy is None:
        return False
    with torch.no_grad():
        for name in names:
            param, value = module._parameters[name], copy._parameters[name]
            if param is None or value is None:
                continue
            keep_local_part(param, value.to(device=device, dtype=param.dtype))
            initialized.add(id(param))
        for name, buffer in module._buffers.items():
            built = copy._buffers[name]
            if buffer is not None and built is not None:
                keep_local_part(buffer, built.to(device=device, dtype=buffer.dtype))
    log.debug("initialized from its constructor", module=clean_name(path),
              kind=type(module).__name__)
    return True


def init_module(module: nn.Module, init: InitFn, device: torch.device, seed: int,
                initialized_before: Collection[int] = ()) -> InitResult:
    """Initialize ``module``'s own parameters as if they were whole, seeded with ``seed``,
    and keep this rank's part of each; the caller's random state is left as it was.

    Sharded (DTensor) parameters get full-size scratch tensors for the call; plain ones
    are written in place. ``initialized_before``: the ids of parameters initialized
    already, left as they are (a tied parameter is initialized by its first owner only,
    as transformers does). Each floating-point parameter gets a sentinel
    (:func:`~composer_par.plugin.initialize.unwritten.plant_sentinel`); those the call
    left unwritten are named in the result.
    """
    originals = {name: p for name, p in module._parameters.items() if p is not None}
    given: dict[str, nn.Parameter] = {}  # what the call sees: a scratch or the original
    sentinels: dict[str, torch.Tensor] = {}
    scratch_bytes = 0
    for name, param in originals.items():
        again = id(param) in initialized_before
        # A tied parameter its first owner initialized gets scratch even when plain, so
        # that this call's writes to it are dropped; it is not watched.
        if again or isinstance(param, DTensor):
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            given[name] = nn.Parameter(full, requires_grad=param.requires_grad)
            scratch_bytes += full.nbytes
        else:
            given[name] = param
        sentinel = None if again else plant_sentinel(given[name])
        if sentinel is not None:
            sentinels[name] = sentinel
    unwritten: list[str] = []
    done: set[int] = set()
    try:
        module._parameters.update(given)
        with seeded(device, seed), torch.no_grad():
            init(module)
            after = module._parameters
            # An initializer that registers a new Parameter instead of writing the one
            # it was given has initialized it too (its values are kept below).
            unwritten = [name for name, sentinel in sentinels.items()
                         if after[name] is given[name] and sentinel_intact(sentinel)]
            for name, original in originals.items():
                result = after[name]
                tied_again = id(original) in initialized_before or id(original) in done
                if result is None or tied_again:
                    continue  # dropped by the call, or a tied parameter initialized already
                if result is not original:
                    keep_local_part(original, result)
                done.add(id(original))
    finally:
        module._parameters.update(originals)
    return InitResult(done, unwritten, scratch_bytes)


def init_children_of(module: nn.Module, init: InitFn, device: torch.device,
                     seed: int) -> InitResult:
    """Call ``init`` on a module that owns no tensors, for what it does to its children:
    a per-module rule acting on them (GPT-2's ``_init_weights`` rescales the c_proj
    weights of each attention and MLP). A dry run over fake tensors finds the parameters
    it writes; only those get full-size scratch tensors, which start from the parameters'
    current values (it may write part of one), and each rank keeps its part of the
    result. Nothing initialized: it writes no parameter."""
    written = _written_by(module, init)
    if not written:
        return InitResult(set(), [], 0)
    with seeded(device, seed):
        return _init_gathered(module, init, written)


def _written_by(module: nn.Module, init: InitFn) -> list[Slot]:
    """The parameter registrations below ``module`` that ``init(module)`` writes, found by
    running it on fake tensors (no memory, no random draws on real data): an in-place
    write bumps a tensor's version counter, through views too. Buffers are faked as well
    and left alone (they are plain tensors, written in place by the real call)."""
    from composer_par.plugin import torch_private

    slots = [(m, n) for m in module.modules() for n, t in m._parameters.items()
             if t is not None]
    buffers = [(m, n) for m in module.modules() for n, t in m._buffers.items()
               if t is not None]
    if not slots:
        return []
    mode = torch_private.fake_tensor_mode()(allow_non_fake_inputs=False)
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
                versions[(id(m), n)] = torch_private.tensor_version(fake)
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
                if (fake is None or torch_private.tensor_version(fake)
                        != versions[(id(m), n)]) and (
                        id(real) not in seen):
                    seen.add(id(real))
                    written.append((m, n))
    finally:
        for m, n in slots:
            m._parameters[n] = originals_p[(id(m), n)]
        for m, n in buffers:
            m._buffers[n] = originals_b[(id(m), n)]
    return written


def _init_gathered(module: nn.Module, init: InitFn, slots: list[Slot]) -> InitResult:
    """``init(module)`` writing the parameters at ``slots`` (distinct registrations below
    ``module``) as whole tensors that start from their current values: a sharded one gets
    its full tensor gathered as scratch, a plain one is written in place; each rank keeps
    its part of the result."""
    originals = [(m, n, m._parameters[n]) for m, n in slots]
    done: set[int] = set()
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
                done.add(id(original))
    finally:
        for m, n, original in originals:
            m._parameters[n] = original
    return InitResult(done, [], scratch_bytes)
