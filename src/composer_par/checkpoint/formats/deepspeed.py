"""DeepSpeed ZeRO checkpoints (stages 1-3), read without DeepSpeed
(:mod:`composer_par.migrate.deepspeed_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_par.checkpoint.formats import TensorSource, check_target, describe_tensors
from composer_par.checkpoint.formats._read import as_stored


class DeepSpeedFormat:
    name: str = "deepspeed"
    targets: tuple[str, ...] = ("safetensors", "dcp")

    def recognizes(self, path: Path) -> bool:
        from composer_par.migrate.deepspeed_checkpoint import is_deepspeed_checkpoint

        try:
            return is_deepspeed_checkpoint(path)
        except OSError:
            return False

    def open(self, path: Path, *, tag: str | None = None) -> TensorSource:
        from composer_par.migrate.deepspeed_checkpoint import convertible, read_zero_checkpoint

        ckpt = read_zero_checkpoint(path, tag)
        specs, read = convertible(ckpt)
        return TensorSource(str(ckpt.directory), self.name, specs, as_stored(specs, read))

    def convert(self, path: Path, destination: Path, *, to: str, tag: str | None,
                dtype: Any, max_file_bytes: int | None, progress: Any) -> Any:
        from composer_par.migrate import deepspeed_checkpoint as ds

        if check_target(self, path, to) == "safetensors":
            return ds.deepspeed_to_safetensors(path, destination, tag=tag, dtype=dtype,
                                               max_file_bytes=max_file_bytes,
                                               progress=progress)
        if max_file_bytes is not None:
            raise ValueError("--max-file-size applies only when converting to safetensors")
        return ds.deepspeed_to_dcp(path, destination, tag=tag, dtype=dtype, progress=progress)

    def describe(self, path: Path, *, verify: bool) -> dict[str, Any]:
        from composer_par.migrate.deepspeed_checkpoint import read_zero_checkpoint

        ckpt = read_zero_checkpoint(path)
        with self.open(path) as source:
            return describe_tensors(self.name, path, source, step=ckpt.global_steps,
                                    world_size=ckpt.world_size, zero_stage=ckpt.stage)

    def load(self, path: Path, model: Any, optimizer: Any = None, *,
             tag: str | None = None) -> Any:
        from composer_par.migrate.deepspeed_checkpoint import load_deepspeed

        return load_deepspeed(path, model, optimizer, tag=tag)


FORMAT = DeepSpeedFormat()
