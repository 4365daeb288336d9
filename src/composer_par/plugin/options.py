"""Option helpers: attrs fields that validate what a plan file hands a plugin.

Plan files pass any TOML value, so each helper checks its type and names the option
in the error (the plan reports it as CP210 / CP506).
"""

from __future__ import annotations

from typing import Any

import attrs


def _plugin_names(value: Any) -> tuple[str, ...]:
    """``after = "meta_init"`` means one name, not its letters."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"after/before take a plugin name or a list of them; got {value!r}")
    return tuple(value)


def ordering_option() -> Any:
    """An ``after`` / ``before`` option: plugin names to run after / before in a stage.

    Plan files hand in any TOML value, so a wrong type fails here, naming the option.
    """
    return attrs.field(default=(), converter=_plugin_names)


def _mesh_dim_name(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"{attribute.name} must be a mesh dim name; got {value!r}")


def dim_option(default: str) -> Any:
    """A ``dim`` option: the mesh dim the plugin claims (whether the mesh has it is CP203)."""
    return attrs.field(default=default, validator=_mesh_dim_name)


def _block_names(value: Any) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        f"blocks must be a module path or a non-empty list of class names; got {value!r}"
    )


def blocks_option() -> Any:
    """A ``blocks`` option: a module path (``"layers"``) or block class names
    (``["DecoderLayer"]``); None lets the shared block finder detect them."""
    return attrs.field(default=None, converter=_block_names)
