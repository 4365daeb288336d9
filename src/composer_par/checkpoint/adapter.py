"""State-dict adapters: how the model's parameter names map to a file's key names.

A model built from its own code (``layers.0.attention.wq.weight``) rarely uses the names
of the weights it loads (Hugging Face's ``model.layers.0.self_attn.q_proj.weight``). An
adapter says, for each name of the model, the key in the file. One direction is enough:
loading looks each model name up in the file, export writes each tensor under the file
name, so a model exported with an adapter reloads with the same adapter.

Adapters map names only. They never transform tensors: a rank reads only its own slice of
each tensor, and a transform (a permutation, a fused split) would need the whole tensor.
Transform weights once offline, or in a ``convert``-stage plugin.

Three ways to give one (see docs/checkpoints.md, "Name mapping"):

* ``Rename([(pattern, replacement), ...])``: regular expressions applied in order
  (``re.sub``), each to the result of the one before; expressible in a plan file as
  ``rename = [["^layers\\.", "model.layers."]]``;
* any object with ``to_file(name: str) -> str`` (a :class:`StateDictAdapter`);
* a plugin implementing the hook ``composer_par_state_dict_adapter(plan, model)``, for
  adapters that belong to a model family rather than to a plan.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


@runtime_checkable
class StateDictAdapter(Protocol):
    """Maps the model's own parameter/buffer names to the names of a weights file."""

    def to_file(self, name: str) -> str:
        """The file's key for the model's ``name`` (a clean name, no wrapper prefixes)."""
        ...


@attrs.frozen
class Identity:
    """The model's names are the file's names."""

    def to_file(self, name: str) -> str:
        return name


def _rules(value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"rename takes [pattern, replacement] pairs; got {value!r}")
    rules = []
    for rule in value:
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2
                and all(isinstance(x, str) for x in rule)):
            raise TypeError(f"each rename rule is a [pattern, replacement] pair of strings; "
                            f"got {rule!r}")
        try:
            re.compile(rule[0])
        except re.error as exc:
            raise ValueError(f"rename pattern {rule[0]!r} is not a regular expression: "
                             f"{exc}") from None
        rules.append((rule[0], rule[1]))
    return tuple(rules)


@attrs.frozen
class Rename:
    """Regular-expression renames applied in order: ``Rename([("^", "model.")])``."""

    rules: tuple[tuple[str, str], ...] = attrs.field(converter=_rules)

    def to_file(self, name: str) -> str:
        for pattern, replacement in self.rules:
            name = re.sub(pattern, replacement, name)
        return name


def resolve_adapter(value: Any) -> StateDictAdapter | None:
    """An adapter from a plugin option: None, an adapter object, or ``"module:attr"``
    naming one (or a zero-argument factory of one)."""
    if value is None:
        return None
    if isinstance(value, str):
        module_name, _, attr = value.partition(":")
        if not attr:
            raise ValueError(f"adapter must be 'module:attribute'; got {value!r}")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "to_file")):
            obj = obj()
        value = obj
    if not callable(getattr(value, "to_file", None)):
        raise TypeError(f"an adapter needs a to_file(name) method; got {value!r}")
    return value  # type: ignore[no-any-return]


@attrs.frozen
class Chain:
    """Adapters applied one after the other (a plugin's, then the loader's rename)."""

    adapters: tuple[StateDictAdapter, ...]

    def to_file(self, name: str) -> str:
        for adapter in self.adapters:
            name = adapter.to_file(name)
        return name


def combine(adapters: Iterable[StateDictAdapter | None]) -> StateDictAdapter:
    present = tuple(a for a in adapters if a is not None)
    if not present:
        return Identity()
    return present[0] if len(present) == 1 else Chain(present)


def file_names(names: Sequence[str], adapter: StateDictAdapter) -> dict[str, str]:
    """``model name -> file name``; two model names mapped to one file key is an error
    unless they are aliases (callers pass one name per tensor)."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        target = adapter.to_file(name)
        if target in seen:
            raise ValueError(f"the adapter maps both {seen[target]} and {name} to {target}")
        seen[target] = name
        out[name] = target
    return out


def adapter_for(plan: Any, model: Any) -> StateDictAdapter:
    """The adapter a plan's plugins contribute through ``composer_par_state_dict_adapter``
    (their answers chained in the plan's order), or the identity."""
    view = getattr(plan, "view", plan)  # a ParallelPlan, or the view hooks are given
    return combine(view.state_dict_adapters(model))
