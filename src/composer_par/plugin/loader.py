"""The weights-loader base: what every plugin that materializes a model from stored
weights shares -- options, validation from headers alone, materialize-then-load.

:class:`WeightsLoader` runs in the materialize stage, after every sharding stage, so
``to_empty`` allocates only this rank's shards and each rank then reads only the bytes of
those shards. A subclass says where the tensors come from (:meth:`WeightsLoader.source_specs`)
and how they are loaded into the materialized model (:meth:`WeightsLoader.load_into`); the
functions at the end of this module do both for the two stored forms composer_par reads,
safetensors files and DCP checkpoints, so a loader plugin needs nothing but this package.

Tensors no source provides -- non-persistent buffers such as RoPE tables, and with
``strict=False`` the missing keys -- are initialized as MetaInit would, seeded by
``seed``, identically on every layout. The codes CP414-CP419 are the loaders' catalog.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from composer_par.blocks import clean_name
from composer_par.findings import Finding, Rule, Severity
from composer_par.plugin.base import Plugin, hookimpl

if TYPE_CHECKING:
    import torch.nn as nn

    from composer_par.checkpoint.adapter import StateDictAdapter
    from composer_par.checkpoint.matching import Match, Spec
    from composer_par.plugin.context import ApplyContext
    from composer_par.plugin.view import PlanView


def _path(value: Any) -> str:
    if not isinstance(value, (str, Path)) or not str(value):
        raise TypeError(f"path must be a file or directory path; got {value!r}")
    return str(value)


def _rename(value: Any) -> tuple[tuple[str, str], ...]:
    from composer_par.checkpoint.adapter import _rules

    return _rules(value or ())


def _adapter_option(value: Any) -> Any:
    if value is None or isinstance(value, str) or callable(getattr(value, "to_file", None)):
        return value
    raise TypeError(f"adapter must be 'module:attribute' or an object with to_file(name); "
                    f"got {value!r}")


def _seed(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63); got {value!r}")


def _bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be true or false; got {value!r}")


# The loaders' rule codes (LoadSafetensors and LoadCheckpoint share them).
_LOAD = 'ParallelPlan(MeshSpec()).use(LoadSafetensors("{}")).validate(model)'
RULES = (
    Rule("CP414", Severity.ERROR, "the weights lack keys the model needs",
         "map the model's names to the file's (rename, adapter), load weights of this model, "
         "or pass strict=false to initialize the missing tensors",
         _LOAD.format("missing.safetensors")),
    Rule("CP415", Severity.ERROR, "the weights hold keys the model does not have",
         "map the names with rename/adapter, or pass strict=false to skip them",
         _LOAD.format("extra.safetensors")),
    Rule("CP416", Severity.ERROR, "a weight's shape or dtype does not fit the model",
         "build the model with the configuration the weights were saved from",
         _LOAD.format("other_shapes.safetensors")),
    Rule("CP417", Severity.ERROR, "the weights or checkpoint cannot be read",
         "point path at complete, readable weights (download or save them again)",
         _LOAD.format("truncated.safetensors")),
    Rule("CP418", Severity.ERROR, "a tensor no weights provide and nothing can initialize",
         "give the module a reset_parameters() that fills its tensors, pass init_fn, or save "
         "them with the weights", _LOAD.format("weights_without_a_buffer.safetensors")),
    Rule("CP419", Severity.WARNING, "loading the weights loses precision",
         "build the model in the file's dtype (compute in lower precision with FSDP2's "
         "mixed_precision) if the precision matters",
         _LOAD.format("fp32_into_bf16.safetensors")),
)


@attrs.frozen
class WeightsLoader(Plugin):
    """Shared by the loaders: options, validation, and materialize-then-load.

    Subclasses say where the tensors come from (:meth:`source_specs`) and how to load them
    into the materialized model (:meth:`load_into`).
    """

    provides: ClassVar[frozenset[str]] = frozenset({"materialize"})
    source_kind: ClassVar[str] = "weights"
    rules: ClassVar[tuple[Rule, ...]] = RULES

    path: str = attrs.field(converter=_path)
    strict: bool = attrs.field(default=True, validator=_bool)
    rename: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_rename)
    adapter: Any = attrs.field(default=None, converter=_adapter_option)
    device: str | None = None
    seed: int = attrs.field(default=0, validator=_seed)
    init_fn: Any = None

    # -- for subclasses ------------------------------------------------------------------

    def source_specs(self) -> tuple[str, dict[str, Spec]]:
        """``(description of the source, key -> spec)`` from headers/metadata only."""
        raise NotImplementedError

    def specs_for(self, model: nn.Module) -> tuple[str, dict[str, Spec]]:
        """The source's specs as ``model`` reads them (default: :meth:`source_specs`; a
        loader that fuses stored tensors into one of the model's shows the fused one)."""
        return self.source_specs()

    def load_into(self, model: nn.Module, adapter: StateDictAdapter,
                  tied: dict[str, list[str]]) -> Any:
        """Load into the materialized model (``tied``: its tied-weight groups as they were
        before ``to_empty``); returns a LoadReport."""
        raise NotImplementedError

    # -- names ---------------------------------------------------------------------------

    def own_adapter(self) -> StateDictAdapter | None:
        from composer_par.checkpoint.adapter import Rename, combine, resolve_adapter

        parts = [resolve_adapter(self.adapter), Rename(self.rename) if self.rename else None]
        present = [p for p in parts if p is not None]
        return combine(present) if present else None

    @hookimpl
    def composer_par_state_dict_adapter(self) -> StateDictAdapter | None:
        return self.own_adapter()

    # -- validation ----------------------------------------------------------------------

    def match(self, plan: PlanView, model: nn.Module) -> Match:
        from composer_par.checkpoint.adapter import adapter_for
        from composer_par.checkpoint.matching import match, model_specs

        source, found = self.specs_for(model)
        specs, tied = model_specs(model)
        return match(source, specs, found, adapter_for(plan, model), tied)

    @hookimpl
    def composer_par_validate_model(self, plan: PlanView, model: nn.Module
                                    ) -> list[Finding]:
        from composer_par.checkpoint.errors import CheckpointError

        try:
            m = self.match(plan, model)
        except (CheckpointError, OSError, ValueError, TypeError, ImportError,
                AttributeError) as exc:
            detail = str(exc) if self.path in str(exc) else f"{self.path}: {exc}"
            return [Finding("CP417", f"cannot read the {self.source_kind}: {detail}",
                            fix=f"point path at complete, readable {self.source_kind} (a "
                            "truncated download or an unfinished save fails here)")]
        found = []
        if self.strict and m.missing:
            found.append(Finding(
                "CP414", _keys_message(f"{len(m.missing)} model key(s) are missing from "
                                       f"{m.source}", m.missing),
                fix="map the model's names to the file's with rename=[[pattern, replacement]] "
                "or an adapter, load a file of this model, or pass strict=false to "
                "initialize the missing tensors instead"))
        if self.strict and m.unexpected:
            found.append(Finding(
                "CP415", _keys_message(f"{len(m.unexpected)} key(s) in {m.source} are not in "
                                       "the model", m.unexpected),
                fix="map the names with rename=/adapter, or pass strict=false to skip "
                "them (DCP alone would skip them silently)"))
        for name, expected, got in m.mismatched[:10]:
            found.append(Finding(
                "CP416", f"{name}: the model expects {expected}, {m.source} has {got}",
                fix="build the model with the configuration the weights were saved from"))
        if m.lossy:
            name, model_dtype, file_dtype = m.lossy[0]
            found.append(Finding(
                "CP419", f"{len(m.lossy)} tensor(s) lose precision on load, e.g. {name}: "
                f"{file_dtype} in {m.source} into a {model_dtype} model",
                fix="build the model in the file's dtype (and use FSDP2 mixed_precision for "
                "compute) if the precision matters"))
        found += self._uninitializable(model, set(m.missing) if not self.strict else set())
        return found

    def _uninitializable(self, model: nn.Module, missing: set[str]) -> list[Finding]:
        from composer_par.plugin.initialize import initializer, post_order

        needing = _needing_init(post_order(model), missing)
        try:
            pick = initializer(model, self.init_fn)
        except (ImportError, AttributeError) as exc:
            if not needing:
                return []
            path, module, why = needing[0]
            return [Finding(
                "CP418", f"module {clean_name(path) or '<root>'} ({type(module).__name__}) "
                f"owns {why}, which no file provides, and init_fn {self.init_fn!r} cannot be "
                f"imported: {exc}", fix="give init_fn as 'importable.module:function'")]
        found = []
        for path, module, why in needing:
            if pick(module) is None:
                found.append(Finding(
                    "CP418", f"module {clean_name(path) or '<root>'} "
                    f"({type(module).__name__}) owns {why}, which no file provides, and has no "
                    "reset_parameters() to compute it",
                    fix=f"give {type(module).__name__} a reset_parameters() that fills its "
                    "buffers, pass init_fn=..., or save those tensors in the weights"))
        return found

    # -- apply ---------------------------------------------------------------------------

    @hookimpl
    def composer_par_materialize(self, ctx: ApplyContext) -> str:
        import torch

        from composer_par.checkpoint.adapter import combine
        from composer_par.checkpoint.matching import rest_of_model
        from composer_par.plugin.initialize import init_module, initializer, module_seed, post_order
        from composer_par.ties import retie, tied_names

        adapter = combine(ctx.hooks.state_dict_adapters(ctx.model))
        device = torch.device(self.device) if self.device else ctx.device
        model = ctx.model
        missing: set[str] = set()
        if not self.strict:
            missing = set(self.match(ctx.plan, model).missing)
        needing = [(p, m) for p, m, _ in _needing_init(post_order(model), missing)]
        tied = tied_names(model)  # to_empty unties them; retie() and the load restore them
        model.to_empty(device=device)
        retie(model, tied)
        pick = initializer(model, self.init_fn)
        for path, module in needing:
            init = pick(module)
            if init is None:  # validation reported it (CP418)
                raise RuntimeError(f"module {clean_name(path)} cannot be initialized")
            init_module(module, init, device, module_seed(self.seed, clean_name(path)))
        with rest_of_model(_held_elsewhere(ctx)):
            report = self.load_into(model, adapter, tied)
        ctx.notes[f"{self.name}_report"] = report
        detail = (f"to_empty on {device}; loaded {len(report.loaded)} tensor(s) from "
                  f"{self.path}")
        if report.bytes_read:
            detail += f" ({report.bytes_read / 2**20:.1f} MiB read on this rank)"
        if needing:
            detail += f"; initialized {len(needing)} module(s) the weights do not cover"
        return detail


