"""DCP's ``.metadata`` pickle, read without running code from it.

DCP writes its metadata with ``pickle.dump`` and reads it back with ``pickle.load``,
which calls whatever the file names: a ``.metadata`` edited by anyone who could write
the directory runs their code in every process that loads, inspects or converts it.
The metadata needs only a fixed set of classes (torch's
``torch/distributed/checkpoint/metadata.py`` and the file system reader's per-entry
record), so it is read here by an unpickler that finds those and nothing else: any
other name is refused, with the name, before anything is called.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from composer_par.checkpoint.errors import CorruptFileError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"

#: (module, name) of everything a DCP ``.metadata`` pickle refers to.
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_METADATA_MODULE, "Metadata"),
    (_METADATA_MODULE, "MetadataIndex"),
    (_METADATA_MODULE, "StorageMeta"),
    (_METADATA_MODULE, "TensorStorageMetadata"),
    (_METADATA_MODULE, "BytesStorageMetadata"),
    (_METADATA_MODULE, "ChunkStorageMetadata"),
    (_METADATA_MODULE, "TensorProperties"),
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # A torch.layout is pickled as this lookup of the layout by its name.
    ("torch.serialization", "_get_layout"),
    # The checkpoint id DCP records, when the writer was given a path.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})


class UnreadableMetadataError(CorruptFileError):
    """A ``.metadata`` file whose bytes are not DCP metadata (whatever its digest says)."""


class RefusedClassError(UnreadableMetadataError):
    """The metadata names a class or function that DCP metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in ALLOWED:
            raise RefusedClassError(
                f"{self.path}: refers to {module}.{name}, which DCP metadata never holds; "
                "refused without reading further (a .metadata file can run code when "
                "unpickled: this one was not written by DCP)")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedClassError(f"{self.path}: holds a persistent reference, which DCP "
                                "metadata never does")


def loads(data: bytes, path: str | os.PathLike[str]) -> Any:
    """The object in ``data``, the bytes of the ``.metadata`` file at ``path``: only the
    classes of :data:`ALLOWED` (and torch's dtypes) are found; anything else is a
    :class:`RefusedClassError` naming the file and the class. Bytes that are not a
    pickle are an :class:`UnreadableMetadataError` naming the file."""
    try:
        return _MetadataUnpickler(data, str(path)).load()
    except RefusedClassError:
        raise
    except Exception as exc:
        raise UnreadableMetadataError(f"{path}: unreadable ({type(exc).__name__}: {exc})") \
            from exc


__all__ = ["ALLOWED", "RefusedClassError", "UnreadableMetadataError", "loads"]
