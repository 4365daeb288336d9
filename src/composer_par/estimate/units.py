"""The estimator's units: counts, byte sizes and dtypes parsed from flags and plan values,
and counts, sizes and durations formatted for reports."""

from __future__ import annotations

import re
from typing import Any

from composer_par import dtypes
from composer_par.estimate.errors import EstimateError

DTYPE_BYTES = dtypes.BYTES  # the project's one dtype table (composer_par.dtypes)


_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BYTE_UNITS = {
    "": 2**30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_count(text: str | int | float) -> int:
    """``"13e9"``, ``"1.3B"``, ``"350M"``, ``"7b"`` -> an int count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
        suffix = ""
    else:
        match = _NUMBER.match(str(text))
        if not match or match.group(2).lower() not in _COUNT_SUFFIX:
            raise EstimateError(f"expected a count like 13e9, 1.3B or 350M; got {text!r}")
        value, suffix = float(match.group(1)), match.group(2).lower()
    count = round(value * _COUNT_SUFFIX[suffix])
    if count < 1:
        raise EstimateError(f"expected a positive count; got {text!r}")
    return count


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"80GB"`` (1e9), ``"512MiB"``; a bare number is GiB."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _NUMBER.match(str(text))
        if not match or match.group(2).lower() not in _BYTE_UNITS:
            raise EstimateError(f"expected a size like 80GiB, 80GB or 512MiB; got {text!r}")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _BYTE_UNITS[unit])
    if size < 1:
        raise EstimateError(f"expected a positive size; got {text!r}")
    return size


def dtype_name(value: Any) -> str:
    """``"bf16"``, ``torch.bfloat16``, ``"bfloat16"`` -> ``"bfloat16"``
    (:func:`composer_par.dtypes.dtype_name`, raising :class:`EstimateError`)."""
    try:
        return dtypes.dtype_name(value)
    except dtypes.DtypeError as exc:
        raise EstimateError(str(exc)) from None


def optional_dtype(value: Any) -> str | None:
    return None if value is None else dtype_name(value)


def compute_dtype(value: Any) -> str:
    """A matmul's compute dtype: a dtype name, or ``"float8"`` (any spelling of it)."""
    try:
        return dtypes.compute_dtype_name(value)
    except dtypes.DtypeError as exc:
        raise EstimateError(f"{exc} (or float8 for 8-bit matmuls)") from None


def bytes_of(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def format_bytes(size: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def format_count(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f} {unit}"
    return str(int(count))


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"
