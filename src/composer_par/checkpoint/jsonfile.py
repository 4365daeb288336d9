"""JSON objects read from checkpoint files, with one set of checks.

An index, a commit marker, the checkpoint info, a claim and a safetensors header are
each a JSON object written by another process, possibly truncated or not ours at all:
whatever is wrong with one becomes a :class:`MalformedJsonError` naming the file, never
a bare JSONDecodeError, the ValueError of an integer too long to convert, or the
RecursionError of a deeply nested document. A document nested deeper than
:data:`MAX_DEPTH` is refused too: none of these files nests more than a few levels, and
a deeper one that the decoder still accepted would make whatever walks it later (a
message that quotes a field, the optimizer state rebuilt from it) run out of stack.
"""

from __future__ import annotations

import json
import os
from typing import Any

from composer_par.checkpoint.errors import CorruptFileError
from composer_par.checkpoint.paths import read_bounded

#: The deepest nesting of lists and objects accepted in a checkpoint's JSON file.
MAX_DEPTH = 100


class MalformedJsonError(CorruptFileError):
    """A JSON file of a checkpoint or of weights that is not a readable JSON object."""


def depth_exceeds(data: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether lists and objects nest in ``data`` deeper than ``limit`` (walked without
    recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def parse_json_object(path: str | os.PathLike[str], raw: bytes, *, what: str
                      ) -> dict[str, Any]:
    """The JSON object in ``raw``, the bytes of the ``what`` at ``path``."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise MalformedJsonError(f"{path}: the {what} is not valid JSON ({reason})") \
            from None
    if not isinstance(data, dict):
        raise MalformedJsonError(f"{path}: the {what} is not a JSON object")
    if depth_exceeds(data, MAX_DEPTH):
        raise MalformedJsonError(f"{path}: the {what} is not valid JSON for it (nested "
                                 f"deeper than {MAX_DEPTH} levels)")
    return data


def read_json_object(path: str | os.PathLike[str], limit: int, *, what: str
                     ) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` of at most ``limit`` bytes."""
    return parse_json_object(path, read_bounded(path, limit, what=what), what=what)


__all__ = ["MAX_DEPTH", "MalformedJsonError", "depth_exceeds", "parse_json_object",
           "read_json_object"]
