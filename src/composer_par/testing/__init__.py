"""Test helpers: run real ``torch.distributed`` ranks on CPU (see :mod:`.distributed`)."""

from composer_par.testing.distributed import RankFailure, RankTimeout, run_ranks

__all__ = ["RankFailure", "RankTimeout", "run_ranks"]
