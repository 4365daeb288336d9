"""composer_par's own checkpoints: a committed DCP step directory, or a root of them (its
newest committed step)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from composer_par.checkpoint.errors import CheckpointError
from composer_par.checkpoint.formats import TensorSource, check_target


class DcpFormat:
    name: str = "dcp"
    targets: tuple[str, ...] = ("safetensors",)

    def recognizes(self, path: Path) -> bool:
        from composer_par.checkpoint.inspect import kind_of

        try:
            return path.is_dir() and kind_of(path) in ("dcp", "root")
        except CheckpointError:
            return False

    def open(self, path: Path, *, tag: str | None = None) -> TensorSource:
        """The checkpoint's model tensors, read through ``convert``'s path (every chunk
        checked against the commit's digests) into consolidated safetensors in a scratch
        directory, removed when the source is closed."""
        from composer_par.checkpoint.convert import dcp_to_safetensors
        from composer_par.checkpoint.formats.safetensors import FORMAT as SAFETENSORS

        _no_tag(path, tag)
        scratch = Path(tempfile.mkdtemp(prefix="composer-par-dcp-"))
        try:
            converted = dcp_to_safetensors(path, scratch / "weights")
            inner = SAFETENSORS.open(Path(converted.destination))
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return TensorSource(str(path), self.name, inner.specs, inner.reader,
                            lambda: shutil.rmtree(scratch, ignore_errors=True))

    def convert(self, path: Path, destination: Path, *, to: str, tag: str | None,
                dtype: Any, max_file_bytes: int | None, progress: Any) -> Any:
        from composer_par.checkpoint.convert import dcp_to_safetensors

        _no_tag(path, tag)
        check_target(self, path, to)
        return dcp_to_safetensors(path, destination, dtype=dtype,
                                  max_file_bytes=max_file_bytes, progress=progress)

    def describe(self, path: Path, *, verify: bool) -> dict[str, Any]:
        from composer_par.checkpoint.inspect import describe_native

        return describe_native(path, verify=verify)

    def load(self, path: Path, model: Any, optimizer: Any = None, *,
             tag: str | None = None) -> Any:
        from composer_par.checkpoint.dcp import load

        _no_tag(path, tag)
        return load(path, model, optimizer)


def _no_tag(path: Path, tag: str | None) -> None:
    if tag is not None:
        raise ValueError(f"--tag applies only to DeepSpeed checkpoints; {path} is a DCP checkpoint")


FORMAT = DcpFormat()