def _held_elsewhere(ctx: ApplyContext) -> frozenset[str]:
    """Under a pipeline, the names of the whole model's tensors that this part lacks (the
    other stages'): the weights hold them, and the part's strict check must not call them
    unexpected. Validation matched the whole model against the weights already."""
    pipeline = ctx.pipeline
    if pipeline is None or not pipeline.model_keys:
        return frozenset()
    own = {clean_name(k) for k in ctx.model.state_dict(keep_vars=True)}
    return frozenset(k for k in pipeline.model_keys if k not in own)


def _keys_message(head: str, keys: tuple[str, ...] | list[str]) -> str:
    shown = ", ".join(keys[:5])
    more = f", ... (+{len(keys) - 5} more)" if len(keys) > 5 else ""
    return f"{head}: {shown}{more}"


def _needing_init(modules: Any, missing: set[str]) -> list[tuple[str, Any, str]]:
    """``(path, module, what)`` for modules owning tensors no file provides: their
    non-persistent buffers, and their own tensors named in ``missing``."""
    out = []
    for path, module in modules:
        name = clean_name(path)
        own = [n for n, b in module.named_buffers(recurse=False)
               if n in module._non_persistent_buffers_set and b is not None]
        own += [n for n, _ in [*module.named_parameters(recurse=False),
                               *module.named_buffers(recurse=False)]
                if (f"{name}.{n}" if name else n) in missing and n not in own]
        if own:
            out.append((path, module, ", ".join(own)))
    return out


