"""Checkpoint sources behind one protocol: what ``load``, ``convert``, ``inspect`` and
``compare`` ask of a checkpoint, whoever wrote it.

    fmt = detect("ckpt")                       # the format that recognizes the path
    with fmt.open("ckpt") as source:           # names, shapes, dtypes; one tensor read
        weight = source.read("layers.0.attention.wq.weight")
    fmt.convert("ckpt", "out", to="safetensors")
    fmt.describe("ckpt", verify=False)         # what inspect prints
    fmt.load("ckpt", model, optimizer)         # into a model a plan applied

Each format is one module of this package with one object meeting
:class:`CheckpointFormat`: :mod:`.dcp` (composer_par's committed DCP checkpoints),
:mod:`.safetensors` (Hugging Face weights: a file, a directory, an index json),
:mod:`.deepspeed` (DeepSpeed ZeRO, read without DeepSpeed) and :mod:`.fsdp1` (FSDP1's
full or sharded state dicts). :data:`FORMATS` lists them in the order :func:`detect`
asks them (the more particular first: an FSDP1 sharded checkpoint is a DCP directory
that composer_par did not write). A further format is one more module and one more
entry; no command branches on a format's name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from composer_par.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from composer_par.checkpoint.convert import ConvertResult, TensorSpec

#: ``read(name, dtype)``: the full tensor ``name``, in ``dtype`` (None: as stored).
Read = Callable[[str, "torch.dtype | None"], "torch.Tensor"]


def _nothing() -> None:
    return None


@attrs.frozen
class TensorSource:
    """An opened checkpoint: every tensor's name with its shape and dtype (``specs``),
    and :meth:`read` of one full tensor at a time. Close it (or use ``with``) to free
    what opening it took (a memory map, a scratch directory)."""

    path: str
    format: str
    specs: Mapping[str, TensorSpec]
    reader: Read
    closer: Callable[[], None] = _nothing

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reader(name, dtype)

    def close(self) -> None:
        self.closer()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


@runtime_checkable
class CheckpointFormat(Protocol):
    """One kind of checkpoint. ``targets``: what :meth:`convert` writes from it, the
    default first."""

    name: str
    targets: tuple[str, ...]

    def recognizes(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this format (reading names and small files
        only; never raising for a path of another format)."""

    def open(self, path: Path, *, tag: str | None = None) -> TensorSource:
        """The checkpoint's tensors (``tag``: which of several a root holds, where the
        format has tags)."""

    def convert(self, path: Path, destination: Path, *, to: str, tag: str | None,
                dtype: Any, max_file_bytes: int | None, progress: Any) -> ConvertResult:
        """Write it as ``to`` (one of ``targets``) into the new directory
        ``destination``."""

    def describe(self, path: Path, *, verify: bool) -> dict[str, Any]:
        """What ``inspect`` shows of it (:func:`composer_par.checkpoint.inspect.describe`'s
        form)."""

    def load(self, path: Path, model: nn.Module, optimizer: Any = None, *,
             tag: str | None = None) -> Any:
        """Load it into ``model`` (a plan applied it) and ``optimizer``; every rank
        calls it."""


def formats() -> tuple[CheckpointFormat, ...]:
    """The known formats, in the order :func:`detect` asks them."""
    from composer_par.checkpoint.formats import dcp, deepspeed, fsdp1, safetensors

    return (deepspeed.FORMAT, fsdp1.FORMAT, dcp.FORMAT, safetensors.FORMAT)


def detect(path: str | os.PathLike[str]) -> CheckpointFormat:
    """The format of the checkpoint at ``path``; CheckpointError naming the path when no
    format recognizes it."""
    p = Path(path)
    if not os.path.lexists(p):
        raise CheckpointError(f"{p}: no such file or directory")
    for fmt in formats():
        if fmt.recognizes(p):
            return fmt
    names = ", ".join(f.name for f in formats())
    raise CheckpointError(f"{p}: not a checkpoint of any known format ({names}): a "
                          ".safetensors file, a directory of them or an index json, a DCP "
                          "checkpoint or root, a DeepSpeed ZeRO checkpoint, or an FSDP1 "
                          "state dict (a torch.save file or a DCP directory)")


def by_name(name: str) -> CheckpointFormat:
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise ValueError(f"no checkpoint format {name!r}; known: "
                     f"{', '.join(f.name for f in formats())}")


def open_source(path: str | os.PathLike[str], *, tag: str | None = None) -> TensorSource:
    """The tensors of the checkpoint at ``path``, whatever its format."""
    return detect(path).open(Path(path), tag=tag)


def load(path: str | os.PathLike[str], model: nn.Module, optimizer: Any = None, *,
         tag: str | None = None) -> Any:
    """Load the checkpoint at ``path``, whatever its format, into ``model`` (and
    ``optimizer``); every rank calls it. What each format's loader returns."""
    return detect(path).load(Path(path), model, optimizer, tag=tag)


def describe_tensors(fmt: str, path: Path, source: TensorSource, **fields: Any
                     ) -> dict[str, Any]:
    """``inspect``'s answer for a format without a commit record: its keys, shapes,
    dtypes and bytes, and ``fields`` (step, world_size)."""
    import math

    from composer_par.checkpoint.inspect import item_size

    keys = []
    for name in sorted(source.specs):
        spec = source.specs[name]
        size = item_size(spec.dtype)
        keys.append({"name": name, "shape": list(spec.shape), "dtype": spec.dtype,
                     "bytes": None if size is None else math.prod(spec.shape) * size})
    return {"path": str(path), "kind": fmt, "tensors": len(keys),
            "bytes": sum(k["bytes"] or 0 for k in keys), "keys": keys,
            "commit": f"n/a ({fmt} has no commit record)", **fields}


def check_target(fmt: CheckpointFormat, path: Path, to: str | None) -> str:
    """``to``, or the format's default target; ValueError when it cannot be written."""
    target = to or fmt.targets[0]
    if target not in fmt.targets:
        raise ValueError(f"{path} is {fmt.name}, which converts to "
                         f"{' or '.join(fmt.targets)} only (--to {target})")
    return target


__all__ = ["CheckpointFormat", "TensorSource", "by_name", "check_target", "describe_tensors",
           "detect", "formats", "load", "open_source"]
