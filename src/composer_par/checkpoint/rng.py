"""Per-rank random state: saved as safetensors (no pickle), restored on the same rank.

Each rank writes ``rng/rank-00003.safetensors`` with torch's CPU generator state, every
CUDA device's state when CUDA is initialized, the states of named ``torch.Generator``
objects the caller passes (e.g. the data-order stream of a sampler) and, in the header
metadata, Python's ``random`` state. A rank's stream is its own: on a different world
size there is no rank to take it from, so the states are restored only when the world
size is unchanged (``load`` says whether it did). Restoring reads the file with the
bounded, pickle-free safetensors reader, and checks every state before any is set.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from composer_par.checkpoint.errors import CheckpointError, CorruptFileError

if TYPE_CHECKING:
    import torch

DIRECTORY = "rng"


def rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / DIRECTORY / f"rank-{rank:05d}.safetensors"


def save_rng(directory: Path, rank: int,
             generators: Mapping[str, torch.Generator] | None = None) -> None:
    import torch

    from composer_par.checkpoint.safetensors_io import save_file

    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = state
    for name, gen in (generators or {}).items():
        tensors[f"generator.{name}"] = gen.get_state()
    path = rank_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata={"python_random": json.dumps(random.getstate())})


@attrs.frozen
class SavedRng:
    """The random states one rank saved, read and checked, not yet restored."""

    path: Path
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]
    generators: tuple[tuple[torch.Generator, torch.Tensor], ...]
    python_random: tuple[Any, ...] | None

    def restore(self) -> None:
        import torch

        torch.set_rng_state(self.cpu)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(self.cuda))
        for gen, state in self.generators:
            gen.set_state(state)
        if self.python_random is not None:
            random.setstate(self.python_random)


def read_rng(directory: Path, rank: int,
             generators: Mapping[str, torch.Generator] | None = None) -> SavedRng:
    """The random states of ``rank`` saved in ``directory``, for ``generators`` too; a
    missing file, a damaged one or a generator it lacks is a CheckpointError naming the
    file. Nothing is restored yet: the caller restores them once the load succeeded."""

    from composer_par.checkpoint.safetensors_io import read_header, read_tensor

    path = rank_file(directory, rank)
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: missing: no random state saved for rank {rank}")
    header = read_header(path)
    entries = header.entries

    def state(key: str) -> torch.Tensor:
        entry = entries.get(key)
        if entry is None or entry.dtype != "U8" or len(entry.shape) != 1:
            raise CorruptFileError(f"{path}: no {key} state (a uint8 vector) in it")
        return read_tensor(entry)

    cpu = state("torch.cpu")
    devices = sorted(k for k in entries if k.startswith("torch.cuda."))
    if not all(k.removeprefix("torch.cuda.").isdigit() for k in devices):
        raise CorruptFileError(f"{path}: a CUDA state of no device index: {devices}")
    devices.sort(key=lambda k: int(k.removeprefix("torch.cuda.")))
    cuda = tuple(state(k) for k in devices)
    chosen = []
    for name, gen in (generators or {}).items():
        key = f"generator.{name}"
        if key not in entries:
            saved = sorted(k[10:] for k in entries if k.startswith("generator."))
            raise CheckpointError(f"{path}: no state for generator {name!r}; saved: {saved}")
        chosen.append((gen, state(key)))
    python_random = None
    if "python_random" in header.metadata:
        python_random = _python_random(path, header.metadata["python_random"])
    return SavedRng(path, cpu, cuda, tuple(chosen), python_random)


def _python_random(path: Path, text: str) -> tuple[Any, ...]:
    """The ``random.getstate()`` saved as JSON, checked by a throwaway generator."""
    try:
        version, internal, gauss = json.loads(text)
        value = (version, tuple(internal), gauss)
        random.Random().setstate(value)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CorruptFileError(f"{path}: the python random state is damaged ({exc})") \
            from None
    return value


def restore_rng(directory: Path, rank: int,
                generators: Mapping[str, torch.Generator] | None = None) -> None:
    read_rng(directory, rank, generators).restore()
