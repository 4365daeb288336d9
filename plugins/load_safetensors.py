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

A transformers model's files may use older key names than the model (``save_pretrained``
writes GPT-NeoX's ``embed_out`` and ViT's ``encoder.layer.*.attention.attention.query``):
without ``rename`` or ``adapter``, the file's keys are renamed as transformers renames
them when it loads (its own conversion mapping, read from transformers, not re-typed
here). Its tensor conversions (per-expert tensors merged into fused experts) are not
names: a rank reads only its slices of whole tensors and cannot merge several, so such
files are refused (CP414/CP415), saying how to write them in the model's own layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import Finding, hookimpl
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
        report = load_safetensors_into(model, self.path, adapter=adapter, strict=self.strict,
                                       tied=tied)
        reload_strided(model, self.path, adapter)
        return report

    def transformers_names(self, model: nn.Module) -> tuple[TransformersNames | None,
                                                            list[str]]:
        """For a transformers model: the file's keys as transformers would rename them
        (``None`` when none needs it), and the keys it would merge into other tensors."""
        # The class or one it derives from (FSDP2 makes a subclass of the model's class).
        if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
            return None, []
        try:
            _, found = self.source_specs()
        except Exception:  # unreadable: validation reports it (CP417)
            return None, []
        return transformers_names(model, list(found))

    @hookimpl
    def composer_par_state_dict_adapter(  # type: ignore[override]  # the hook's model too
            self, model: nn.Module) -> StateDictAdapter | None:
        own = self.own_adapter()
        if own is not None:
            return own
        return self.transformers_names(model)[0]

    @hookimpl
    def composer_par_validate_model(self, plan: Any, model: nn.Module) -> list[Finding]:
        found = super().composer_par_validate_model(plan, model)
        merged = self.transformers_names(model)[1] if self.own_adapter() is None else []
        if not merged:
            return found
        why = (f" {len(merged)} of those keys ({merged[0]}, ...) are tensors transformers "
               "merges into one when it loads (per-expert weights into fused experts): each "
               "rank reads only its slices of whole tensors and cannot merge several")
        fix = ("load the file once with transformers (from_pretrained) and write it with "
               "composer_par.checkpoint.export_safetensors, which keeps the model's own "
               "layout; then load that")
        return [attrs.evolve(f, message=f.message + why, fix=fix) if f.code == "CP415" else f
                for f in found]

    @hookimpl
    def composer_par_describe(self) -> list[tuple[str, str]]:
        where = self.device or "the plan's device"
        return [("materialize", f"to_empty on {where}; load {self.path} (each rank reads only "
                 f"its shards' bytes{', strict' if self.strict else ''})")]


class TransformersNames:
    """Model names -> a file's older names, as transformers renames the file's keys when
    it loads it (an adapter: ``to_file(name)``)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = dict(names)

    def to_file(self, name: str) -> str:
        return self.names.get(name, name)

    def __repr__(self) -> str:
        return f"TransformersNames({len(self.names)} renamed)"


def transformers_names(model: Any, file_keys: list[str]) -> tuple[TransformersNames | None,
                                                                  list[str]]:
    """Rename each file key the model lacks with transformers' own conversion mapping (as
    ``from_pretrained`` does): the renamed keys the model has make the adapter; the keys a
    converter would merge are returned apart. transformers is imported only here, for a
    transformers model."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # another transformers: no renames
        return None, []
    # transformers looks its mapping up by the model's class name (GPT-NeoX's head rename
    # is GPTNeoXForCausalLM's); FSDP2 made the class a subclass named FSDP...: look it up
    # as the class transformers built.
    own = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    wrapped = type(model)
    try:
        model.__class__ = own
        transforms = get_model_conversion_mapping(model)
    finally:
        model.__class__ = wrapped
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = model.state_dict()
    names: dict[str, str] = {}
    merged: list[str] = []
    for key in sorted(file_keys):
        if key in state:
            continue
        renamed, pattern = rename_source_key(key, renamings, converters,
                                             getattr(model, "base_model_prefix", None), state)
        if pattern is not None and any(pattern in c.source_patterns for c in converters):
            merged.append(key)
        elif renamed != key and renamed in state and renamed not in names:
            names[renamed] = key
    return (TransformersNames(names) if names else None), merged


def _file_tensors(path: str) -> dict[str, str]:
    """Tensor key -> the safetensors file that holds it, for a file, a directory or an
    index json."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    given = Path(path)
    if given.suffix == ".json":
        weight_map = json.loads(given.read_text(encoding="utf-8"))["weight_map"]
        return {k: str(given.parent / v) for k, v in weight_map.items()}
    files = sorted(given.glob("*.safetensors")) if given.is_dir() else [given]
    out: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            out.update(dict.fromkeys(handle.keys(), str(file)))
    return out


def reload_strided(model: nn.Module, path: str, adapter: StateDictAdapter) -> int:
    """Read the parameters split by a strided placement (``strided_alone``) whole,
    on every rank, and keep this rank's part: each rank reads those tensors' full bytes
    (more than its share) so that the values are right. Returns how many were read."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from composer_par.plugin import clean_name
    from composer_par.plugin.initialize import keep_local_part, strided_alone

    wanted = [(clean_name(n), p) for n, p in model.named_parameters()
              if isinstance(p, DTensor) and strided_alone(p.placements)]
    if not wanted:
        return 0
    where = _file_tensors(path)
    for name, param in wanted:
        key = adapter.to_file(name)
        with safe_open(where[key], "pt") as handle:
            full = handle.get_tensor(key)
        with torch.no_grad():
            keep_local_part(param, full.to(device=param.device, dtype=param.dtype))
    return len(wanted)
