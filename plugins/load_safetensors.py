"""LoadSafetensors: materialize a sharded model straight from safetensors weights.

Runs in the materialize stage, after every sharding stage, so ``to_empty`` allocates only
this rank's shards and each rank then reads only the bytes of those shards (through DCP's
planner and composer_par's safetensors reader). No rank ever holds the full model, on any
layout (FSDP2, HSDP, TP, 2-D). Options, validation and loading are the weights-loader
base's (:mod:`composer_par.plugin.loader`).

``path`` is a ``.safetensors`` file, a directory, or a Hugging Face index json (whose
``weight_map`` is followed exactly). Loading is strict by default: model keys the files
lack (CP414) and file keys the model lacks (CP415) are errors found at validation, from
the headers alone, before anything is allocated. Float dtypes convert on load.

Tensors no file provides -- non-persistent buffers such as RoPE tables, and with
``strict=False`` the missing keys -- are initialized as MetaInit would (the module's
``reset_parameters``, a Hugging Face ``_init_weights``, or ``init_fn``), seeded by
``seed``, identically on every layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import hookimpl
from composer_par.plugin.loader import WeightsLoader, load_safetensors_into, safetensors_specs

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.plugin.loader import Spec, StateDictAdapter


@attrs.frozen
class LoadSafetensors(WeightsLoader):
    """Materialize from safetensors: ``LoadSafetensors("weights/")``.

    Options: ``path`` (a ``.safetensors`` file, a directory, or an index json);
    ``strict`` (default true: missing and unexpected keys are errors); ``rename``
    (``[[pattern, replacement], ...]`` regular expressions mapping model names to file
    names) and ``adapter`` (an object or ``"module:attr"`` with ``to_file(name)``);
    ``device`` (default: the plan's); ``seed`` and ``init_fn`` for the tensors the files
    do not provide (non-persistent buffers; missing keys when not strict).
    """

    name: ClassVar[str] = "load_safetensors"
    source_kind: ClassVar[str] = "safetensors weights"

    def source_specs(self) -> tuple[str, dict[str, Spec]]:
        return safetensors_specs(self.path)

    def load_into(self, model: nn.Module, adapter: StateDictAdapter,
                  tied: dict[str, list[str]]) -> Any:
        return load_safetensors_into(model, self.path, adapter=adapter, strict=self.strict,
                                     tied=tied)

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        where = self.device or "the plan's device"
        return [("materialize", f"to_empty on {where}; load {self.path} (each rank reads only "
                 f"its shards' bytes{', strict' if self.strict else ''})")]
