"""LoadCheckpoint: materialize a sharded model from the model part of a DCP checkpoint.

``path`` is a committed step directory, or a checkpoint root (its latest committed
step). The checkpoint may have been saved on any mesh and world size: DCP reshards to
this plan's layout, each rank reading only the stored chunks that overlap its shards.
Options and validation are the weights-loader base's (:mod:`composer_par.plugin.loader`),
as for :class:`~composer_par.LoadSafetensors`: strict keys, ``rename``/``adapter``,
initialization of what the checkpoint does not hold.

Validation checks ``.metadata`` against the digest the save committed; loading checks
every stored chunk it reads before it reaches the model, and a changed or truncated file
is an error naming it (see docs/checkpoints.md, "Integrity and exclusive saves").

To resume training (optimizer state, RNG, step) use ``composer_par.checkpoint.load``
after ``apply``; this plugin loads weights only. DCP's metadata is a pickle, read by an
unpickler that finds only the classes DCP metadata holds: it runs no code from the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import hookimpl
from composer_par.plugin.loader import WeightsLoader, checkpoint_specs, load_checkpoint_into

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin.loader import Spec, StateDictAdapter


@attrs.frozen
class LoadCheckpoint(WeightsLoader):
    """Materialize from a DCP checkpoint: ``LoadCheckpoint("ckpt/")`` (its latest step).

    Options as :class:`~composer_par.LoadSafetensors`: ``path``, ``strict``, ``rename``,
    ``adapter``, ``device``, ``seed``, ``init_fn``.
    """

    name: ClassVar[str] = "load_checkpoint"
    source_kind: ClassVar[str] = "DCP checkpoint"

    def source_specs(self) -> tuple[str, dict[str, Spec]]:
        return checkpoint_specs(self.path)

    def load_into(self, model: nn.Module, adapter: StateDictAdapter,
                  tied: dict[str, list[str]]) -> Any:
        return load_checkpoint_into(model, self.path, adapter=adapter, strict=self.strict,
                                    tied=tied)

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        where = self.device or "the plan's device"
        return [("materialize", f"to_empty on {where}; load the model from DCP checkpoint "
                 f"{self.path} (resharded to this layout{', strict' if self.strict else ''})")]
