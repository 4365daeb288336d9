"""composer-par-compress: gradient compression for the replicate dim of composer_par plans.

    plan = (ParallelPlan(MeshSpec(dp_replicate=4, dp_shard=8))
            .use(HSDP()).use(FSDP2()).use(Compress(method="powersgd", rank=4))
            .use(MetaInit(seed=0)))

Registered as ``compress`` in the ``composer_par.plugins`` entry-point group. Importing
this package does not import torch.
"""

from composer_par_compress.plugin import METHODS, RULES, Compress

__version__ = "0.1.0"

__all__ = ["METHODS", "RULES", "Compress"]
