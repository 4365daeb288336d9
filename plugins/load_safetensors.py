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
here). The mapping's merges of per-expert tensors into fused experts (Mixtral's
``experts.0.w1.weight``... stacked on the expert dim, gate and up concatenated into
``experts.gate_up_proj``) are done too: each fused tensor is described as the boxes its
per-expert tensors fill, so each rank reads only the bytes of its own part, on every
layout. A conversion of another kind (a permutation, a split) is refused at validation
(CP415), saying how to write the file in the model's own layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.plugin import Finding, hookimpl
from composer_par.plugin.loader import (
    Fused,
    Part,
    WeightsLoader,
    fused_specs,
    load_safetensors_fused,
    safetensors_specs,
)

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
        # One DCP read for every tensor, fused ones (per-expert in the file) included.
        return load_safetensors_fused(model, self.path, self.layout(model).merges,
                                      adapter=adapter, strict=self.strict, tied=tied)

    def layout(self, model: nn.Module) -> TransformersLayout:
        """For a transformers model read without ``rename``/``adapter``: the file's keys as
        transformers renames and merges them when it loads (empty for other models)."""
        # The class or one it derives from (FSDP2 makes a subclass of the model's class).
        if self.own_adapter() is not None or not any(
                c.__module__.startswith("transformers.") for c in type(model).__mro__):
            return TransformersLayout()
        try:
            _, found = self.source_specs()
        except Exception:  # unreadable: validation reports it (CP417)
            return TransformersLayout()
        return transformers_layout(model, found)

    def specs_for(self, model: nn.Module) -> tuple[str, dict[str, Spec]]:
        source, found = self.source_specs()
        merges = self.layout(model).merges
        return source, fused_specs(found, merges) if merges else found

    @hookimpl
    def composer_par_state_dict_adapter(  # type: ignore[override]  # the hook's model too
            self, model: nn.Module) -> StateDictAdapter | None:
        own = self.own_adapter()
        if own is not None:
            return own
        return self.layout(model).names

    @hookimpl
    def composer_par_validate_model(self, plan: Any, model: nn.Module) -> list[Finding]:
        found = super().composer_par_validate_model(plan, model)
        refused = self.layout(model).refused
        if not refused:
            return found
        first = next(iter(refused))
        why = (f" {len(refused)} of those keys ({first}, ...) are tensors transformers "
               f"converts when it loads, in a way not done here: {refused[first]}")
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


@attrs.frozen
class TransformersLayout:
    """A file's keys as transformers reads them into a model: ``names`` (model name ->
    the file's older name), ``merges`` (fused model tensor -> the file tensors it is made
    of) and ``refused`` (file key -> why it cannot be converted here)."""

    names: TransformersNames | None = None
    merges: dict[str, Fused] = attrs.field(factory=dict)
    refused: dict[str, str] = attrs.field(factory=dict)


