"""structlog helpers. The library never configures logging on import.

Modules call :func:`get_logger`; applications (the CLI, the demo, a trainer) call
:func:`configure_logging` once, which binds rank, local rank and (after apply) mesh
coordinates, renders for humans on a TTY and JSON otherwise, and drops events from
ranks other than 0 unless asked.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any


class _LazyLogger:
    """Imports structlog on the first log call: the static CLI path never logs, and
    importing structlog is a sizeable share of its start-up time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self._logger is None:
            import structlog

            # structlog's proxy binds at call time, so configuring later still applies.
            self._logger = structlog.get_logger(self._name)
        return getattr(self._logger, attr)


def get_logger(name: str) -> Any:
    return _LazyLogger(name)


def _rank_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))


def configure_logging(
    *, level: str | int = "INFO", all_ranks: bool = False, json: bool | None = None,
    stream: Any = None,
) -> None:
    """Configure structlog for an application (not called by the library itself).

    ``json=None`` picks the console renderer on a TTY and JSON lines otherwise.
    """
    import structlog

    stream = stream or sys.stderr
    rank, local_rank = _rank_from_env()
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
    )

    def only_rank_zero(_: Any, __: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        if not all_ranks and event.get("rank", 0) != 0:
            raise structlog.DropEvent
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            only_rank_zero,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level) if isinstance(level, str) else level
        ),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(rank=rank, local_rank=local_rank)


def bind_mesh_coordinate(coordinate: dict[str, int]) -> None:
    """Add this rank's mesh coordinates to every later event (called after apply)."""
    import structlog

    structlog.contextvars.bind_contextvars(mesh=dict(coordinate))
