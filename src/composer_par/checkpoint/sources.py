"""A set of safetensors files as one name -> tensor map: a file, a directory, or an index.

* a ``.safetensors`` file: its tensors;
* a ``*.safetensors.index.json``: exactly the files its ``weight_map`` names, and each
  key only from the file the index assigns it (DCP's Hugging Face reader instead loads
  every ``*.safetensors`` in the directory and ignores the index);
* a directory: its index json if it has one, else every ``*.safetensors`` in it.

Only headers are read here. A key in two files, a key the index names that its file
lacks, or a file the index names that is missing are errors naming the file and the key;
so is a file name in the index that is absolute or resolves (symlinks followed) outside
the index's directory (see :mod:`~composer_par.checkpoint.paths`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from composer_par.checkpoint.errors import CheckpointError, CorruptFileError
from composer_par.checkpoint.jsonfile import read_json_object
from composer_par.checkpoint.paths import allowed_roots, contained
from composer_par.checkpoint.safetensors_io import (
    INDEX_SUFFIX,
    SUFFIX,
    Header,
    TensorEntry,
    read_header,
)

#: An index json larger than this is not one (Hugging Face's are well under 1 MiB).
INDEX_LIMIT = 256 * 1024 * 1024


@attrs.frozen
class WeightsSource:
    """Where each key's bytes are. ``path`` is what the user gave."""

    path: str
    entries: dict[str, TensorEntry]
    files: tuple[str, ...]
    index: str | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> WeightsSource:
        p = Path(path)
        if p.is_dir():
            indexes = sorted(p.glob(f"*{INDEX_SUFFIX}"))
            if len(indexes) > 1:
                raise CheckpointError(
                    f"{p}: several index files ({', '.join(i.name for i in indexes)}); "
                    "pass the one to load")
            if indexes:
                return cls._from_index(indexes[0], given=str(path))
            files = sorted(p.glob(f"*{SUFFIX}"))
            if not files:
                raise CheckpointError(f"{p}: no *{SUFFIX} files and no *{INDEX_SUFFIX}")
            return cls._from_files([str(f) for f in files], given=str(path))
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or directory")
        if p.name.endswith(".json"):
            return cls._from_index(p, given=str(path))
        return cls._from_files([str(p)], given=str(path))

    @classmethod
    def _from_files(cls, files: list[str], given: str) -> WeightsSource:
        entries: dict[str, TensorEntry] = {}
        for file in files:
            header = _checked_header(file)
            for name, entry in header.entries.items():
                if name in entries:
                    raise CheckpointError(f"key {name} is in both {entries[name].path} and "
                                          f"{file}: which one to load is ambiguous")
                entries[name] = entry
        return cls(given, entries, tuple(files))

    @classmethod
    def _from_index(cls, index: Path, given: str) -> WeightsSource:
        data = read_json_object(index, INDEX_LIMIT, what="safetensors index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CorruptFileError(f"{index}: no weight_map of key -> file name")
        headers: dict[str, Header] = {}
        entries: dict[str, TensorEntry] = {}
        roots = allowed_roots(index.parent)
        for name, file_name in weight_map.items():
            if file_name not in headers:
                # A name read from the index: it must stay inside the index's directory.
                contained(index.parent, file_name, what=f"{index}: key {name}", roots=roots)
            file = index.parent / file_name
            if file_name not in headers:
                if not os.path.lexists(file):
                    raise CheckpointError(f"{index}: key {name} is in {file_name}, and "
                                          f"{file} does not exist")
                headers[file_name] = _checked_header(str(file))
            entry = headers[file_name].entries.get(name)
            if entry is None:
                raise CheckpointError(f"{index}: key {name} should be in {file}, which "
                                      "does not have it")
            entries[name] = entry
        return cls(given, entries, tuple(str(index.parent / f) for f in headers), str(index))

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def _checked_header(file: str) -> Header:
    header = read_header(file)
    if header.metadata.get("DCP_SHARDING_INFO"):
        raise CheckpointError(
            f"{file}: holds per-rank shards written by DCP's Hugging Face writer "
            "(save_distributed without consolidation), not whole tensors; consolidate "
            "them first (torch.distributed.checkpoint's consolidate_safetensors_files)")
    return header