def transformers_layout(model: Any, found: dict[str, Spec]) -> TransformersLayout:
    """Rename each file key the model lacks with transformers' own conversion mapping (as
    ``from_pretrained`` does). Keys renamed to a model name make the adapter; keys a
    converter merges (per-expert tensors stacked on a new expert dim, then, for several
    source patterns, concatenated along a dim) make a fused tensor of boxes; what another
    kind of converter would do is refused. transformers is imported only here, for a
    transformers model."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # another transformers: no renames
        return TransformersLayout()
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
    state = model.state_dict(keep_vars=True)
    names: dict[str, str] = {}
    # target -> (converter, {source pattern index: {expert index: file key}})
    collected: dict[str, tuple[Any, dict[int, dict[int, str]]]] = {}
    refused: dict[str, str] = {}
    for key in sorted(found):
        if key in state:
            continue
        renamed, pattern = rename_source_key(key, renamings, converters,
                                             getattr(model, "base_model_prefix", None), state)
        converter = next((c for c in converters if pattern in c.source_patterns), None)
        if converter is None:
            # Renamed even where the model lacks the name (a pipeline stage holding other
            # layers, or not the head): the match then counts the file key as held by the
            # part that has the name, not as unexpected.
            if renamed != key and renamed not in names:
                names[renamed] = key
            continue
        # Merged even where the model lacks the target (a pipeline stage holding other
        # layers): the fused tensor is then one key of the file the model does not have.
        why = _unsupported(converter)
        index = _expert_index(key, str(pattern))
        if not why and index is None:
            why = f"its expert number is not where the pattern {pattern} has it"
        if why:
            refused[key] = why
            continue
        _, by_pattern = collected.setdefault(renamed, (converter, {}))
        assert pattern is not None and index is not None  # a converter matched it
        by_pattern.setdefault(converter.source_patterns.index(pattern), {})[index] = key
    merges: dict[str, Fused] = {}
    for target, (converter, by_pattern) in collected.items():
        fused, why = _fuse(converter, by_pattern, found)
        if fused is None:
            refused.update({k: why for keys in by_pattern.values() for k in keys.values()})
        else:
            merges[target] = fused
    return TransformersLayout(TransformersNames(names) if names else None, merges, refused)


def _unsupported(converter: Any) -> str:
    """Why the converter's operations are not the merges done here ("" when they are):
    a stack of module-list tensors, then optionally one concatenation."""
    ops = [type(op).__name__ for op in converter.operations]
    if ops in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
        return ""
    return f"its conversion is {' then '.join(ops)}, not a merge of per-expert tensors"


def _expert_index(key: str, pattern: str) -> int | None:
    """The expert number in ``key`` where ``pattern`` (``.experts.*.w1.weight``) has its
    ``*``: transformers stacks the tensors in the keys' natural order, which for numbers
    0..n-1 is this one."""
    import re

    pieces = pattern.split("*.")
    if len(pieces) != 2:
        return None
    found = re.search(re.escape(pieces[0]) + r"(\d+)\." + re.escape(pieces[1]) + r"$", key)
    return int(found.group(1)) if found else None


def _fuse(converter: Any, by_pattern: dict[int, dict[int, str]], found: dict[str, Spec]
          ) -> tuple[Fused | None, str]:
    """The fused tensor ``converter`` makes of the file tensors (source pattern index ->
    expert number -> key): each stacked on the merge's dim, the stacks concatenated in the
    patterns' order; or None and why it cannot be made."""
    stack = converter.operations[0].dim
    cat = converter.operations[1].dim if len(converter.operations) > 1 else None
    patterns = len(converter.source_patterns)
    if sorted(by_pattern) != list(range(patterns)):
        missing = [converter.source_patterns[i] for i in range(patterns) if i not in by_pattern]
        return None, f"the file has no tensors for {', '.join(missing)}"
    counts = {len(experts) for experts in by_pattern.values()}
    first = found[next(iter(by_pattern[0].values()))]
    for experts in by_pattern.values():
        if sorted(experts) != list(range(len(experts))):
            return None, f"the experts numbered {sorted(experts)} are not 0..{len(experts) - 1}"
        for key in experts.values():
            spec = found[key]
            if spec.dtype != first.dtype or len(spec.shape) != len(first.shape):
                return None, f"{key} is {spec.describe()}, the other parts {first.describe()}"
    if len(counts) != 1:
        return None, f"the source patterns have different numbers of experts ({sorted(counts)})"
    count = counts.pop()
    parts: list[Part] = []
    shape: list[int] | None = None
    start = 0  # where this pattern's stack begins on the concatenation dim
    for index in range(patterns):
        experts = by_pattern[index]
        stored = found[experts[0]].shape
        stacked = [*stored[:stack], count, *stored[stack:]]
        if any(tuple(found[k].shape) != tuple(stored) for k in experts.values()):
            return None, f"the tensors of {converter.source_patterns[index]} differ in shape"
        if shape is None:
            shape = stacked
        elif cat is None:
            return None, "several source patterns and no concatenation"
        else:
            if [n for d, n in enumerate(stacked) if d != cat] != [
                    n for d, n in enumerate(shape) if d != cat]:
                return None, (f"{converter.source_patterns[index]} does not fit beside "
                              f"{converter.source_patterns[0]} on dim {cat}")
            shape[cat] += stacked[cat]
        box = tuple([*stored[:stack], 1, *stored[stack:]])
        for expert in range(count):
            offsets = [0] * len(box)
            offsets[stack] = expert
            if cat is not None:
                offsets[cat] += start
            parts.append(Part(experts[expert], tuple(offsets), box))
        start += stacked[cat] if cat is not None else 0
    assert shape is not None
    return Fused(tuple(shape), first.dtype, tuple(parts)), ""
