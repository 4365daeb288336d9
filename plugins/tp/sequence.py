"""Sequence parallel for a Hugging Face model: its own tp plan, or the auto plan from its
Llama names (a model without a plan of its own, StableLm).

A Hugging Face model computes its positions, rotary tables and attention mask from the
shape of the token embedding's output, inside its own forward. torchtitan's layout keeps
the residual stream as local sequence shards, and then those come out for a shard of the
sequence (a size mismatch in the first attention). Here the residual stream stays a
DTensor sharded on the sequence tensor dim, so its shape is the full sequence's and the
model computes positions, rotary tables and masks for all of it:

* the token embedding reduce-scatters onto the sequence and hands out the DTensor;
* every norm on the stream takes the ``sequence_parallel`` style (weights replicated,
  their gradients summed over tp by DTensor);
* each module whose children the plan splits (attention, the MLP) gathers its input once
  (``sequence_region``), kept a DTensor so that its colwise children do not gather again,
  and a plain (replicated) output goes back onto the sequence; one that also computes on
  plain tensors (a mixture-of-experts block's router, experts and shared expert) gets the
  gathered input as a plain tensor instead (``sequence_region_local``), its layers
  computing as without sequence parallel;
* every rowwise layer reduce-scatters onto the sequence and hands out the DTensor;
* the output head gathers its input.

A plan that leaves layers whole outside any module whose layers it splits has no layout
for them on the sequence-sharded stream: a reason is given instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .patterns import generalize
from .styles import StyleSpec

SEQ = ("shard(1)",)
# Entries whose module computes on a gathered (replicated) input.
_GATHERING = {"colwise", "colwise_gather", "packed_colwise", "local_colwise", "experts"}
_EMBEDDINGS = {"embedding_rowwise", "embedding_colwise"}


def is_norm(module: Any) -> bool:
    name = type(module).__name__
    return name.endswith("Norm") or "LayerNorm" in name or "RMSNorm" in name


def hf_sequence_parallel(specs: Mapping[str, StyleSpec], modules: Mapping[str, Any], *,
                         starts: bool = True, ends: bool = True,
                         plan: str = "the model's Hugging Face tp plan") -> tuple[
    dict[str, StyleSpec], str | None
]:
    """The plan's entries (module path -> spec) with sequence-parallel layouts, and a reason
    when this model's plan cannot have them (nothing else changes then). ``starts``/
    ``ends``: the model begins / ends the whole model (a pipeline stage may not); ``plan``
    names the plan in the reason."""
    out = dict(specs)
    if not (starts and ends):
        return out, ("sequence_parallel = true on a pipeline stage of a Hugging Face model "
                     f"laid out by {plan}: that layout keeps the residual stream a DTensor "
                     "(the model computes positions from its full shape), which the "
                     "pipeline's point-to-point sends between stages cannot carry")
    embeddings = [p for p, s in specs.items() if s.style in _EMBEDDINGS]
    heads = [p for p, s in specs.items() if s.style == "colwise_gather" and "." not in p]
    if not embeddings:
        return out, (f"sequence_parallel = true, but {plan} does not split the token "
                     "embedding: the residual stream would start replicated, with nothing to "
                     "shard it onto the sequence")
    if not heads:
        return out, (f"sequence_parallel = true, but {plan} has no gathered output head "
                     "(colwise_gather_output) at the top of the model to gather the "
                     "sequence-sharded stream at its end")
    regions: list[str] = []
    for path, spec in specs.items():
        if spec.style in _GATHERING and path not in heads and "." in path:
            parent = path.rsplit(".", 1)[0]
            if parent not in specs and parent not in regions:
                regions.append(parent)
    # A region inside another (a shared expert in a MoE block) has its input gathered.
    regions = [r for r in regions if not _inside(r, regions)]
    local = [r for r in regions if _mixed(r, specs, modules)]
    for path, spec in specs.items():
        if _inside(path, regions) and spec.style in ("colwise", "colwise_gather"):
            # The region hands it its input gathered: declared sharded, torch's style would
            # redistribute it anyway, whose backward all-reduces each layer's partial input
            # gradient; declared replicated, the partial gradients add up and the region's
            # gather reduce-scatters their sum once.
            out[path] = attrs.evolve(spec, input_layouts=("replicate",))
        elif _inside(path, local) and spec.style == "rowwise":
            out[path] = attrs.evolve(spec, output_layouts=("replicate",),
                                     use_local_output=True)
        elif spec.style in _EMBEDDINGS or spec.style == "rowwise":
            out[path] = attrs.evolve(spec, output_layouts=SEQ, use_local_output=False)
        elif spec.style in ("colwise", "colwise_gather"):
            out[path] = spec if spec.input_layouts else attrs.evolve(spec, input_layouts=SEQ)
    for region in regions:
        out[region] = StyleSpec("sequence_region_local" if region in local
                                else "sequence_region")
    whole: list[str] = []
    for path, module in modules.items():
        if not path or path in out or _inside(path, regions) or _inside(path, out):
            continue  # inside attention / the MLP: on gathered or head-sharded values
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if is_norm(module):
            out[path] = StyleSpec("sequence_parallel")
        else:
            whole.append(path)
    if whole:
        patterns = dict.fromkeys(generalize(p) for p in whole)
        return dict(specs), (
            f"sequence_parallel = true, but {plan} leaves {', '.join(patterns)} "
            "whole outside any module whose layers it splits: they would compute on the "
            "sequence-sharded stream, which has no layout for them")
    return out, None


def _inside(path: str, parents: Iterable[str]) -> bool:
    return any(path.startswith(p + ".") for p in parents)


def _mixed(region: str, specs: Mapping[str, StyleSpec], modules: Mapping[str, Any]) -> bool:
    """Whether ``region`` computes on plain tensors beside its split layers: a router or
    another module no entry names, experts run on local parts, split layers one module
    further down (a shared expert). Such a region gets its gathered input as a plain
    tensor (``sequence_region_local``): every layer in it computes as under TP without
    sequence parallel, and its output goes back onto the sequence."""
    for path, module in modules.items():
        if not path.startswith(region + ".") or not any(
                True for _ in module.parameters(recurse=False)):
            continue
        spec = specs.get(path)
        if spec is None or spec.style == "experts" or path.rsplit(".", 1)[0] != region:
            return True
    return False

