"""``torch.save`` files written by other tools (FSDP1's full state dicts, DeepSpeed's ZeRO
checkpoints), read without running any code from them.

:func:`load_tensors_file` is the one way such a file is opened: as the checkpoint readers
open theirs (:func:`~composer_par.checkpoint.paths.open_regular`: a regular file, or a
named error at once, never a wait on a pipe), then ``torch.load(weights_only=True)``,
memory-mapped, which unpickles tensors and plain containers only, plus the classes the
caller names (each read into a stand-in of the caller's). Whatever goes wrong is a
:class:`~composer_par.checkpoint.CorruptFileError` naming the file and why, including a
pickle that names a class it may not load: torch's own message for that advises
``weights_only=False``, which would run the file's code, so it is never passed on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from composer_par.checkpoint.errors import CorruptFileError
from composer_par.checkpoint.paths import open_regular


def load_tensors_file(path: str | os.PathLike[str], *, what: str,
                      allowed: Mapping[str, type] | None = None) -> Any:
    """The object ``torch.save`` wrote to ``path`` (tensors memory-mapped), where ``what``
    names the file in errors ("a DeepSpeed checkpoint file") and ``allowed`` maps the
    qualified names of the only other classes the file may name to their stand-ins."""
    import torch

    fd = open_regular(path, what=what)
    try:
        # Read the file just opened and checked, not whatever the name points at now.
        by_fd = f"/proc/self/fd/{fd}"
        source = by_fd if os.path.exists(by_fd) else os.fspath(path)
        globals_ = [(cls, name) for name, cls in (allowed or {}).items()]
        with torch.serialization.safe_globals(globals_):  # type: ignore[arg-type]
            return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # any failure to read it is bad input
        raise CorruptFileError(f"{path}: cannot read it as {what} ({refusal(exc)})") \
            from None
    finally:
        os.close(fd)


def refusal(exc: BaseException) -> str:
    """Why ``torch.load`` refused: for a pickle naming a class ``weights_only`` does not
    allow, that class and that nothing ran (torch's own first line suggests
    ``weights_only=False``, which is no fix); else the error's first line."""
    text = str(exc)
    refused = re.search(r"GLOBAL ([\w.]+)", text) or re.search(
        r"Unsupported global: ([\w.]+)", text)
    if refused:
        return (f"it names {refused.group(1)}, not a class such a file holds; nothing from "
                "the file ran")
    if "weights_only" in text or "Weights only load failed" in text:
        return ("it holds objects other than tensors and plain containers; it was not "
                "loaded and nothing from the file ran")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else 'unreadable'}"


__all__ = ["load_tensors_file", "refusal"]
