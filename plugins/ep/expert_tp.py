"""How expert tensor parallelism splits each expert over the tp mesh dim (torchtitan's
ETP): the input projections (gate, up) column-wise, on their output features; the output
projection (down) row-wise, on its input features. Each tp rank then computes a partial
sum of every expert's output; the dispatch sums the partials over tp once they are back.

Which parameter is which is read from its name: torchtitan's and the MoE Llama's
``w1``/``w3``/``w2``, transformers' ``gate_up_proj``/``up_proj``/``down_proj`` and their
``_bias`` (transformers marks transposed weights, ``[experts, in, out]``, with
``is_transposed``, and gate and up interleaved rather than concatenated with
``is_concatenated = False``). No torch import: validation runs on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from .discovery import ExpertsSite

INPUT_PROJECTIONS = ("w1", "w3", "gate_up_proj", "gate_proj", "up_proj")
OUTPUT_PROJECTIONS = ("w2", "down_proj")
# Concatenated [gate; up] on the output features: each tp rank takes its part of both.
PACKED = "gate_up_proj"


@attrs.frozen
class ExpertSplit:
    """How one per-expert parameter is laid out over tp: ``tensor_dim`` split (``packed``:
    in the two halves' parts, as [gate; up] needs), or None: whole on every tp rank and
    counted on the first only (the output projection's bias: added after the partial
    sums would otherwise be summed tp times)."""

    name: str
    tensor_dim: int | None
    packed: bool = False


def expert_splits(site: ExpertsSite) -> list[ExpertSplit] | None:
    """The split of each of the site's parameters, or None if one of them has a name this
    module does not know (then EP cannot tell how to split it)."""
    module = site.module
    transposed = getattr(module, "is_transposed", False) is True
    concatenated = getattr(module, "is_concatenated", True) is not False
    splits = []
    for name in site.names:
        bias = name.endswith("_bias")
        base = name[: -len("_bias")] if bias else name
        if base in INPUT_PROJECTIONS:
            dim = 1 if bias or not transposed else 2
            splits.append(ExpertSplit(name, dim, packed=base == PACKED and concatenated))
        elif base in OUTPUT_PROJECTIONS:
            splits.append(ExpertSplit(name, None if kept_whole(name) else
                                      (1 if transposed else 2)))
        else:
            return None
    return splits


def kept_whole(name: str) -> bool:
    """Whether an expert parameter stays whole on every tp rank: the output projection's
    bias, added once to the sum of the partial outputs."""
    return name.endswith("_bias") and name[: -len("_bias")] in OUTPUT_PROJECTIONS


def intermediate_size(site: ExpertsSite, splits: list[ExpertSplit]) -> int | None:
    """Each expert's intermediate width (the output projection's split tensor dim): what
    the tp size must divide."""
    for split in splits:
        if split.tensor_dim is not None and split.name.split("_bias")[0] in OUTPUT_PROJECTIONS:
            return int(getattr(site.module, split.name).shape[split.tensor_dim])
    return None
