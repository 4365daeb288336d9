"""FSDP1's checkpoints: a ``torch.save`` file of a full state dict, or a DCP directory of
a sharded one (:mod:`composer_par.migrate.fsdp1_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_par.checkpoint.formats import TensorSource, check_target, describe_tensors
from composer_par.checkpoint.formats._read import as_stored


class Fsdp1Format:
    name: str = "fsdp1"
    targets: tuple[str, ...] = ("safetensors", "dcp")

    def recognizes(self, path: Path) -> bool:
        from composer_par.migrate.fsdp1_checkpoint import is_fsdp1_checkpoint

        try:
            return is_fsdp1_checkpoint(path)
        except OSError:
            return False

    def open(self, path: Path, *, tag: str | None = None) -> TensorSource:
        from composer_par.migrate.fsdp1_checkpoint import model_tensors

        _no_tag(path, tag)
        specs, read = model_tensors(path)
        return TensorSource(str(path), self.name, specs, as_stored(specs, read))

    def convert(self, path: Path, destination: Path, *, to: str, tag: str | None,
                dtype: Any, max_file_bytes: int | None, progress: Any) -> Any:
        from composer_par.migrate import fsdp1_checkpoint as fsdp1

        _no_tag(path, tag)
        if check_target(self, path, to) == "safetensors":
            return fsdp1.fsdp1_to_safetensors(path, destination, dtype=dtype,
                                              max_file_bytes=max_file_bytes,
                                              progress=progress)
        if max_file_bytes is not None:
            raise ValueError("--max-file-size applies only when converting to safetensors")
        return fsdp1.fsdp1_to_dcp(path, destination, dtype=dtype, progress=progress)

    def describe(self, path: Path, *, verify: bool) -> dict[str, Any]:
        with self.open(path) as source:
            return describe_tensors(self.name, path, source, step=None, world_size=None,
                                    layout="full" if path.is_file() else "sharded")

    def load(self, path: Path, model: Any, optimizer: Any = None, *,
             tag: str | None = None) -> Any:
        from composer_par.migrate.fsdp1_checkpoint import load_fsdp1

        _no_tag(path, tag)
        return load_fsdp1(path, model, optimizer)


def _no_tag(path: Path, tag: str | None) -> None:
    if tag is not None:
        raise ValueError(f"--tag applies only to DeepSpeed checkpoints; {path} is an FSDP1 "
                         "one")


FORMAT = Fsdp1Format()
