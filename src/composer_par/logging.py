"""Log events through Python's ``logging``, formatted by structlog.

The library never configures logging, on import or anywhere else. Its modules call
:func:`get_logger`: a structlog logger that hands each event to the standard library
logger of the same name (``composer_par.plan``, ``composer_par.mesh``, ...), so the
application's logging configuration decides what is shown and where. With none, Python
shows WARNING and above on stderr (its last-resort handler) and nothing below; nothing
goes to stdout. Applications (the CLI's demo, ``examples/train.py``, a user's script)
may call :func:`configure_logging` once, which installs a root handler that binds rank,
local rank and (after apply) mesh coordinates, renders for humans on a TTY and JSON
otherwise, and keeps ranks other than 0 quiet unless asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# The name configure_logging gives its handler, so a second call replaces it.
_HANDLER_NAME = "composer_par.configure_logging"


class _LogEvent(dict[str, Any]):
    """One event on its way through ``logging``: ``record.msg`` is this dict, which
    structlog's ``ProcessorFormatter`` renders with every field, and which any other
    formatter (``basicConfig``'s, the last-resort handler's) shows as one line:
    ``applied stage='materialize' plugin='meta_init'``."""

    def __str__(self) -> str:
        fields = "".join(f" {key}={value!r}" for key, value in self.items()
                         if key != "event" and not key.startswith("_"))
        return f"{self.get('event', '')}{fields}"


def _to_logging(logger: Any, method_name: str, event_dict: Any) -> Any:
    """The last processor: the event becomes the message of a standard library record."""
    import structlog

    return structlog.stdlib.ProcessorFormatter.wrap_for_formatter(
        logger, method_name, _LogEvent(event_dict))


def _processors() -> list[Callable[..., Any]]:
    """What every event goes through before ``logging``: dropped at once below the
    logger's level, then the bound context (rank, mesh coordinate) merged in."""
    import structlog

    return [structlog.stdlib.filter_by_level, structlog.contextvars.merge_contextvars,
            _to_logging]


class _LazyLogger:
    """Imports structlog on the first log call: the static CLI path never logs, and
    importing structlog is a sizeable share of its start-up time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self._logger is None:
            import structlog

            # Its own processors, not structlog's global configuration, whose default
            # prints to stdout: the standard library's configuration alone decides.
            self._logger = structlog.stdlib.BoundLogger(
                logging.getLogger(self._name), _processors(), {})
        return getattr(self._logger, attr)


def get_logger(name: str) -> Any:
    """A structlog logger for module ``name`` (pass ``__name__``) that logs through the
    standard library logger of that name."""
    return _LazyLogger(name)


def _rank_from_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))


def configure_logging(
    *, level: str | int = "INFO", all_ranks: bool = False, json: bool | None = None,
    stream: Any = None,
) -> None:
    """Set up logging for an application (never called by the library itself).

    Installs one handler on the root logger (replacing the one an earlier call
    installed) that writes to ``stream`` (stderr by default) through structlog's
    ``ProcessorFormatter``, sets the root logger's level to ``level``, and points
    structlog's own ``get_logger`` at the standard library too, so the library's
    events, the application's and other libraries' records share one output. Every
    event carries ``rank`` and ``local_rank`` (from the environment torchrun sets) and,
    after apply, ``mesh``. ``json=None`` picks the console renderer on a TTY and JSON
    lines otherwise. Ranks other than 0 show only errors unless ``all_ranks``.
    """
    import structlog

    stream = stream or sys.stderr
    rank, local_rank = _rank_from_env()
    on_tty = hasattr(stream, "isatty") and stream.isatty()
    if json is None:
        json = not on_tty
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=on_tty))
    formatter = structlog.stdlib.ProcessorFormatter(
        # Records from plain logging calls (other libraries) get the context too.
        foreign_pre_chain=[structlog.contextvars.merge_contextvars],
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    if not all_ranks and rank != 0:
        # Every rank says the same; an error is worth seeing from whichever rank has it.
        handler.addFilter(lambda record: record.levelno >= logging.ERROR)

    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)

    structlog.configure(
        processors=_processors(),
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(rank=rank, local_rank=local_rank)


@contextlib.contextmanager
def library_events_held() -> Iterator[None]:
    """Hold back the library's own log events, whatever the configuration, for a tool
    that reports what they say itself (the dry run)."""
    library = logging.getLogger("composer_par")
    level = library.level
    library.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        library.setLevel(level)


def bind_mesh_coordinate(coordinate: dict[str, int]) -> None:
    """Add this rank's mesh coordinates to every later event (called after apply)."""
    import structlog

    structlog.contextvars.bind_contextvars(mesh=dict(coordinate))
