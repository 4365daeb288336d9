"""Hugging Face weights: a ``.safetensors`` file, a directory of them, or an index json
(:class:`~composer_par.checkpoint.sources.WeightsSource`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.formats import TensorSource, check_target
from composer_par.checkpoint.formats._read import as_stored


class SafetensorsFormat:
    name: str = "safetensors"
    targets: tuple[str, ...] = ("dcp",)

    def recognizes(self, path: Path) -> bool:
        from composer_par.checkpoint.inspect import kind_of

        try:
            return kind_of(path) == "safetensors"
        except CheckpointError:
            return False

    def open(self, path: Path, *, tag: str | None = None) -> TensorSource:
        from composer_par.checkpoint.convert import TensorSpec
        from composer_par.checkpoint.safetensors_io import dtype_name, read_tensor
        from composer_par.checkpoint.sources import WeightsSource

        _no_tag(path, tag)
        entries = WeightsSource.open(path).entries
        specs = {name: TensorSpec(tuple(e.shape), dtype_name(e.dtype))
                 for name, e in entries.items()}
        return TensorSource(str(path), self.name, specs, as_stored(
            specs, lambda name, dtype: read_tensor(entries[name]).to(dtype)))

    def convert(self, path: Path, destination: Path, *, to: str, tag: str | None,
                dtype: Any, max_file_bytes: int | None, progress: Any) -> Any:
        from composer_par.checkpoint.convert import safetensors_to_dcp

        _no_tag(path, tag)
        check_target(self, path, to)
        if max_file_bytes is not None:
            raise ValueError("--max-file-size applies only when converting to safetensors")
        return safetensors_to_dcp(path, destination, dtype=dtype, progress=progress)

    def describe(self, path: Path, *, verify: bool) -> dict[str, Any]:
        from composer_par.checkpoint.inspect import describe_native

        return describe_native(path, verify=verify)

    def load(self, path: Path, model: Any, optimizer: Any = None, *,
             tag: str | None = None) -> Any:
        from composer_par.checkpoint.weights import load_safetensors

        _no_tag(path, tag)
        if optimizer is not None:
            raise ValueError(f"{path} holds weights only (safetensors): load it without an "
                             "optimizer")
        return load_safetensors(model, path)


def _no_tag(path: Path, tag: str | None) -> None:
    if tag is not None:
        raise ValueError(f"--tag applies only to DeepSpeed checkpoints; {path} is safetensors")


FORMAT = SafetensorsFormat()
