"""Floating-point dtype names: the one table every part of composer_par reads.

Plan files, CLI flags and plugin options name dtypes as text. Each of them accepts the
same spellings, case-insensitively: torch's names (``"bfloat16"``, ``"torch.bfloat16"``,
or a ``torch.dtype`` itself), and the aliases below (``"bf16"``, ``"fp32"``, ``"half"``,
...). Everything answers with the canonical name, which is torch's (``getattr(torch,
name)`` gives the dtype). No torch import: the static path (validate, estimate) uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# canonical name -> bytes per element
BYTES: Mapping[str, int] = MappingProxyType(
    {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
)
CANONICAL: tuple[str, ...] = tuple(BYTES)

ALIASES: Mapping[str, str] = MappingProxyType({
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
})


class DtypeError(ValueError):
    """A value that names no dtype of :data:`CANONICAL`; the message lists the names."""


def dtype_name(value: Any) -> str:
    """The canonical name of ``value``: ``"BF16"``, ``torch.bfloat16``, ``"bfloat16"`` ->
    ``"bfloat16"``. Raises :class:`DtypeError` for anything else."""
    if isinstance(value, str):
        text = value
    elif type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        text = str(value)  # "torch.bfloat16"
    else:
        raise DtypeError(_message(value))
    name = text.strip().lower().removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in BYTES:
        raise DtypeError(_message(value))
    return name


def dtype_bytes(value: Any) -> int:
    """Bytes per element of the dtype ``value`` names (:func:`dtype_name`)."""
    return BYTES[dtype_name(value)]


# The spellings of 8-bit float math (torch's two float8 formats, fp8): a dtype matrix
# multiplications may run in (float8 training), never one a parameter is kept in.
FLOAT8_NAMES = ("float8", "fp8", "float8_e4m3fn", "float8_e5m2")


def compute_dtype_name(value: Any) -> str:
    """:func:`dtype_name`, or ``"float8"`` for any of :data:`FLOAT8_NAMES`: the dtype a
    matmul computes in."""
    if isinstance(value, str) and value.strip().lower().removeprefix("torch.") in FLOAT8_NAMES:
        return "float8"
    return dtype_name(value)


def optional_dtype_name(value: Any) -> str | None:
    """:func:`dtype_name`, with None passed through (an unset dtype)."""
    return None if value is None else dtype_name(value)


def accepted_names() -> tuple[str, ...]:
    """Every spelling :func:`dtype_name` accepts (lower case; any case works)."""
    return (*CANONICAL, *ALIASES)


def _message(value: Any) -> str:
    return (f"dtype must be one of {list(CANONICAL)} (or {', '.join(ALIASES)}); "
            f"got {value!r}")


__all__ = [
    "ALIASES",
    "BYTES",
    "CANONICAL",
    "FLOAT8_NAMES",
    "DtypeError",
    "accepted_names",
    "compute_dtype_name",
    "dtype_bytes",
    "dtype_name",
    "optional_dtype_name",
]
