"""Which call initializes a module: the user's ``init_fn``, else a Hugging Face model's
``_init_weights``, else the module's own ``reset_parameters()`` (or
``_reset_parameters()``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

InitFn = Callable[[nn.Module], None]

_OWN_METHODS = ("reset_parameters", "_reset_parameters")


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


def initializer(root: nn.Module, init_fn: str | InitFn | None = None
                ) -> Callable[[nn.Module], InitFn | None]:
    """For each module of ``root``, the call that initializes it, or None if there is none:
    ``init_fn`` when given, else a Hugging Face model's ``_init_weights``, else the
    module's ``reset_parameters()`` (or ``_reset_parameters()``). Raises as
    :func:`resolve_init_fn` does for an ``init_fn`` that cannot be imported."""
    user = resolve_init_fn(init_fn)
    hf_init = getattr(root, "_init_weights", None)

    def pick(module: nn.Module) -> InitFn | None:
        if user is not None:
            return user
        if callable(hf_init):
            return hf_init  # type: ignore[no-any-return]
        return own_initializer(module)

    return pick


def own_initializer(module: nn.Module) -> InitFn | None:
    """The module's own ``reset_parameters()`` (else ``_reset_parameters()``) as an
    :data:`InitFn`, or None where it has neither."""
    for name in _OWN_METHODS:
        method = getattr(module, name, None)
        if callable(method):
            return _call_method(method, f"{type(module).__name__}.{name}")
    return None


def _call_method(method: Callable[[], Any], label: str) -> InitFn:
    """An InitFn for a module's own init method (it takes the module; the method has it),
    named ``label`` in messages."""

    def init(_module: nn.Module) -> None:
        method()

    init.__qualname__ = label
    return init


def owns_tensors(module: nn.Module) -> bool:
    """Whether ``module`` registers parameters or buffers of its own."""
    return any(t is not None for t in [*module._parameters.values(),
                                       *module._buffers.values()])


def without_initializer(root: nn.Module, modules: Iterable[nn.Module],
                        init_fn: str | InitFn | None = None) -> list[nn.Module]:
    """The modules among ``modules`` (of ``root``) that own parameters or buffers and
    that :func:`initializer` finds no initializer for. Raises as :func:`resolve_init_fn`
    does for an ``init_fn`` that cannot be imported."""
    pick = initializer(root, init_fn)
    return [module for module in modules if owns_tensors(module) and pick(module) is None]


def initializer_name(init: InitFn) -> str:
    """How messages name ``init``: ``Class.method`` for a bound method (a Hugging Face
    model's ``_init_weights``) and for a module's own method, else its qualified name."""
    owner = getattr(init, "__self__", None)
    name = getattr(init, "__qualname__", getattr(init, "__name__", repr(init)))
    if owner is not None:
        return f"{type(owner).__name__}.{getattr(init, '__name__', name)}"
    return str(name)
