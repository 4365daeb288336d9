"""JSON objects read from checkpoint files, with one set of checks.

An index, a commit marker, the checkpoint info, a claim and a safetensors header are
each a JSON object written by another process, possibly truncated or not ours at all:
whatever is wrong with one becomes a CorruptFileError naming the file, never a bare
JSONDecodeError (or the RecursionError of a deeply nested document).
"""

from __future__ import annotations

import json
import os
from typing import Any

from composer_par.checkpoint.errors import CorruptFileError
from composer_par.checkpoint.paths import read_bounded


def parse_json_object(path: str | os.PathLike[str], raw: bytes, *, what: str
                      ) -> dict[str, Any]:
    """The JSON object in ``raw``, the bytes of the ``what`` at ``path``."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptFileError(f"{path}: the {what} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path}: the {what} is not a JSON object")
    return data


def read_json_object(path: str | os.PathLike[str], limit: int, *, what: str
                     ) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` of at most ``limit`` bytes."""
    return parse_json_object(path, read_bounded(path, limit, what=what), what=what)


__all__ = ["parse_json_object", "read_json_object"]
