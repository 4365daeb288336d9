"""The ``plan`` option: module-path pattern -> style name or table, as a plan file
writes it; checked and frozen by :func:`plan_option`, the plugin's converter."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any


class PlanMap(Mapping[str, Any]):
    """The ``plan`` option: pattern -> style name or table, as a plan file writes it.

    Immutable and hashable (the plugin is a frozen attrs object); equal to a dict with the
    same entries, so plan files round-trip.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(json.dumps(self._items, sort_keys=True, default=str))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"{self._items!r}"


def plan_option(value: Any) -> str | PlanMap:
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        raise ValueError(
            f"plan must be \"auto\" or a table of module pattern = style; got {value!r}")
    if not isinstance(value, Mapping):
        raise TypeError(f"plan must be \"auto\" or a table of module pattern = style; got "
                        f"{type(value).__name__}")
    items: dict[str, Any] = {}
    for key, style in value.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"plan keys are module path patterns (strings); got {key!r}")
        if isinstance(style, Mapping):
            items[key] = {str(k): _plain_value(v) for k, v in style.items()}
        elif isinstance(style, str):
            items[key] = style
        else:
            raise TypeError(f"plan[{key!r}] must be a style name or a table with style = ...; "
                            f"got {style!r}")
    if not items:
        raise ValueError("plan is empty: give at least one pattern = style, or \"auto\"")
    return PlanMap(items)


def _plain_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain_value(v) for k, v in value.items()}
    return value
