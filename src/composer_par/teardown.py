"""Ending a rank with every process group destroyed and its native threads joined.

A gloo process group runs native threads (its work loops and its transport's event
loop) that its destructor stops and joins. The destructor runs when the last reference
to the group goes, and ``destroy_process_group`` drops only torch's registry of groups:
the objects that use a group hold it too (a device mesh, a model's FSDP state, its
DTensors, often in reference cycles), and torch itself keeps one by accident:
``torch.distributed.nn.functional`` binds ``group.WORLD`` as the default argument of its
functions when it is first imported, and ``torch.distributed.checkpoint``, DTensor and
sharded tensors import it, so imported after ``init_process_group`` it holds the default
group for as long as the module lives. A group still alive at the interpreter's teardown
is destroyed among torch's own static objects, or not at all while its threads run, and
the process can abort there ("terminate called without an active exception") after its
work finished.

So an entry point that runs a rank calls its function through :func:`call_rank` (or, as
a script, ``sys.exit(run_rank(main))``): that imports the module above before any group
exists, and after the function returned or raised frees what its frames held and
collects the cycles, so that every group's destructor joins its threads there.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["call_rank", "native_threads", "process_group_threads", "run_rank"]

_R = TypeVar("_R")
# How torch and gloo name the threads of a process group (gloo's work loops and transport
# loop; NCCL's watchdog and heartbeat monitor).
_GROUP_THREADS = ("pt_gloo", "gloo_", "pt_nccl")


def call_rank(fn: Callable[..., _R], *args: object, **kwargs: object) -> _R:
    """``fn(*args, **kwargs)``, a rank's work from ``init_process_group`` to
    ``destroy_process_group``; when it returns or raises, no object it made is left
    holding a process group. An exception is re-raised with its traceback (the frames'
    locals cleared: they held the model and its groups)."""
    # Before any group exists, so that its default arguments hold None, not the group.
    import torch.distributed.nn  # noqa: F401

    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        _clear_dtensor_caches()
        gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding and redistribution plans: their keys and values
    hold device meshes, and a mesh holds its process groups."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor was made
        return
    from composer_par.plugin import torch_private

    torch_private.clear_dtensor_caches()


def run_rank(main: Callable[[], object]) -> int:
    """Run a script's ``main`` through :func:`call_rank`; its exit status (0, or 1 with
    the traceback printed). For ``sys.exit(run_rank(main))``.

    If a process group's thread is still running afterwards (a group something outside
    ``main`` still holds), the interpreter's teardown could abort on it: the rank then
    says which threads, flushes its output and ends at once with the same status."""
    try:
        call_rank(main)
        status = 0
    except Exception:
        traceback.print_exc()
        status = 1
    left = process_group_threads()
    if left:
        logging.getLogger("composer_par.teardown").warning(
            "process group threads still running at exit, ending without the interpreter's "
            "teardown: %s", ", ".join(left))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def native_threads() -> list[str]:
    """Names of this process's threads that Python did not start, the main thread aside
    (Linux; an empty list elsewhere)."""
    python = {t.native_id for t in threading.enumerate()}
    names = []
    try:
        tasks = sorted(Path("/proc/self/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        if not task.name.isdigit() or int(task.name) in python:
            continue
        with contextlib.suppress(OSError):  # ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names


def process_group_threads() -> list[str]:
    """The :func:`native_threads` that belong to a process group (gloo's, NCCL's)."""
    return [name for name in native_threads() if name.startswith(_GROUP_THREADS)]
