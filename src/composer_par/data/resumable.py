"""A data loader with a position: ``state_dict`` says how many batches of the current
epoch it has handed out, ``load_state_dict`` makes its next pass over that epoch start at
the batch after them.

    loader = ResumableLoader(DataLoader(dataset, batch_size=8, sampler=sampler))
    checkpoint.save(path, model, optimizer, extra={"loader": loader.state_dict()})
    ...
    loader.load_state_dict(info.extra["loader"])   # then sampler.set_epoch(epoch) as usual

The Lightning Trainer's strategy of a plan wraps the training loader in one, so that
Lightning (which keeps the state of every loader that has ``state_dict`` and
``load_state_dict``) restores the position of a checkpoint taken mid-epoch.

The batches already trained are skipped by their sample indices where the loader batches
with torch's ``BatchSampler`` (a ``batch_size`` given to ``DataLoader``): no sample of
them is read. Any other loader reads them and drops them. The position belongs to an
epoch (the sampler's ``epoch``, as ``set_epoch`` left it): a pass over another epoch, or
a position at the epoch's end, starts at the first batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader


class _SkipFirst:
    """``sampler`` without its first ``count`` indices, for one pass; its length stays
    the whole sampler's, since the loops that count batches count the whole epoch."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self) -> int:
        return len(self.sampler)


class ResumableLoader:
    """``loader`` (a sized ``DataLoader``) with a position in its epoch; every other
    attribute is the loader's own."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        try:
            len(loader)
        except TypeError:
            raise TypeError(f"{type(loader).__name__} has no length: a position in an "
                            "epoch needs a loader over a sized dataset") from None
        self.loader = loader
        self._epoch: int | None = None  # the epoch of the pass under way (or last)
        self._batches = 0  # batches that pass handed out
        self._resume: dict[str, Any] | None = None

    # -- the position --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch": ..., "batches": ...}``: the batches of ``epoch`` handed out so far
        (JSON; the same on every rank of a data-parallel job)."""
        return {"epoch": self._epoch, "batches": self._batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass over ``state["epoch"]`` starts after its ``state["batches"]``."""
        self._resume = {"epoch": state.get("epoch"), "batches": int(state.get("batches", 0))}

    def _sampler_epoch(self) -> int | None:
        for sampler in (getattr(self.loader, "sampler", None),
                        getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            epoch = getattr(sampler, "epoch", None)
            if isinstance(epoch, int):
                return epoch
        return None

    def _to_skip(self, epoch: int | None) -> int:
        resume, self._resume = self._resume, None
        if resume is None or resume["epoch"] != epoch:
            return 0
        batches = int(resume["batches"])
        return batches if 0 < batches < len(self.loader) else 0

    # -- iterating -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        # A generator: the epoch is read when the first batch is asked for, after the
        # loop has called set_epoch, not when the iterator is made.
        epoch = self._sampler_epoch()
        skip = self._to_skip(epoch)
        self._epoch, self._batches = epoch, skip
        for batch in self._batches_after(skip):
            self._batches += 1
            yield batch
        self._batches = 0  # the epoch ended: its next pass starts at the first batch

    def _batches_after(self, skip: int) -> Iterable[Any]:
        if skip == 0:
            return self.loader
        batcher = self.loader.batch_sampler
        if type(batcher) is not BatchSampler:
            return itertools.islice(self.loader, skip, None)
        # torch's BatchSampler reads its sampler when the loader first asks it for a
        # batch: the sampler is swapped for that pass only and put back at its first batch.
        sampler = batcher.sampler
        batcher.sampler = _SkipFirst(sampler, skip * batcher.batch_size)
        return _restoring(iter(self.loader), batcher, sampler)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    # Lightning sets worker_init_fn on the loader it iterates (PL_SEED_WORKERS).
    @property
    def worker_init_fn(self) -> Any:
        return self.loader.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, value: Any) -> None:
        self.loader.worker_init_fn = value


def _restoring(batches: Iterator[Any], batcher: BatchSampler, sampler: Any) -> Iterator[Any]:
    try:
        first = next(batches)
    except StopIteration:
        return
    finally:
        batcher.sampler = sampler
    yield first
    yield from batches
