"""MetaInit: ``to_empty`` on the target device, then layout-invariant initialization.

The same seed gives bitwise the same full parameters on any mesh layout and world
size. Calling ``reset_parameters`` on sharded parameters cannot give that: random ops
on a DTensor draw per local shard (on CPU every rank even draws the same numbers), so
the values would depend on the layout. Instead each module, children before parents
(as ``nn.Module.apply``), gets full-size scratch tensors for its own parameters, is
initialized under a generator seeded from (seed, module path), and each rank keeps
only its shard of the result. A rank holds one module's full parameters at a time.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.blocks import clean_name
from composer_par.plugin import Plugin, hookimpl
from composer_par.validate import Finding

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.apply_context import ApplyContext

InitFn = Callable[["nn.Module"], None]


def _init_fn(value: Any) -> str | InitFn | None:
    if value is None or callable(value):
        return value
    if isinstance(value, str) and ":" in value:
        return value
    raise TypeError(f"init_fn must be a callable or 'module:function'; got {value!r}")


def _seed(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63); got {value!r}")


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


def _call_method(method: Callable[[], Any]) -> InitFn:
    """An InitFn for a module's own init method (it takes the module; the method has it)."""

    def init(_module: nn.Module) -> None:
        method()

    return init


TieGroup = list[tuple["nn.Module", str]]


def tie_groups(model: nn.Module) -> list[TieGroup]:
    """Parameters registered under several names (tied weights, e.g. an embedding shared
    with the output head), as ``[(module, attribute), ...]`` groups of two or more."""
    by_param: dict[int, TieGroup] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                by_param.setdefault(id(param), []).append((module, name))
    return [group for group in by_param.values() if len(group) > 1]


def retie(groups: list[TieGroup]) -> None:
    """Make each group one parameter again: ``to_empty`` replaces every registration with
    its own new tensor, which silently unties them."""
    for (first_module, first_name), *rest in groups:
        shared = first_module._parameters[first_name]
        for module, name in rest:
            module._parameters[name] = shared


def _own_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


@attrs.frozen
class MetaInit(Plugin):
    """Materialize a meta-built model and initialize it identically on every layout.

    Options: ``seed``; ``device`` (default: the plan's device); ``init_fn`` (a callable
    or ``"module:function"`` taking one module, called children-first on each module that
    owns tensors). Without ``init_fn`` a Hugging Face model's ``_init_weights`` is used,
    else each module's ``reset_parameters()`` (or ``_reset_parameters()``). A module that
    owns parameters or buffers and has none of these is validation error CP404.
    """

    name: ClassVar[str] = "meta_init"
    provides: ClassVar[frozenset[str]] = frozenset({"materialize"})

    seed: int = attrs.field(default=0, validator=_seed)
    device: str | None = None
    init_fn: str | InitFn | None = attrs.field(default=None, converter=_init_fn)

    # -- which function initializes a module --------------------------------------------

    def _resolve_init_fn(self) -> InitFn | None:
        if self.init_fn is None or callable(self.init_fn):
            return self.init_fn
        module_name, _, attr = self.init_fn.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]

    def initializer(self, root: nn.Module) -> Callable[[nn.Module], InitFn | None]:
        """For each module, the call that initializes it, or None if there is none."""
        user = self._resolve_init_fn()
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

    # -- hooks -----------------------------------------------------------------------

    @hookimpl
    def composer_par_validate_model(self, model: nn.Module) -> list[Finding]:
        try:
            pick = self.initializer(model)
        except (ImportError, AttributeError) as exc:
            return [Finding("CP404", f"init_fn {self.init_fn!r} cannot be imported: {exc}",
                            fix="give init_fn as 'importable.module:function'")]
        found = []
        for path, module in post_order(model):
            if _own_tensors(module) and pick(module) is None:
                owned = [n for n, _ in module.named_parameters(recurse=False)]
                owned += [n for n, _ in module.named_buffers(recurse=False)]
                found.append(Finding(
                    "CP404",
                    f"module {clean_name(path) or '<root>'} ({type(module).__name__}) owns "
                    f"{', '.join(owned)} but has no reset_parameters(), so MetaInit cannot "
                    "initialize it",
                    fix=f"give {type(module).__name__} a reset_parameters() that initializes "
                    "its own tensors (buffers too), or pass MetaInit(init_fn=...)",
                ))
        return found

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        where = self.device or "the plan's device"
        return [("materialize", f"to_empty on {where}; initialize every module from seed "
                 f"{self.seed}, identical on any layout")]

    @hookimpl
    def composer_par_materialize(self, ctx: ApplyContext) -> str:
        import torch

        device = torch.device(self.device) if self.device else ctx.device
        model = ctx.model
        ties = tie_groups(model)
        model.to_empty(device=device)
        retie(ties)
        pick = self.initializer(model)
        count = 0
        peak = 0
        devices = [device] if device.type == "cuda" else []
        for path, module in post_order(model):
            init = pick(module)
            if init is None or not _own_tensors(module):
                continue
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(module_seed(self.seed, clean_name(path)))
                peak = max(peak, _init_with_full_tensors(module, init, device))
            count += 1
        ctx.notes["meta_init_peak_full_bytes"] = peak
        return f"to_empty on {device}; initialized {count} module(s) with seed {self.seed}"


def _init_with_full_tensors(module: nn.Module, init: InitFn, device: torch.device) -> int:
    """Run ``init`` on full-size scratch copies of the module's own parameters and keep
    this rank's shard of each. Returns the bytes of scratch tensors held."""
    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor

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
    finally:
        for name, original in originals.items():
            result = module._parameters[name]
            module._parameters[name] = original
            if result is not original and result is not None:
                _keep_local_part(original, result.detach())
    return scratch_bytes


def _keep_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(target, DTensor):
            # src_data_rank=None: every rank slices its own part locally, no communication;
            # every rank computed the same full tensor from the same seed.
            local = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(full)
