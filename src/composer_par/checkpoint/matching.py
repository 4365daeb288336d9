"""Matching a model's tensors to a file's keys: missing, unexpected, shape and dtype.

DCP ignores keys of a checkpoint that the model lacks; composer_par reports them. The
match is computed from shapes and dtypes alone (a file's header, a DCP checkpoint's
metadata, a model on the meta device), so validation finds every problem before a byte
of weights is read or a tensor allocated.

A model cut into pipeline stages is loaded one part at a time: a part lacks the tensors
of the other stages, which a file of the whole model holds. Inside
:func:`rest_of_model` (the weights loaders' materialize stage opens it with the whole
model's names from the plan's pipeline), :func:`match` counts the file keys of those
names as the rest of the model's: neither loaded here nor unexpected.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from composer_par.blocks import clean_name

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.checkpoint.adapter import StateDictAdapter


@attrs.frozen
class Spec:
    """What one tensor is: its global shape and dtype name (``"float32"``)."""

    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


_FLOAT_RANK = {"float64": 4, "float32": 3, "bfloat16": 2, "float16": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1}


def convertible(found: str, expected: str) -> bool:
    """Whether a file tensor of dtype ``found`` loads into a model tensor of ``expected``:
    equal, or both floating point (converted on load)."""
    return found == expected or (found in _FLOAT_RANK and expected in _FLOAT_RANK)


def lossy(found: str, expected: str) -> bool:
    """A conversion that loses precision (fp32 into bf16; bf16 <-> fp16 both ways)."""
    if found == expected or found not in _FLOAT_RANK or expected not in _FLOAT_RANK:
        return False
    return _FLOAT_RANK[expected] < _FLOAT_RANK[found] or {found, expected} == {
        "bfloat16", "float16"}


# The names (the model's own) of the tensors that other parts of the model hold.
_REST: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "composer_par_rest_of_model", default=frozenset())


@contextlib.contextmanager
def rest_of_model(names: Collection[str]) -> Iterator[None]:
    """While open, :func:`match` treats the file keys of ``names`` (model names of the
    tensors other parts of the model hold: another pipeline stage's) as neither missing
    here nor unexpected."""
    token = _REST.set(frozenset(names))
    try:
        yield
    finally:
        _REST.reset(token)


@attrs.frozen
class Match:
    """The result of matching ``model name -> file key``."""

    source: str
    keys: dict[str, str]  # model name -> file key, for the keys that load
    missing: tuple[str, ...]  # model names whose file key is absent
    unexpected: tuple[str, ...]  # file keys no model name maps to
    mismatched: tuple[tuple[str, str, str], ...]  # (model name, expected, found)
    lossy: tuple[tuple[str, str, str], ...]  # (model name, model dtype, file dtype)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def error(self, *, strict: bool) -> Exception | None:
        """The error loading would raise, or None (not strict: only mismatches count)."""
        from composer_par.checkpoint.errors import KeyMismatchError

        missing = self.missing if strict else ()
        unexpected = self.unexpected if strict else ()
        if missing or unexpected or self.mismatched:
            return KeyMismatchError(self.source, missing, unexpected, self.mismatched)
        return None


def match(
    source: str,
    model: Mapping[str, Spec],
    file: Mapping[str, Spec],
    adapter: StateDictAdapter,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> Match:
    """Match ``model`` (name -> spec, one name per tensor) against ``file`` (key -> spec).

    ``aliases`` maps a model name to other names of the same tensor (tied weights): the
    tensor loads from whichever of its names the file has.
    """
    keys: dict[str, str] = {}
    missing, mismatched, lossy_ = [], [], []
    used: set[str] = set()
    for name, spec in model.items():
        candidates = [name, *(aliases or {}).get(name, ())]
        mapped = [(n, adapter.to_file(n)) for n in candidates]
        used.update(key for _, key in mapped if key in file)
        present = next(((n, key) for n, key in mapped if key in file), None)
        if present is None:
            missing.append(name)
            continue
        key = present[1]
        found = file[key]
        if tuple(found.shape) != tuple(spec.shape) or not convertible(found.dtype, spec.dtype):
            mismatched.append((name if key == name else f"{name} (file key {key})",
                               spec.describe(), found.describe()))
            continue
        if lossy(found.dtype, spec.dtype):
            lossy_.append((name, spec.dtype, found.dtype))
        keys[name] = key
    rest = _REST.get()
    if rest:
        used.update(adapter.to_file(n) for n in rest if n not in model)
    unexpected = tuple(k for k in file if k not in used)
    return Match(source, keys, tuple(missing), unexpected, tuple(mismatched), tuple(lossy_))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_specs(model: nn.Module) -> tuple[dict[str, Spec], dict[str, list[str]]]:
    """The model's persistent tensors by clean name (one name per tensor, the first in
    ``state_dict`` order) and, for tied tensors, the other names of each."""
    specs: dict[str, Spec] = {}
    aliases: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for raw, tensor in model.state_dict(keep_vars=True).items():
        name = clean_name(raw)
        ident = id(tensor)
        if ident in first:
            aliases.setdefault(first[ident], []).append(name)
            continue
        first[ident] = name
        specs[name] = Spec(tuple(tensor.shape), _dtype_name(tensor.dtype))  # DTensor: global
    return specs, aliases
