"""Checkpoints and weights: sharded DCP save/load with commit markers, Hugging Face
safetensors in (each rank reads its own bytes) and out (no rank gathers the model),
offline conversion and inspection.

    from composer_par import checkpoint

    checkpoint.save("ckpt", model, optimizer, extra={"epoch": 3}, step=120, plan=plan,
                    keep_last=3)
    info = checkpoint.load("ckpt", model, optimizer)     # the run's newest committed step
    checkpoint.export_safetensors(model, "hf-out", adapter=checkpoint.Rename([...]))

Modules, one job each: ``steps`` (step directories, commit markers, latest, retention),
``runs`` (the run a step belongs to; which step resuming a run loads), ``claims``
(exclusive step directories, stale cleaning), ``integrity`` (digests of every
file, their checks), ``paths`` (names read from files stay inside their directory; bounded
reads), ``dcp`` (save/load), ``dcp_reader`` (DCP's reader checking what it reads), ``rng``
(per-rank random state), ``safetensors_io`` (headers, region reads and writes),
``sources`` (file / directory / index json), ``hf_reader`` (DCP's reader of safetensors),
``weights`` (loading weights into a model), ``matching`` (missing and unexpected keys),
``adapter`` (name mapping), ``export``, ``convert``, ``inspect``, ``torchfile`` (other
tools' ``torch.save`` files, read without running their code), ``formats`` (DCP,
safetensors, DeepSpeed and FSDP1 sources behind one protocol).
Importing this package does not import torch.
"""

from composer_par.checkpoint.adapter import Identity, Rename, StateDictAdapter, resolve_adapter
from composer_par.checkpoint.claims import clean_stale
from composer_par.checkpoint.convert import dcp_to_safetensors, safetensors_to_dcp
from composer_par.checkpoint.dcp import CheckpointInfo, load, save
from composer_par.checkpoint.errors import (
    CheckpointError,
    CorruptFileError,
    KeyMismatchError,
    UncommittedError,
)
from composer_par.checkpoint.export import export_safetensors
from composer_par.checkpoint.inspect import describe
from composer_par.checkpoint.integrity import verify
from composer_par.checkpoint.sources import WeightsSource
from composer_par.checkpoint.steps import is_committed, latest, step_dirs
from composer_par.checkpoint.weights import (
    LoadReport,
    load_checkpoint_weights,
    load_safetensors,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CorruptFileError",
    "Identity",
    "KeyMismatchError",
    "LoadReport",
    "Rename",
    "StateDictAdapter",
    "UncommittedError",
    "WeightsSource",
    "clean_stale",
    "dcp_to_safetensors",
    "describe",
    "export_safetensors",
    "is_committed",
    "latest",
    "load",
    "load_checkpoint_weights",
    "load_safetensors",
    "resolve_adapter",
    "safetensors_to_dcp",
    "save",
    "step_dirs",
    "verify",
]
