"""Tensors only a module's constructor sets, taken from the module built once on CPU.

Some modules own parameters that nothing initializes but their constructor: no
``reset_parameters()``, and a Hugging Face model's ``_init_weights`` leaves them alone
(Apertus's XIELU activation computes ``alpha_p`` / ``alpha_n`` from its constructor's
floats). Built on meta, their values are gone. Such a module is built again on CPU, with
the arguments it was built with, and its tensors are copied from that copy. Arguments are
never guessed: they are read back from same-named attributes (``self.config = config``),
of the module itself or, where it does not keep them (XIELU keeps neither
``alpha_p_init`` nor ``dtype``), of its parent (Apertus's MLP keeps its ``config``), never
of the root model; that module is built and the one at the same relative path is taken.
A copy whose tensors its constructor leaves empty (``torch.empty``, seen as NaN) is not
taken. The construction is seeded from the seed and the built class and relative path
(not the module's own path), so its values are the same on every rank and every layout,
pipeline stages included; one construction serves every module built from the same
class, path and arguments."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from composer_par.logging import get_logger
from composer_par.plugin.initialize.seeding import module_seed, seeded

log = get_logger(__name__)

_PLAIN = (int, float, bool, str, type(None), torch.dtype)


def constructor_arguments(module: nn.Module) -> dict[str, Any] | None:
    """The arguments ``type(module)(...)`` was called with, read back from same-named
    attributes of ``module``, or None when one of them is not kept (or the constructor
    takes ``*args`` / ``**kwargs``, which no attribute tells)."""
    try:
        signature = inspect.signature(type(module).__init__)
    except (TypeError, ValueError):
        return None
    arguments: dict[str, Any] = {}
    for parameter in list(signature.parameters.values())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            return None
        if parameter.name not in module.__dict__:
            return None  # not kept (a parameter, buffer or child module is no argument)
        arguments[parameter.name] = module.__dict__[parameter.name]
    if type(module).__init__ is nn.Module.__init__:
        return None
    return arguments


def buildable_owner(root: nn.Module, path: str) -> tuple[nn.Module, str] | None:
    """The module at ``path`` or its parent (never ``root``), whichever comes first whose
    constructor arguments can be read back, and ``path`` relative to it; None if
    neither. No higher: building a whole decoder layer or model again is no small cost."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), max(0, len(parts) - 2), -1):
        owner = root.get_submodule(".".join(parts[:depth]))
        if constructor_arguments(owner) is not None:
            return owner, ".".join(parts[depth:])
    return None


class Constructions:
    """Modules built on CPU for their constructors' tensors, one per (class, relative
    path, arguments), seeded from ``base_seed``."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = base_seed
        self._built: dict[tuple[Any, ...], nn.Module | None] = {}

    def built_like(self, root: nn.Module, path: str) -> nn.Module | None:
        """The module at ``path`` of ``root`` as its constructor builds it on CPU, or None
        where no module at or above it can be built again (or the copy differs in type
        or in the shapes of its own tensors)."""
        module = root.get_submodule(path) if path else root
        found = buildable_owner(root, path)
        if found is None:
            return None
        owner, relative = found
        arguments = constructor_arguments(owner)
        assert arguments is not None
        key = (type(owner), relative, tuple((k, id(v)) if not isinstance(v, _PLAIN)
                                            else (k, v) for k, v in arguments.items()))
        if key not in self._built:
            label = f"{type(owner).__module__}.{type(owner).__qualname__}:{relative}"
            cpu = torch.device("cpu")
            try:
                with torch.device(cpu), seeded(cpu, module_seed(self.base_seed, label)), \
                        torch.no_grad(), _unset_memory_is_nan():
                    built = type(owner)(**arguments)
                self._built[key] = built.get_submodule(relative) if relative else built
            except Exception as exc:  # the arguments read back do not build it
                log.debug("not built again", kind=label, error=str(exc)[:200])
                self._built[key] = None
        copy = self._built[key]
        if copy is None or type(copy) is not type(module) or not _same_shapes(copy, module):
            return None
        if any(t.is_floating_point() and bool(torch.isnan(t).any()) for t in
               [*copy._parameters.values(), *copy._buffers.values()] if t is not None):
            return None  # a constructor that leaves a tensor empty does not set it
        return copy


@contextmanager
def _unset_memory_is_nan() -> Iterator[None]:
    """``torch.empty`` gives NaN inside (torch's deterministic mode fills uninitialized
    memory), so that a tensor its constructor leaves empty shows as not set."""
    mode, warn_only = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def _same_shapes(a: nn.Module, b: nn.Module) -> bool:
    def shapes(m: nn.Module) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in [*m._parameters.items(), *m._buffers.items()]
                if t is not None}
    return shapes(a) == shapes(b)