# -- the two stored forms ------------------------------------------------------------------


def safetensors_specs(path: str) -> tuple[str, dict[str, Spec]]:
    """``(the files' description, key -> spec)`` of safetensors weights (a file, a
    directory or an index json), from their headers alone."""
    from composer_par.checkpoint.sources import WeightsSource
    from composer_par.checkpoint.weights import source_specs

    source = WeightsSource.open(path)
    return source.path, source_specs(source)


def load_safetensors_into(model: nn.Module, path: str, *, adapter: StateDictAdapter,
                          strict: bool, tied: dict[str, list[str]]) -> Any:
    """Load safetensors weights into the materialized, sharded model (each rank reads only
    its shards' bytes); returns a LoadReport."""
    from composer_par.checkpoint.weights import load_safetensors

    return load_safetensors(model, path, adapter=adapter, strict=strict, tied=tied)


def checkpoint_specs(path: str) -> tuple[str, dict[str, Spec]]:
    """``(the step directory, key -> spec)`` of the model part of a DCP checkpoint (a
    committed step, or a root's latest), from its metadata alone."""
    from composer_par.checkpoint import steps
    from composer_par.checkpoint.weights import checkpoint_model_specs

    directory = steps.resolve(path)
    specs, _ = checkpoint_model_specs(directory)
    return str(directory), specs


