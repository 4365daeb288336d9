"""One training step as the estimator sees it: sequence, micro-batch, dtypes, optimizer,
activation checkpointing, gradient accumulation (and when it reduces) and attention
kernel."""

from __future__ import annotations

from typing import Any

import attrs

from composer_par.estimate.errors import EstimateError
from composer_par.estimate.units import compute_dtype, optional_dtype
from composer_par.gradient_sync import SYNC_POLICIES  # the training step's own (no torch)

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
AC_MODES = ("none", "selective", "full")
ATTENTION = ("sdpa", "eager")


def _positive_int(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{attribute.name} must be a positive int; got {value!r}")


@attrs.frozen
class Workload:
    """One training step: ``grad_accum`` micro-batches of ``micro_batch`` sequences of
    ``seq`` tokens per data-parallel rank, their gradients reduced as ``sync`` says (the
    training step's ``accumulate=grad_accum, sync=...``: ``"last"`` once per step,
    ``"reduce_scatter"`` reduce-scatters per micro-batch and replicate all-reduces once,
    ``"every"`` both per micro-batch). ``dtype`` None takes the plan's mixed precision,
    else the model's dtype, else float32; ``activation_checkpoint`` None takes the plan's
    activation checkpointing plugin, else none; ``matmul_dtype`` None takes what the plan's
    plugins say the matmuls compute in, else ``dtype``."""

    seq: int = attrs.field(validator=_positive_int)
    micro_batch: int = attrs.field(default=1, validator=_positive_int)
    dtype: str | None = attrs.field(default=None, converter=optional_dtype)
    reduce_dtype: str | None = attrs.field(default=None, converter=optional_dtype)
    optimizer: str = attrs.field(default="adamw", validator=attrs.validators.in_(OPTIMIZERS))
    activation_checkpoint: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(AC_MODES)))
    grad_accum: int = attrs.field(default=1, validator=_positive_int)
    attention: str = attrs.field(default="sdpa", validator=attrs.validators.in_(ATTENTION))
    sync: str = attrs.field(default="last", validator=attrs.validators.in_(SYNC_POLICIES))
    # The dtype the matmuls compute in (float8 training); None: the plan's, else ``dtype``.
    matmul_dtype: str | None = attrs.field(
        default=None, converter=lambda v: None if v is None else compute_dtype(v))

    def reductions(self) -> tuple[int, int]:
        """The gradient reduce-scatters (shard dims) and replicate all-reduces each unit
        issues per optimizer step under ``sync``."""
        k = self.grad_accum
        if self.sync == "last":
            return 1, 1
        if self.sync == "reduce_scatter":
            return k, 1
        return k, k

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)
