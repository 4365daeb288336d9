"""Data helpers: a loader that remembers where it is in its epoch, so that a run resumed
from a checkpoint continues at the next batch (:class:`ResumableLoader`). The plan's data
shard itself is ``plan.data_shard()``. Importing this package imports torch."""

from composer_par.data.resumable import ResumableLoader

__all__ = ["ResumableLoader"]