def load_checkpoint_into(model: nn.Module, path: str, *, adapter: StateDictAdapter,
                         strict: bool, tied: dict[str, list[str]]) -> Any:
    """Load the model part of a DCP checkpoint into the materialized, sharded model,
    resharded to its layout; returns a LoadReport."""
    from composer_par.checkpoint.weights import load_checkpoint_weights

    return load_checkpoint_weights(model, path, adapter=adapter, strict=strict, tied=tied)


# -- fused tensors made of several stored ones ---------------------------------------------


@attrs.frozen
class Part:
    """One stored tensor as a box of a larger one: its key, where the box begins, and its
    shape there (the stored shape, with size-1 dims where the larger tensor stacks)."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@attrs.frozen
class Fused:
    """A model tensor stored as several tensors (per-expert weights of fused experts):
    its shape and dtype name, and the boxes its stored tensors fill."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]


def fused_specs(found: dict[str, Spec], fused: dict[str, Fused]) -> dict[str, Spec]:
    """Stored specs with each fused tensor, under its own name, in place of its parts."""
    from composer_par.checkpoint.matching import Spec

    used = {part.key for tensor in fused.values() for part in tensor.parts}
    out = {k: v for k, v in found.items() if k not in used}
    out.update({name: Spec(tensor.shape, tensor.dtype) for name, tensor in fused.items()})
    return out


def load_safetensors_fused(model: nn.Module, path: str, fused: dict[str, Fused], *,
                           adapter: StateDictAdapter, strict: bool,
                           tied: dict[str, list[str]]) -> Any:
    """:func:`load_safetensors_into` where some model tensors are stored as several
    (``fused``: name -> its parts). DCP is told each fused tensor is stored in chunks, one
    per part, so it plans every rank's reads of its own part as for any tensor (also of a
    part a strided placement makes several boxes: see :mod:`composer_par.checkpoint.strided`)."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from composer_par.checkpoint import _dist
    from composer_par.checkpoint.errors import dcp_errors
    from composer_par.checkpoint.matching import match
    from composer_par.checkpoint.sources import WeightsSource
    from composer_par.checkpoint.strided import for_dcp
    from composer_par.checkpoint.weights import _finish, expected_specs, source_specs

    started = time.perf_counter()
    source = WeightsSource.open(path)
    state_dict: dict[str, Any] = dict(get_model_state_dict(model))
    m = match(source.path, expected_specs(state_dict, tied),
              fused_specs(source_specs(source), fused), adapter, tied)
    error = m.error(strict=strict)
    if error is not None:
        raise error
    to_load = {m.keys[n]: state_dict[n] for n in m.keys}
    reader = _fusing_reader(source, to_load, {k: v for k, v in fused.items() if k in to_load})
    with dcp_errors(f"loading {source.path}"):
        dcp.load(for_dcp(to_load), storage_reader=reader, no_dist=not _dist.active())
    return _finish(model, state_dict, m, strict=strict, started=started,
                   bytes_read=reader.bytes_read, tied=tied)


def _fusing_reader(source: Any, keys: Any, fused: dict[str, Fused]) -> Any:
    """The safetensors reader, describing each fused tensor as stored in chunks (one per
    part, whose bytes are the part's)."""
    from composer_par.checkpoint.hf_reader import SafetensorsReader

    class FusingReader(SafetensorsReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            import torch
            from torch.distributed.checkpoint.metadata import (
                ChunkStorageMetadata,
                MetadataIndex,
                TensorProperties,
                TensorStorageMetadata,
            )

            from composer_par.checkpoint.safetensors_io import torch_dtype

            metadata = super().read_metadata(*args, **kwargs)
            for name, tensor in fused.items():
                chunks = []
                for part in tensor.parts:
                    entry = self.source.entries[part.key]
                    offsets = torch.Size(part.offsets)
                    chunks.append(ChunkStorageMetadata(offsets=offsets,
                                                       sizes=torch.Size(part.shape)))
                    # The same bytes, seen with the size-1 dims of the box.
                    metadata.storage_data[MetadataIndex(fqn=name, offset=offsets)] = (
                        attrs.evolve(entry, shape=part.shape))
                metadata.state_dict_metadata[name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(entry.dtype)),
                    size=torch.Size(tensor.shape), chunks=chunks)
            return metadata

    return FusingReader(source, keys=[k for k in keys if k not in fused])


__all__ = [
    "RULES",
    "Fused",
    "Part",
    "WeightsLoader",
    "checkpoint_specs",
    "fused_specs",
    "load_checkpoint_into",
    "load_safetensors_fused",
    "load_safetensors_into",
    "safetensors_specs",
]
