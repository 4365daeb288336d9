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
from composer_par.findings import Finding
from composer_par.plugin import Plugin, hookimpl

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin.context import ApplyContext

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


def _own_tensors(module: nn.Module) -> bool:
    # The registries directly: parameters(recurse=False) builds a generator per call,
    # and this runs for every module, twice (validation, then materialization).
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
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

        from composer_par.plugin.initialize import init_module, to_empty_keeping_ties

        device = torch.device(self.device) if self.device else ctx.device
        model = ctx.model
        to_empty_keeping_ties(model, device)
        pick = self.initializer(model)
        count = 0
        peak = 0
        for path, module in post_order(model):
            init = pick(module)
            if init is None or not _own_tensors(module):
                continue
            seed = module_seed(self.seed, clean_name(path))
            peak = max(peak, init_module(module, init, device, seed))
            count += 1
        ctx.notes["meta_init_peak_full_bytes"] = peak
        return f"to_empty on {device}; initialized {count} module(s) with seed {self.seed}"
