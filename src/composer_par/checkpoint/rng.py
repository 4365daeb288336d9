"""Per-rank random state: saved as safetensors (no pickle), restored on the same rank.

Each rank writes ``rng/rank-00003.safetensors`` with torch's CPU generator state, every
CUDA device's state when CUDA is initialized, the states of named ``torch.Generator``
objects the caller passes (e.g. the data-order stream of a sampler) and, in the header
metadata, Python's ``random`` state. A rank's stream is its own: on a different world
size there is no rank to take it from, so the states are restored only when the world
size is unchanged (``load`` says whether it did).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from composer_par.checkpoint.errors import CheckpointError

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


def restore_rng(directory: Path, rank: int,
                generators: Mapping[str, torch.Generator] | None = None) -> None:
    import torch
    from safetensors import safe_open

    path = rank_file(directory, rank)
    if not path.is_file():
        raise CheckpointError(f"{path}: no random state saved for rank {rank}")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata() or {}
        torch.set_rng_state(f.get_tensor("torch.cpu"))
        cuda = sorted(k for k in keys if k.startswith("torch.cuda."))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([f.get_tensor(k) for k in cuda])
        for name, gen in (generators or {}).items():
            key = f"generator.{name}"
            if key not in keys:
                saved = sorted(k[10:] for k in keys if k.startswith("generator."))
                raise CheckpointError(f"{path}: no state for generator {name!r}; saved: "
                                      f"{saved}")
            gen.set_state(f.get_tensor(key))
    if "python_random" in meta:
        state = json.loads(meta["python_random"])
        random.setstate((state[0], tuple(state[1]), state[2]))
