"""Local head counts for the attention that the auto plan's name fallback splits.

A model's own tp plan comes with a forward written for it; the Llama-name fallback
splits q, k and v column-wise in attention modules that may reshape by their global head
count (StableLm's ``view(bsz, q_len, self.num_heads, self.head_dim)``). After the split
each rank holds ``count / tp`` heads, so the attention's own head-count attributes are set
to those local counts (torchtitan keeps local head counts on its attention modules the
same way). Where that cannot make the forward right, validation refuses (CP431)."""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Mapping
from typing import Any

from composer_par.plugin import Finding

from .findings import HEAD_ATTRS, KV_HEAD_ATTRS
from .patterns import generalize
from .styles import SHARDED_OUTPUT_STYLES, StyleSpec

#: Projections whose column split divides an attention's heads.
QKV_LEAVES = ("wq", "wk", "wv", "q_proj", "k_proj", "v_proj")
COUNT_ATTRS = (*HEAD_ATTRS, *KV_HEAD_ATTRS)

LocalHeads = tuple[Any, str, int]  # (attention module, attribute, local count)


def _count(obj: Any, attr: str) -> int | None:
    value = getattr(obj, attr, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _forward_source(module: Any) -> str:
    try:
        return textwrap.dedent(inspect.getsource(type(module).forward))
    except (OSError, TypeError):
        return ""


def local_head_counts(
    modules: Mapping[str, Any], entries: list[tuple[str, Any, StyleSpec]], tp_size: int
) -> tuple[list[LocalHeads], list[Finding]]:
    """The head-count attributes to set on each attention whose q/k/v the fallback splits
    column-wise, and CP431 where setting them cannot make its forward right: the forward
    reads a head count from the model's config (shared by every layer, and the model's
    global description), or a module inside the attention keeps its own per-head state
    (StableLm's per-head q/k layer norms: one norm per global head). A count the tp size
    does not divide is CP407's, and left alone here."""
    attentions: dict[str, Any] = {}
    for path, _, spec in entries:
        if spec.style in SHARDED_OUTPUT_STYLES and "." in path:
            parent, leaf = path.rsplit(".", 1)
            if leaf in QKV_LEAVES and parent in modules:
                attentions.setdefault(parent, modules[parent])
    local: list[LocalHeads] = []
    refused: dict[str, list[str]] = {}
    for path, module in attentions.items():
        counts = {a: v for a in COUNT_ATTRS if (v := _count(module, a)) is not None}
        source = _forward_source(module)
        from_config = [a for a in COUNT_ATTRS if re.search(rf"config\.{a}\b", source)]
        if from_config:
            refused.setdefault(
                f"its forward reads config.{from_config[0]}, the global head count of the "
                "whole model, which TP cannot make local to one attention (its forward "
                "would reshape by the global count)", []).append(path)
            continue
        inner = next(((n, a) for n, m in module.named_modules() if n for a in COUNT_ATTRS
                      if _count(m, a) is not None), None)
        if inner is not None:
            refused.setdefault(
                f"{inner[0]} inside it keeps per-head state for {inner[1]}="
                f"{_count(module.get_submodule(inner[0]), inner[1])} global heads, which a "
                "rank holding some of the heads would pair with the wrong ones",
                []).append(path)
            continue
        if any(v % tp_size for v in counts.values()):
            continue  # CP407
        local += [(module, attr, value // tp_size) for attr, value in counts.items()]
    found = []
    for why, paths in refused.items():
        names = ", ".join(dict.fromkeys(generalize(p) for p in paths))
        kind = type(attentions[paths[0]]).__name__
        found.append(Finding(
            "CP431",
            f"the auto plan (recognized names) splits q, k and v of {names} ({kind}) "
            f"column-wise over tp({tp_size}), so each rank holds 1/{tp_size} of its heads, "
            f"but {why}",
            fix=f"give TP(plan={{...}}) explicitly with {names} left out (replicated), or "
            "use a model whose attention reshapes by -1 or by its own head-count "
            "attributes (docs/tp.md)"))
    return local, found


def set_local_head_counts(local: list[LocalHeads]) -> int:
    """Set each attention's head counts to its rank's (after its q/k/v are split)."""
    for module, attr, value in local:
        setattr(module, attr, value)
    return len({id(m) for m, _, _ in local})
